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
line (one host sync, once), unless some live optimizer holds it (one that has not
stepped yet: a temperature's own optimizer started late is no false alarm; found by one
pass over the live objects, ``gc.get_objects()``, at that moment only). Decided, a
watch removes its gradient hooks, so it costs nothing afterwards. Gradient accumulation
counts one step per optimizer step. A loop that updates parameters without a
``torch.optim.Optimizer`` is not watched; with the owner's value checks off
(``validate_args``) nothing is compared.

Every watch's undecided parameters sit in one table (:data:`_TABLE`), keyed by the
parameter's ``id``, that is the only listener to optimizer steps: a step costs one
set intersection with the stepping optimizer's (cached) parameter ids, whatever the
number of losses alive, plus a few operations per parameter that got a gradient since
the step before. A lock guards the table (threads training their own losses).

The watch holds its owner, its parameters and itself (in the hooks) through weak
references: a loss dropped before the watch decides is freed.

Private: :class:`~contrastive_losses.InfoNCELoss` and the other temperature losses,
:class:`~contrastive_losses.SigLIPLoss` and
:class:`~contrastive_losses.SupportVectorRegularizer` hold one.
"""

from __future__ import annotations

import functools
import gc
import threading
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
        self._counts: list[int] = []  # optimizer steps that did not hold it after one
        self._settled: list[bool] = []
        self._handles: list[Any] = []

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
        with _TABLE.lock:  # another thread's step may be judging this watch
            self.disarm()
            if self.done:
                return
            kept = [(p, lb) for p, lb in zip(params, labels, strict=True) if p.requires_grad]
            self._clear()
            self._owner = weakref.ref(owner)
            self._params = [weakref.ref(p) for p, _ in kept]
            self._labels = [label for _, label in kept]
            n = len(kept)
            self._snapshots, self._counts, self._settled = [None] * n, [0] * n, [False] * n
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
        """Remove the hooks and leave the table."""
        with _TABLE.lock:
            for handle in self._handles:
                handle.remove()
            self._handles = []
            _TABLE.forget(self)

    def counted_without_optimizer(self) -> bool:
        """Whether some parameter got a gradient before an optimizer step that did not
        hold it, and no optimizer that stepped ever held one."""
        return any(self._counts) and not any(self._settled)

    def _gradient(self, i: int, param: Tensor) -> None:
        """Parameter ``i`` just received a gradient. Under the table's lock: another
        thread's optimizer step may be deciding this watch (and clearing its lists)."""
        with _TABLE.lock:
            owner = None if self._owner is None else self._owner()
            if self.done or owner is None or not owner.training:
                return
            if i >= len(self._params) or self._params[i]() is not param or self._settled[i]:
                return  # a hook of an earlier arm, called as this one re-armed
            if self._snapshots[i] is None:
                self._snapshots[i] = param.detach().clone()
            _TABLE.fresh_gradient(self, i, param)

    def _judge(self, due: list[int]) -> None:
        """Parameters ``due`` reached ``stuck_after`` counted steps (and are settled):
        report those unchanged and held by no live optimizer; finish once all are
        settled."""
        owner = None if self._owner is None else self._owner()
        if self.done or owner is None:
            self._finish()
            return
        params: list[Any] = [self._params[i]() for i in due]
        checks = _checks.resolve_validate(owner.validate_args)  # off: read nothing
        stuck = [
            (i, p)
            for i, p in zip(due, params, strict=True)
            if checks and p is not None and self._unchanged(p, i)
        ]
        if stuck:
            late = _held_by_a_live_optimizer([p for _, p in stuck])
            stuck = [pair for pair, held in zip(stuck, late, strict=True) if not held]
        if stuck:
            self._report(owner, [p for _, p in stuck], [self._labels[i] for i, _ in stuck])
            self._finish()

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

    def _finish(self) -> None:
        """Decided (or the owner is gone): remove the hooks."""
        self.disarm()
        self._clear()
        self.done = True

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


class _Entry:
    """An undecided parameter of a watch in :data:`_TABLE`."""

    __slots__ = ("index", "param", "watch")

    def __init__(self, watch: ParameterWatch, index: int, param: Tensor, key: int) -> None:
        dead = functools.partial(_TABLE.dead.append, key)  # list.append: no lock needed
        self.watch = weakref.ref(watch, lambda _: dead())
        self.param = weakref.ref(param, lambda _: dead())
        self.index = index


