"""Warnings that point at the user's line, once per line.

A warning raised deep inside a loss (a Module's ``forward``, a drop-in around it, the
regulariser around that, or an autograd hook during ``backward``) cannot name a fixed
``stacklevel``: the depth differs with each route. :func:`warn_at_caller` walks the
stack to the first frame outside this package and outside torch, the line that called
the loss (or ``loss.backward()``), and warns there, once per that line and message kind.

Private: the scale checks (:mod:`~contrastive_losses._common`) and the watch on
parameters that never train (:mod:`~contrastive_losses._param_watch`) call it; never
while ``torch.compile`` traces (the stack walk is no graph op).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

# Frames in these folders are the library's or torch's own (Module.__call__, the
# autograd engine's Python side), not the caller's.
_INTERNAL = (str(Path(__file__).resolve().parent), str(Path(torch.__file__).resolve().parent))

_warned: set[tuple[str, str, int]] = set()

# The kinds already told in this thread's current call (:func:`told`).
_told = threading.local()


@contextlib.contextmanager
def told(kind: str) -> Iterator[None]:
    """Within, warnings of ``kind`` stay quiet: the caller already gave it (a Module that
    warned about its own setting when built, calling its functional form)."""
    before: frozenset[str] = getattr(_told, "kinds", frozenset())
    _told.kinds = before | {kind}
    try:
        yield
    finally:
        _told.kinds = before


def caller_stacklevel() -> tuple[int, str, int]:
    """The first frame outside this package and torch: its ``stacklevel`` as the function
    that calls this one would pass it to :func:`warnings.warn` (1: that function's own
    line), and its file and line."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(
        _INTERNAL
    ):
        frame = frame.f_back
        level += 1
    return level, frame.f_code.co_filename, frame.f_lineno


def warn_at_caller(
    kind: str, message: str, category: type[Warning] = UserWarning, *, once: bool = True
) -> None:
    """Warn ``message`` at the caller's line; with ``once`` only the first time ``kind``
    is met from that line (the caller keeps its own count otherwise); never within
    :func:`told` of ``kind``."""
    if kind in getattr(_told, "kinds", ()):
        return
    level, filename, lineno = caller_stacklevel()
    key = (kind, filename, lineno)
    if once and key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, category, stacklevel=level)
