"""The guarded optimizer update of a training step: a non-finite loss or gradient never reaches
the weights; clipping, the fp16 GradScaler and the learning-rate schedule."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class UpdateOutcome:
    """What the update did: the gradient norm (NaN when the loss was not finite), whether the
    step was skipped, and whether it counts as non-finite (a GradScaler overflow does not)."""

    grad_norm: Tensor
    skipped: bool
    counted: bool


def guarded_update(
    loss: Tensor,
    params: Sequence[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    scheduler: Any,
    grad_clip: float,
    running: Sequence[Tensor],
    saved_running: Sequence[Tensor],
) -> UpdateOutcome:
    """Unscale, clip and step unless ``loss`` (already averaged over ranks) or the gradient is
    NaN/Inf; a skipped step clears the gradients and puts back the running statistics
    (``running``, saved before the forward as ``saved_running``). The schedule steps either way.

    Under fp16 the GradScaler skips overflowing steps itself and lowers its scale; those count
    as non-finite only once the scale has fallen below 1 (then it is not an overflow).
    """
    grad_norm = torch.tensor(float("nan"))
    skipped = counted = not bool(torch.isfinite(loss))
    if not skipped:
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            list(params), grad_clip if grad_clip > 0 else float("inf")
        )
        skipped = not bool(torch.isfinite(grad_norm))
        counted = skipped and not (scaler.is_enabled() and scaler.get_scale() >= 1)
        if not skipped or scaler.is_enabled():
            scaler.step(optimizer)
            scaler.update()
    if skipped:
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for tensor, old in zip(running, saved_running, strict=True):
                tensor.copy_(old)
    with warnings.catch_warnings():
        # A skipped first step: the schedule follows the step count, skipped steps
        # included, so stepping it before any optimizer.step() is what we want.
        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step")
        scheduler.step()
    return UpdateOutcome(grad_norm, skipped, counted)
