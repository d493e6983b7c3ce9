"""Warn once when a loss's own trainable parameters get gradients but no optimizer
steps them.

A learnable temperature, SigLIP's learnable scale and bias, or the regulariser's radius
left out of the optimizer train nothing, silently: the loss runs at their initial
values. :class:`ParameterWatch` judges each parameter on its own, from two hooks that
both live outside any compiled region (so it works the same under ``torch.compile``: no
graph break, no recompile):

* a post-accumulate-grad hook on each parameter (registered when the loss is built)
  notes that it got a gradient in training mode, and copies it at its first;
* the global optimizer post-step hook (:mod:`~contrastive_losses._optimizer_steps`)
  then looks up each parameter in the optimizer that stepped. Held, at any learning
  rate (0 included: a warm-up held at 0, a param group kept at 0): it is in the
  optimizer, settled, never reported. Not held although it got a gradient since the
  previous step: one step counted.

After ``owner.stuck_after`` counted steps, a parameter still equal to its copy with a
non-zero gradient is reported, by name, in one warning at the user's ``optimizer.step()``
line (one host sync, once); then the hooks are removed, so the watch costs nothing
afterwards. Gradient accumulation counts one step per optimizer step. A loop that
updates parameters without a ``torch.optim.Optimizer`` is not watched; with the owner's
value checks off (``validate_args``) nothing is compared.

The watch holds its owner, its parameters and itself (in the hooks) through weak
references: a loss dropped before the watch decides is freed.

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

from . import _checks, _compat, _optimizer_steps
from ._warnings import warn_at_caller


class ParameterWatch:
    """One warning, ``message`` (``{what}``: the labels of the parameters reported,
    ``{names}``: their names in the owner, ``{them}``: "it" or "them" as they are one or
    several, ``{steps}``: the owner's ``stuck_after``),
    when parameters armed with :meth:`arm` get gradients in that many optimizer steps
    that do not hold them and never change.

    The owner has ``training``, ``validate_args`` and ``stuck_after``; it calls
    :meth:`arm` when built and again after a copy (:meth:`rearm`)."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.done = False
        self._clear()

    def _clear(self) -> None:
        # the owner has training, validate_args and stuck_after (Any: nn.Module's
        # __getattr__ types them as tensors)
        self._owner: weakref.ref[Any] | None = None
        self._params: list[weakref.ref[Tensor]] = []
        self._labels: list[str] = []
        self._snapshots: list[Tensor | None] = []
        self._fresh: list[bool] = []  # a gradient since the last optimizer step
        self._counts: list[int] = []  # optimizer steps that did not hold it after one
        self._settled: list[bool] = []
        self._handles: list[Any] = []
        self._listening = False

    def __getstate__(self) -> dict[str, Any]:
        """The message and whether it is done; hooks, copies and the owner stay behind
        (a copy or an unpickled loss arms its own watch: :meth:`rearm`)."""
        return {"message": self.message, "done": self.done}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._clear()

    def arm(self, owner: nn.Module, params: list[nn.Parameter], labels: list[str]) -> None:
        """Watch ``params`` (those that require grad) of ``owner``, from scratch;
        ``labels[i]`` names ``params[i]`` in the warning (``{what}``)."""
        self.disarm()
        if self.done:
            return
        kept = [(p, label) for p, label in zip(params, labels, strict=True) if p.requires_grad]
        self._clear()
        self._owner = weakref.ref(owner)
        self._params = [weakref.ref(p) for p, _ in kept]
        self._labels = [label for _, label in kept]
        n = len(kept)
        self._snapshots, self._fresh = [None] * n, [False] * n
        self._counts, self._settled = [0] * n, [False] * n
        me = weakref.ref(self)  # the hooks must not keep the watch (nor its owner) alive
        self._handles = [
            p.register_post_accumulate_grad_hook(functools.partial(_gradient, me, i))
            for i, (p, _) in enumerate(kept)
        ]

    def rearm(self, owner: nn.Module, params: list[nn.Parameter], labels: list[str]) -> None:
        """:meth:`arm` again where the watched parameters are no longer ``params`` (a
        deep copy, ``load_state_dict(assign=True)``); eager only (a cheap identity test)."""
        if _compat.is_compiling() or self.done:  # traced: read nothing (no guard)
            return
        current = [p for p in params if p.requires_grad]
        if len(current) != len(self._params) or any(
            p is not q() for p, q in zip(current, self._params, strict=True)
        ):
            self.arm(owner, params, labels)

    def disarm(self) -> None:
        """Remove the hooks and stop listening to optimizer steps."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._listening:
            _optimizer_steps.stop(self)
            self._listening = False

    def counted_without_optimizer(self) -> bool:
        """Whether some parameter got a gradient before an optimizer step that did not
        hold it, and no optimizer that stepped ever held one."""
        return any(self._counts) and not any(self._settled)

    def _gradient(self, i: int, param: Tensor) -> None:
        """Parameter ``i`` just received a gradient."""
        owner = None if self._owner is None else self._owner()
        if self.done or owner is None or not owner.training:
            return
        if self._snapshots[i] is None:
            self._snapshots[i] = param.detach().clone()
        self._fresh[i] = True
        if not self._listening:
            self._listening = True
            _optimizer_steps.listen(self)

    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Count this step against each parameter it does not hold; report those due.
        Returns whether to keep listening."""
        owner = None if self._owner is None else self._owner()
        params: list[Any] = [ref() for ref in self._params]
        pending = [i for i, p in enumerate(params) if p is not None and not self._settled[i]]
        if self.done or owner is None or not pending:
            return self._finish()
        holds = _optimizer_steps.held(optimizer, [params[i] for i in pending])
        for i, in_optimizer in zip(pending, holds, strict=True):
            if in_optimizer:  # at any learning rate: a warm-up from 0 is no false alarm
                self._settled[i] = True
            else:
                self._counts[i] += self._fresh[i]
            self._fresh[i] = False
        steps = int(owner.stuck_after)
        due = [i for i in pending if not self._settled[i] and self._counts[i] >= steps]
        if due:
            for i in due:
                self._settled[i] = True
            checks = _checks.resolve_validate(owner.validate_args)  # off: read nothing
            stuck = [i for i in due if checks and self._unchanged(params[i], i)]
            if stuck:
                self._report(owner, [params[i] for i in stuck], [self._labels[i] for i in stuck])
                return self._finish()
        if all(self._settled[i] for i in pending):
            return self._finish()  # every parameter is in an optimizer: quiet for good
        return True

    def _report(self, owner: Any, params: list[Any], labels: list[str]) -> None:
        """The one warning, naming ``params``."""
        names = [n for n, p in owner.named_parameters() if any(p is q for q in params)]
        what = " and ".join(dict.fromkeys(labels))  # in order, each once
        quoted = ", ".join(f"'{n}'" for n in names)
        them = "it" if len(names) == 1 else "them"
        message = self.message.format(
            what=what, names=quoted, them=them, steps=int(owner.stuck_after)
        )
        self.done = True
        warn_at_caller("stuck", message, once=False)

    def _finish(self) -> bool:
        """Decided (or the owner is gone): remove the hooks. Returns False (stop)."""
        self.disarm()
        self._clear()
        self.done = True
        return False

    def _unchanged(self, param: Tensor, i: int) -> bool:
        """Parameter ``i`` equals its copy at its first gradient and its gradient is
        non-zero."""
        snapshot = self._snapshots[i]
        with torch.no_grad():
            return (
                snapshot is not None
                and param.shape == snapshot.shape
                and torch.equal(param, snapshot)
                and param.grad is not None
                and bool(param.grad.ne(0).any())
            )


def _gradient(watch: weakref.ref[ParameterWatch], i: int, param: Tensor) -> None:
    """The post-accumulate-grad hook, holding its watch weakly."""
    live = watch()
    if live is not None:
        live._gradient(i, param)