class _Table:
    """Every watch's parameters that got a gradient and are undecided, by ``id``; the one
    listener to optimizer steps of all the watches."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.undecided: dict[int, _Entry] = {}
        self.fresh: dict[int, _Entry] = {}  # a gradient since the last optimizer step
        self.dead: list[int] = []  # keys whose parameter or watch was freed

    def fresh_gradient(self, watch: ParameterWatch, i: int, param: Tensor) -> None:
        key = id(param)
        with self.lock:
            entry = self.undecided.get(key)
            if entry is None or entry.watch() is not watch or entry.param() is not param:
                entry = self.undecided[key] = _Entry(watch, i, param, key)
            self.fresh[key] = entry
        _optimizer_steps.listen(self)

    def forget(self, watch: ParameterWatch) -> None:
        """Drop ``watch``'s entries."""
        with self.lock:
            for ref in watch._params:
                param = ref()
                entry = None if param is None else self.undecided.get(id(param))
                if entry is not None and entry.watch() is watch:
                    del self.undecided[id(param)]
                    self.fresh.pop(id(param), None)

    def _sweep(self) -> None:
        """Drop the entries whose parameter or watch was freed."""
        while self.dead:
            key = self.dead.pop()
            entry = self.undecided.get(key)
            if entry is not None and (entry.param() is None or entry.watch() is None):
                del self.undecided[key]
                self.fresh.pop(key, None)

    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """Settle each undecided parameter ``optimizer`` holds, count this step against
        each other one that got a gradient since the last step, then judge those due
        (one host sync each, once)."""
        due: dict[ParameterWatch, list[int]] = {}
        settled: set[ParameterWatch] = set()
        with self.lock:
            self._sweep()
            for key in self.undecided.keys() & _optimizer_steps.held_ids(optimizer):
                entry = self.undecided.pop(key)
                self.fresh.pop(key, None)
                watch = entry.watch()
                if watch is not None and entry.param() is not None and not watch.done:
                    watch._settled[entry.index] = True
                    settled.add(watch)
            fresh, self.fresh = self.fresh, {}
            for key, entry in fresh.items():
                watch = entry.watch()
                if watch is None or entry.param() is None or watch.done:
                    continue  # swept or forgotten with its watch
                owner = None if watch._owner is None else watch._owner()
                watch._counts[entry.index] += 1
                if owner is None or watch._counts[entry.index] >= int(owner.stuck_after):
                    self.undecided.pop(key, None)
                    watch._settled[entry.index] = True
                    due.setdefault(watch, []).append(entry.index)
            for watch, indices in due.items():  # (under the lock: a watch is judged once)
                watch._judge(sorted(indices))  # named in the owner's order
            for watch in settled | due.keys():
                if not watch.done and all(watch._settled):
                    watch._finish()  # every parameter decided: the hooks go
            listening = bool(self.undecided)
        if listening:
            _optimizer_steps.listen(self)  # every step while some parameter is undecided


_TABLE = _Table()


def _held_by_a_live_optimizer(params: list[Tensor]) -> list[bool]:
    """For each of ``params``: whether a param group of a live ``torch.optim.Optimizer``
    holds it, found from the parameter up (its group's list, the group, the optimizer's
    ``param_groups``: ``gc.get_referrers``, a few passes over the heap, at a decision
    only). Not ``gc.get_objects()``: it hands out every tuple another thread is still
    building, and that thread's ``tuple()`` then fails."""
    return [any(_holds(lst, param) for lst in gc.get_referrers(param)) for param in params]


def _holds(lst: object, param: Tensor) -> bool:
    """Whether ``lst`` is the ``params`` list of a group of an optimizer's
    ``param_groups`` (types tested exactly: a dead weak proxy raises on ``isinstance``)."""
    if type(lst) is not list or not any(p is param for p in lst):
        return False
    for group in gc.get_referrers(lst):
        if type(group) is dict and group.get("params") is lst:
            for groups in gc.get_referrers(group):
                if type(groups) is list and any(
                    _is_optimizer_of(owner, groups) for owner in gc.get_referrers(groups)
                ):
                    return True
    return False


def _is_optimizer_of(owner: object, groups: list[Any]) -> bool:
    """``owner`` is an optimizer (or its ``__dict__``) whose ``param_groups`` is ``groups``."""
    if issubclass(type(owner), torch.optim.Optimizer):
        return owner.__dict__.get("param_groups") is groups
    if type(owner) is dict and owner.get("param_groups") is groups:
        return any(issubclass(type(o), torch.optim.Optimizer) for o in gc.get_referrers(owner))
    return False


def _gradient(watch: weakref.ref[ParameterWatch], i: int, param: Tensor) -> None:
    """The post-accumulate-grad hook, holding its watch weakly."""
    live = watch()
    if live is not None:
        live._gradient(i, param)
