"""Optimizer steps, seen from inside a loss: the training checks count them.

A loss cannot see the training loop, but every ``torch.optim.Optimizer`` (Hugging Face's,
Lightning's and open_clip's optimizers are ones) runs the global post-step hooks after
its ``step()``. One such hook, registered while some check listens and removed when none
does, tells the listeners which optimizer stepped; :func:`held` says which of their
parameters it holds. So a check counts optimizer steps, not backward passes (64
micro-batches of gradient accumulation are one step), and knows a parameter held at a
learning rate of 0 (a warm-up) from one left out.

Listeners are held weakly: a loss dropped while it listens is freed (no cycle through
a global), and listening costs nothing once every listener has decided.

Private: :class:`~contrastive_losses._param_watch.ParameterWatch` and the regulariser's
over-distance check (:mod:`~contrastive_losses._svr_monitor`) listen.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle


class StepListener(Protocol):
    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> bool:
        """One optimizer step has run; return whether to keep listening."""
        ...


_listeners: weakref.WeakSet[Any] = weakref.WeakSet()
_handle: RemovableHandle | None = None


def listen(listener: StepListener) -> None:
    """Tell ``listener`` about every optimizer step from now on, until it returns False."""
    global _handle
    _listeners.add(listener)
    if _handle is None:
        _handle = register_optimizer_step_post_hook(_stepped)


def stop(listener: StepListener) -> None:
    """Tell ``listener`` no more."""
    _listeners.discard(listener)


def _stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The global post-step hook."""
    global _handle
    for listener in list(_listeners):
        if not listener._optimizer_stepped(optimizer):
            _listeners.discard(listener)
    if not _listeners and _handle is not None:
        _handle.remove()
        _handle = None


def held(optimizer: torch.optim.Optimizer, params: list[Tensor]) -> list[bool]:
    """For each of ``params``: whether one of ``optimizer``'s param groups holds it (at
    any learning rate: one held at 0, a warm-up or a group kept at 0, is still in the
    optimizer)."""
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [id(p) in ids for p in params]
