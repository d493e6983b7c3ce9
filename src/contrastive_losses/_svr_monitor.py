"""The regulariser's training checks: warn once when its radius never trains (its
parameters are missing from the optimizer) and once when the radius sits above the
anchor-positive distance for long (SupCLAP's perpendicular pushes reversed).

Private: :class:`~contrastive_losses.svr.SupportVectorRegularizer` inherits it; the
thresholds stay settable on the regulariser (``stuck_after``, ``over_distance_steps``,
``over_distance_check_every``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn


class _RadiusMonitor:
    """Training checks of a regulariser that has ``predictor`` (or ``None``), ``radius``
    and ``radius_mode``; :meth:`_monitor` is called from its ``forward``."""

    predictor: Any
    radius: Any
    radius_mode: str
    # The thresholds, documented and set on the regulariser.
    stuck_after: int
    over_distance_steps: int
    over_distance_check_every: int

    def _radius_parameters(self) -> list[nn.Parameter]:
        """The regulariser's own trainable parameters (not the base's temperature)."""
        if self.predictor is not None:
            return [p for p in self.predictor.parameters() if p.requires_grad]
        radius = self.radius
        return [radius] if isinstance(radius, nn.Parameter) and radius.requires_grad else []

    def _reset_monitor(self) -> None:
        self._stuck_done = False
        self._stuck_calls = 0
        self._initial: list[Tensor] | None = None
        self._over_streak: Tensor | None = None
        self._over_calls = 0
        self._over_done = False

    def _monitor(self, over: Tensor) -> None:
        """Warn once if the radius never trains, and once if it sits above the distance.

        Stuck radius: at the first training forward the radius' parameters are copied;
        forwards that find gradients on them are counted (an optimizer holding them clears
        the gradients with ``zero_grad(set_to_none=True)``, so those are mostly the runs
        where it does not). After ``stuck_after`` of them, if the values still equal the
        copy although some gradient is non-zero, the parameters never reach an optimizer.
        A learning-rate warm-up or gradient accumulation delays the first change by a few
        steps, not by ``stuck_after``; a zero gradient (``alpha = 0``, no active
        constraint) is not reported. One device sync, once.

        Radius above the distance: a device-side count of consecutive forwards with
        ``radius_over_distance > 0.5``, read every ``over_distance_check_every`` forwards.
        """
        if not self._stuck_done:
            params = self._radius_parameters()
            if not params:
                self._stuck_done = True
            elif self._initial is None:
                self._initial = [p.detach().clone() for p in params]
            elif any(p.grad is not None for p in params):
                self._stuck_calls += 1
                if self._stuck_calls >= self.stuck_after:
                    self._stuck_done = True
                    unchanged = all(
                        p.shape == q.shape and torch.equal(p.detach(), q)
                        for p, q in zip(params, self._initial, strict=True)
                    )
                    with torch.no_grad():
                        has_grad = any(
                            bool(p.grad.ne(0).any()) for p in params if p.grad is not None
                        )
                    self._initial = None
                    if unchanged and has_grad:
                        warnings.warn(
                            f"SupportVectorRegularizer: the {self.radius_mode} radius got "
                            f"gradients in {self.stuck_after} training steps but never "
                            "changed from its initial value, so the SVR runs at a fixed "
                            "radius. Are the regulariser's parameters in the optimizer? "
                            "Pass them with the model's, e.g. torch.optim.Adam("
                            "[*model.parameters(), *loss_fn.parameters()]).",
                            UserWarning,
                            stacklevel=5,  # the caller of loss_fn(...)
                        )
        if self._over_done:
            return
        above = over.detach() > 0.5
        streak = self._over_streak
        if streak is None or streak.device != above.device:
            streak = torch.zeros((), dtype=torch.long, device=above.device)
        self._over_streak = torch.where(above, streak + 1, torch.zeros_like(streak))
        self._over_calls += 1
        if self._over_calls % self.over_distance_check_every != 0:
            return
        if int(self._over_streak) >= self.over_distance_steps:
            self._over_done = True
            warnings.warn(
                "SupportVectorRegularizer: radius_over_distance stayed above 0.5 for "
                f"{int(self._over_streak)} consecutive training steps: for most anchors "
                "R > ||a+ - t||, where the factor 1 - R/||a+ - t|| is negative and the "
                "perpendicular pushes are reversed, not damped. Raise beta (the constraint "
                "weight; constraint=True for a static radius), lower radius_init, or fix the "
                "radius (see 'Where the radius goes' on the SVR page of the docs).",
                UserWarning,
                stacklevel=5,  # the caller of loss_fn(...)
            )
