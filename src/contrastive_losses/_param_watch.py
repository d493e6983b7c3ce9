"""Warn once when a loss's own trainable parameters get gradients but never change.

A learnable temperature, SigLIP's learnable scale and bias, or the regulariser's radius
left out of the optimizer train nothing, silently: the loss runs at their initial
values. :class:`ParameterWatch` notices it from the eager side of autograd, so it works
the same under ``torch.compile`` (no graph break, no recompile): a post-accumulate-grad
hook on each parameter (registered when the loss is built, outside any compiled region)
copies the parameter at its first gradient and, once one of them has received
``owner.stuck_after`` gradients in training mode, compares the values with the copies.
Unchanged although a gradient is non-zero: they never reached an optimizer, and one
warning says so at the user's ``loss.backward()`` line. Then the hooks are removed, so
the watch costs nothing afterwards; one host sync, once.

A learning-rate warm-up or gradient accumulation delays the first change by a few
steps, not by ``stuck_after``; a zero gradient (a frozen term) is not reported; with
the owner's value checks off (``validate_args``) nothing is compared.

Private: :class:`~contrastive_losses.InfoNCELoss` and the other temperature losses,
:class:`~contrastive_losses.SigLIPLoss` and
:class:`~contrastive_losses.SupportVectorRegularizer` hold one.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import Tensor, nn

from . import _checks, _compat
from ._warnings import warn_at_caller


class ParameterWatch:
    """One warning, ``message`` (``{steps}``: the owner's ``stuck_after``), when the
    parameters armed with :meth:`arm` get gradients but never change.

    The owner has ``training``, ``validate_args`` and ``stuck_after``; it calls
    :meth:`arm` when built and again after a copy (:meth:`rearm`)."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.done = False
        self._clear()

    def _clear(self) -> None:
        self._owner: Any = None
        self._params: list[nn.Parameter] = []
        self._snapshots: list[Tensor | None] = []
        self._counts: list[int] = []
        self._handles: list[Any] = []

    def __getstate__(self) -> dict[str, Any]:
        """The message and whether it is done; hooks, copies and the owner stay behind
        (a copy or an unpickled loss arms its own watch: :meth:`rearm`)."""
        return {"message": self.message, "done": self.done}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._clear()

    def arm(self, owner: nn.Module, params: list[nn.Parameter]) -> None:
        """Watch ``params`` (those that require grad) of ``owner``, from scratch."""
        self.disarm()
        if self.done:
            return
        self._owner = weakref.ref(owner)
        self._params = [p for p in params if p.requires_grad]
        self._snapshots = [None] * len(self._params)
        self._counts = [0] * len(self._params)
        self._handles = [
            p.register_post_accumulate_grad_hook(functools.partial(self._accumulated, i))
            for i, p in enumerate(self._params)
        ]

    def rearm(self, owner: nn.Module, params: list[nn.Parameter]) -> None:
        """:meth:`arm` again where the watched parameters are no longer ``params`` (a
        deep copy, ``load_state_dict(assign=True)``); eager only (a cheap identity test)."""
        if _compat.is_compiling() or self.done:  # traced: read nothing (no guard)
            return
        current = [p for p in params if p.requires_grad]
        if len(current) != len(self._params) or any(
            p is not q for p, q in zip(current, self._params, strict=True)
        ):
            self.arm(owner, params)

    def disarm(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _accumulated(self, i: int, param: Tensor) -> None:
        """The hook: parameter ``i`` just received a gradient."""
        owner = None if self._owner is None else self._owner()
        if self.done or owner is None or not owner.training:
            return
        if self._snapshots[i] is None:
            self._snapshots[i] = param.detach().clone()
        self._counts[i] += 1
        steps = int(owner.stuck_after)
        if self._counts[i] < steps:
            return
        self.done = True
        self.disarm()
        if _checks.resolve_validate(owner.validate_args) and self._stuck():
            warn_at_caller("stuck", self.message.format(steps=steps), once=False)
        self._clear()

    def _stuck(self) -> bool:
        """Every watched parameter equals its copy and some gradient is non-zero."""
        with torch.no_grad():
            unchanged = all(
                s is None or (p.shape == s.shape and torch.equal(p, s))
                for p, s in zip(self._params, self._snapshots, strict=True)
            )
            return unchanged and any(
                p.grad is not None and bool(p.grad.ne(0).any()) for p in self._params
            )
