"""Optimizer steps, seen from inside a loss: the training checks count them.

A loss cannot see the training loop, but every ``torch.optim.Optimizer`` (Hugging Face's,
Lightning's and open_clip's optimizers are ones) runs the global post-step hooks after
its ``step()``. One such hook tells the listeners which optimizer stepped; :func:`held`
says which of their parameters it holds. So a check counts optimizer steps, not backward
passes (64 micro-batches of gradient accumulation are one step), and knows a parameter
held at a learning rate of 0 (a warm-up) from one left out.

The hook never breaks the user's ``optimizer.step()``, threads included. Torch iterates
its global hook registry (a plain ``OrderedDict``) while it calls the hooks, and anyone
who adds or removes a global hook meanwhile, in this thread or another, makes that
``step()`` raise ``OrderedDict mutated during iteration``. So:

* the library's global hook is a **pre**-step hook, registered once, when this module is
  imported (with the package, before any of its losses can step), and **never removed**;
* it does nothing but give each optimizer that steps the library's post-step hook as a
  hook **of that optimizer** (``Optimizer.register_step_post_hook``, once per
  optimizer, never removed). The checks' work runs there, while torch iterates that
  optimizer's own hooks, not the global registry: a thread that registers its global
  hooks while others step meets only torch's own window (the few instructions of the
  global hooks themselves), not the checks' locks and bookkeeping. (Every optimizer,
  not only while someone listens: an ``LBFGS`` closure's backward listens after the
  pre-step hook ran.) Once no check listens, that hook returns at its first line;
* a listener hears the **next** step only (:func:`listen` again to hear the one after):
  listeners are kept in a set guarded by a lock and handed out as a snapshot, so
  threads that train their own losses side by side never see it change under them,
  and a step costs nothing for a check that has nothing to count.

A program that imports the library in one thread while others already step optimizers
registers the pre-step hook during their steps, as any global hook would: import it first.

Listeners are held weakly: a loss dropped while it listens is freed (no cycle through
a global).

Private: :mod:`~contrastive_losses._param_watch` (one listener for every watched
parameter) and the regulariser's over-distance check (:mod:`~contrastive_losses.
_svr_monitor`) listen.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook


class StepListener(Protocol):
    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> object:
        """One optimizer step has run (the return value is ignored)."""
        ...


_lock = threading.Lock()
_waiting: weakref.WeakSet[Any] = weakref.WeakSet()  # to be told about the next step


def listen(listener: StepListener) -> None:
    """Tell ``listener`` about the next optimizer step (of any optimizer), once."""
    with _lock:
        _waiting.add(listener)


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The global pre-step hook: give ``optimizer`` :func:`_stepped` as its own post-step
    hook, once. It touches no registry torch is iterating (the optimizer's post-step
    hooks run after the global pre-step hooks)."""
    hooks = getattr(optimizer, "_optimizer_step_post_hooks", None)  # (no base __init__)
    if hooks is None or _stepped in hooks.values():  # one scan of a few hooks per step
        return
    with _lock:  # (two threads stepping one optimizer register it once)
        if _stepped not in hooks.values():
            optimizer.register_step_post_hook(_stepped)


def _stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The optimizer's post-step hook: hand the waiting listeners this step. It touches
    no registry of torch's (it runs while torch iterates the optimizer's hooks)."""
    if not _waiting:  # nothing to count: the common case once every check has decided
        return
    with _lock:
        listeners = list(_waiting)
        _waiting.clear()
    for listener in listeners:
        listener._optimizer_stepped(optimizer)


# Once per process, at import: before any loss of the library's can step.
register_optimizer_step_pre_hook(_before_step)


_held_ids: weakref.WeakKeyDictionary[Any, tuple[tuple[int, ...], frozenset[int]]] = (
    weakref.WeakKeyDictionary()
)


def held_ids(optimizer: torch.optim.Optimizer) -> frozenset[int]:
    """The ``id`` of every parameter in one of ``optimizer``'s param groups (at any
    learning rate: one held at 0, a warm-up or a group kept at 0, is still in the
    optimizer). Cached per optimizer while its groups' lists and lengths stay the same
    (``add_param_group`` or a list replaced renews it)."""
    groups = optimizer.param_groups
    stamp = tuple(x for g in groups for x in (id(g["params"]), len(g["params"])))
    cached = _held_ids.get(optimizer)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    ids = frozenset(id(p) for g in groups for p in g["params"])
    _held_ids[optimizer] = (stamp, ids)
    return ids


def held(optimizer: torch.optim.Optimizer, params: list[Tensor]) -> list[bool]:
    """For each of ``params``: whether one of ``optimizer``'s param groups holds it."""
    ids = held_ids(optimizer)
    return [id(p) in ids for p in params]
