"""The regulariser's training checks: warn once when its radius never trains (its
parameters are missing from the optimizer; :class:`~contrastive_losses._param_watch.
ParameterWatch`, which works under ``torch.compile`` too) and once when the radius sits
above the anchor-positive distance for long (SupCLAP's perpendicular pushes reversed).

Private: :class:`~contrastive_losses.svr.SupportVectorRegularizer` inherits it; the
thresholds stay settable on the regulariser (``stuck_after``, ``over_distance_steps``,
``over_distance_check_every``).
"""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch
from torch import Tensor, nn

from ._param_watch import ParameterWatch


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
        self._watch = ParameterWatch(
            f"SupportVectorRegularizer: the {self.radius_mode} radius got gradients in "
            "{steps} training steps but never changed from its initial value, so the SVR "
            "runs at a fixed radius. Are the regulariser's parameters in the optimizer? "
            "Pass them with the model's, e.g. torch.optim.Adam("
            "[*model.parameters(), *loss_fn.parameters()])."
        )
        self._watch.arm(cast(nn.Module, self), self._radius_parameters())
        self._over_streak: Tensor | None = None
        self._over_calls = 0
        self._over_done = False

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy or an unpickled regulariser watches its own radius parameters."""
        super().__setstate__(state)  # type: ignore[misc]
        self._watch.arm(cast(nn.Module, self), self._radius_parameters())

    def _rearm_watch(self) -> None:
        """Watch the radius parameters again if they were replaced (eager calls only)."""
        self._watch.rearm(cast(nn.Module, self), self._radius_parameters())

    def _monitor(self, over: Tensor) -> None:
        """Warn once if the radius sits above the distance: a device-side count of
        consecutive forwards with ``radius_over_distance > 0.5``, read every
        ``over_distance_check_every`` forwards. (The radius that never trains, its
        parameters missing from the optimizer, is watched from autograd's side, under
        ``torch.compile`` too: :class:`~contrastive_losses._param_watch.ParameterWatch`,
        armed here and after a copy.)"""
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
