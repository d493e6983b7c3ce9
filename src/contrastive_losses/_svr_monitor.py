"""The regulariser's training checks, each a warning at the user's line, once:

* its radius never trains (its parameters are in no optimizer that steps;
  :class:`~contrastive_losses._param_watch.ParameterWatch`, under ``torch.compile`` too);
* it was built again while an earlier one of the same shape is alive whose radius got
  gradients but was left out of the optimizer (a regulariser built inside the training
  loop restarts its radius from ``radius_init`` at every step);
* the radius sits above the anchor-positive distance for a streak of optimizer steps
  that is long for the run so far: at least ``over_distance_steps`` and at least
  ``over_distance_share`` of the steps since training began, so a short fine-tune is
  told as well as a long one (SupCLAP's perpendicular pushes reversed).

Steps are optimizer steps (:mod:`~contrastive_losses._optimizer_steps`): gradient
accumulation counts one per ``optimizer.step()``.

Private: :class:`~contrastive_losses.svr.SupportVectorRegularizer` inherits it; the
thresholds stay settable on the regulariser (``stuck_after``, ``over_distance_steps``,
``over_distance_share``, ``over_distance_check_every``).
"""

from __future__ import annotations

import weakref
from typing import Any, cast

import torch
from torch import Tensor, nn

from . import _optimizer_steps
from ._param_watch import ParameterWatch
from ._warnings import warn_at_caller

# The learnable regularisers alive, for the rebuilt-in-the-loop check (held weakly).
_alive: weakref.WeakSet[Any] = weakref.WeakSet()


class _RadiusMonitor:
    """Training checks of a regulariser that has ``predictor`` (or ``None``), ``radius``
    and ``radius_mode``; :meth:`_monitor` is called from its ``forward``."""

    predictor: Any
    radius: Any
    radius_mode: str
    radius_init: float
    base: nn.Module
    direction: str
    beta: float
    # The thresholds, documented and set on the regulariser.
    stuck_after: int
    over_distance_steps: int
    over_distance_share: float
    over_distance_check_every: int

    def _radius_parameters(self) -> list[nn.Parameter]:
        """The regulariser's own trainable parameters (not the base's temperature)."""
        if self.predictor is not None:
            return [p for p in self.predictor.parameters() if p.requires_grad]
        radius = self.radius
        return [radius] if isinstance(radius, nn.Parameter) and radius.requires_grad else []

    def _arm_watch(self) -> None:
        params = self._radius_parameters()
        self._watch.arm(cast(nn.Module, self), params, ["radius"] * len(params))

    def _reset_monitor(self) -> None:
        self._watch = ParameterWatch(
            f"SupportVectorRegularizer: the {self.radius_mode} {{what}} ({{names}}) got "
            "gradients in {steps} optimizer steps that did not hold it and never changed "
            "from its initial value, so the SVR runs at a fixed radius. Are the "
            "regulariser's parameters in the optimizer? Pass them with the model's, e.g. "
            "torch.optim.Adam([*model.parameters(), *loss_fn.parameters()])."
        )
        self._arm_watch()
        self._over_streak: Tensor | None = None  # consecutive steps above, on the device
        self._over_step: Tensor | None = None  # every batch of this step above
        self._over_steps = 0
        self._over_done = False
        if self._radius_parameters():
            self._warn_if_rebuilt()
            _alive.add(self)

    def _shape(self) -> tuple[Any, ...]:
        """What a regulariser rebuilt with the same arguments repeats."""
        p = self.predictor
        sizes = None if p is None else (p.num_features, p.hidden)
        return (type(self.base), self.radius_mode, self.radius_init, self.direction, sizes)

    def _warn_if_rebuilt(self) -> None:
        """Warn at the constructor's line if an earlier regulariser of this shape is
        alive and its radius got gradients before optimizer steps that never held it."""
        shape = self._shape()
        if any(
            other._shape() == shape and other._watch.counted_without_optimizer()
            for other in list(_alive)
        ):
            warn_at_caller(
                "svr rebuilt",
                f"SupportVectorRegularizer: built while an earlier one of the same shape "
                f"(radius={self.radius_mode!r}, radius_init={self.radius_init:g}) is alive "
                "whose radius got gradients but was in no optimizer that stepped. Is it "
                "built inside the training loop? Each new one starts its radius from "
                "radius_init again, so nothing trains it: build it once, before the loop, "
                "and pass loss_fn.parameters() to the optimizer with the model's.",
            )

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy or an unpickled regulariser watches its own radius parameters."""
        super().__setstate__(state)  # type: ignore[misc]
        self._arm_watch()

    def _rearm_watch(self) -> None:
        """Watch the radius parameters again if they were replaced (eager calls only)."""
        params = self._radius_parameters()
        self._watch.rearm(cast(nn.Module, self), params, ["radius"] * len(params))

    def _monitor(self, over: Tensor) -> None:
        """Note on the device whether ``radius_over_distance > 0.5`` in this batch; the
        optimizer step that follows extends or breaks the streak
        (:meth:`_optimizer_stepped`). (The radius that never trains is watched from
        autograd's side, under ``torch.compile`` too: :class:`~contrastive_losses.
        _param_watch.ParameterWatch`, armed here and after a copy.)"""
        if self._over_done:
            return
        above = over.detach() > 0.5
        step = self._over_step
        self._over_step = above if step is None or step.device != above.device else step & above
        _optimizer_steps.listen(self)  # the next optimizer step reads it

    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """One optimizer step: a step whose every batch had the radius above extends the
        streak, any other breaks it; read every ``over_distance_check_every`` steps (one
        host sync) and warned once, at the user's ``optimizer.step()`` line, when it is at
        least ``over_distance_steps`` long and covers at least ``over_distance_share`` of
        the optimizer steps so far (a threshold that grows with the run: a short run is
        told after a few dozen steps, a long one is not told of a brief excursion)."""
        above, self._over_step = self._over_step, None
        if self._over_done or above is None:  # (None: no training batch since the last step)
            return
        streak = self._over_streak
        if streak is None or streak.device != above.device:
            streak = torch.zeros((), dtype=torch.long, device=above.device)
        self._over_streak = torch.where(above, streak + 1, torch.zeros_like(streak))
        self._over_steps += 1
        if self._over_steps % self.over_distance_check_every != 0:
            return
        count = int(self._over_streak)
        needed = max(self.over_distance_steps, self.over_distance_share * self._over_steps)
        if count < needed:
            return
        self._over_done = True
        warn_at_caller(
            "svr over distance",
            "SupportVectorRegularizer: radius_over_distance stayed above 0.5 for "
            f"{count} consecutive optimizer steps (of {self._over_steps} so far, beta="
            f"{self.beta:g}): for most anchors R > ||a+ - t||, where "
            "the factor 1 - R/||a+ - t|| is negative and the perpendicular pushes are "
            "reversed, not damped. Raise beta (the constraint weight; constraint=True for "
            "a static radius), lower radius_init, or fix the radius (see 'Where the radius "
            "goes' on the SVR page of the docs).",
            once=False,
        )
