"""Optimizer steps, seen from inside a loss: the training checks count them.

A loss cannot see the training loop, but every ``torch.optim.Optimizer`` (Hugging Face's,
Lightning's and open_clip's optimizers are ones) runs the global post-step hooks after
its ``step()``. One such hook tells the listeners which optimizer stepped; :func:`held`
says which of their parameters it holds. So a check counts optimizer steps, not backward
passes (64 micro-batches of gradient accumulation are one step), and knows a parameter
held at a learning rate of 0 (a warm-up) from one left out.

The hook never breaks the user's ``optimizer.step()``:

* it is registered once per process, the first time a check needs it (a loss with a
  learnable parameter built, or a check that starts listening), and **never removed**:
  torch iterates its hook registry while it calls the hooks, and a hook that removed
  itself there made ``step()`` raise ``OrderedDict mutated during iteration`` whenever
  someone else's global post-step hook (a logger, a profiler, torch's ``MemTracker``)
  came after it. Once no check listens, the hook returns at its first line;
* a listener hears the **next** step only (:func:`listen` again to hear the one after):
  listeners are kept in a set guarded by a lock and handed out as a snapshot, so
  threads that train their own losses side by side never see it change under them,
  and a step costs nothing for a check that has nothing to count.

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
from torch.optim.optimizer import register_optimizer_step_post_hook


class StepListener(Protocol):
    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> object:
        """One optimizer step has run (the return value is ignored)."""
        ...


_lock = threading.Lock()
_waiting: weakref.WeakSet[Any] = weakref.WeakSet()  # to be told about the next step
_installed = False


def install() -> None:
    """Register the global post-step hook, once per process; it is never removed."""
    global _installed
    if _installed:
        return
    with _lock:
        if not _installed:
            register_optimizer_step_post_hook(_stepped)
            _installed = True


def listen(listener: StepListener) -> None:
    """Tell ``listener`` about the next optimizer step (of any optimizer), once."""
    install()
    with _lock:
        _waiting.add(listener)


def _stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The global post-step hook: hand the waiting listeners this step. It touches no
    registry of torch's (it runs while torch iterates them)."""
    if not _waiting:  # nothing to count: the common case once every check has decided
        return
    with _lock:
        listeners = list(_waiting)
        _waiting.clear()
    for listener in listeners:
        listener._optimizer_stepped(optimizer)


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
