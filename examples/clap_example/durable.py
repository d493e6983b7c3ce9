"""Crash-consistent file writes for the trainer: a kill or a full disk never leaves a half file.

Every file is written to a temporary name in its directory, fsynced, and moved over the target
with ``os.replace`` (atomic on POSIX), then the directory is fsynced so the rename itself is
durable. A reader therefore sees the old file or the new one, never a mix. Appends (the
per-step logs) cannot be atomic; their reader skips a truncated last line instead.

All writes go through ``os.write`` on raw descriptors, so an ``OSError`` keeps its errno and the
messages here name the path; a full disk reads ``ENOSPC``.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from . import safe_json

TMP_PREFIX = ".tmp-"
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def disk_error(err: OSError, path: Path | str, action: str = "writing") -> OSError:
    """The same error with a message naming ``path`` (and ``ENOSPC``/``EDQUOT`` by name)."""
    name = errno.errorcode.get(err.errno, "") if err.errno is not None else ""
    hint = ""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = " (disk full: free space, then continue with --resume auto)"
    reason = f"{name}: {err.strerror or err}" if name else str(err)
    return OSError(err.errno, f"{action} {path} failed with {reason}{hint}", str(path))


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new entry in ``directory`` durable (no-op where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


class _FdWriter:
    """A minimal binary file object over a descriptor, remembering the first ``OSError``
    (``torch.save`` replaces a writer's exception with its own message)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            _write_all(self.fd, data)
        except OSError as err:
            self.error = self.error or err
            raise
        return len(data)

    def flush(self) -> None:
        pass


def atomic_write(path: Path | str, fill: Callable[[_FdWriter], object]) -> None:
    """Write ``path`` through ``fill(writer)`` via a temp file, fsync and ``os.replace``."""
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)  # a killed run's (or a planted link: removed, not followed)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o644)
    except OSError as err:
        raise disk_error(err, path, "creating") from err
    writer = _FdWriter(fd)
    try:
        try:
            fill(writer)
        except OSError as err:
            raise disk_error(writer.error or err, path) from err
        except Exception as err:
            if writer.error is not None:
                raise disk_error(writer.error, path) from err
            raise
        try:
            os.fsync(fd)
        except OSError as err:
            raise disk_error(err, path, "syncing") from err
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise disk_error(err, path, "renaming onto") from err
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    atomic_write(path, lambda w: w.write(data))


def atomic_write_text(path: Path | str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_torch_save(obj: Any, path: Path | str) -> None:
    """``torch.save`` with the guarantees of :func:`atomic_write`."""
    atomic_write(path, lambda w: torch.save(obj, w))  # type: ignore[arg-type]


def write_lines(path: Path | str, lines: Iterable[str]) -> None:
    """Replace ``path`` with ``lines`` (each already ending in a newline), atomically."""
    atomic_write_bytes(path, "".join(lines).encode("utf-8"))


def _regular(fd: int, path: Path) -> None:
    """Refuse (and close) a descriptor that is not of a regular file (a FIFO, a device)."""
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path}: not a regular file (mode {stat.filemode(mode)})")


def append_line(path: Path | str, line: str, sync: bool = False) -> None:
    """Append one line with a single ``write`` (a kill leaves at most a truncated last line);
    a link at ``path`` is not followed, and only a regular file is written."""
    path = Path(path)
    data = line.encode("utf-8")
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | NOFOLLOW | NONBLOCK
    try:
        fd = os.open(path, flags, 0o644)
        _regular(fd, path)
    except OSError as err:
        raise disk_error(err, path, "opening") from err
    try:
        _write_all(fd, data)
        if sync:
            os.fsync(fd)
    except OSError as err:
        raise disk_error(err, path) from err
    finally:
        os.close(fd)


def fsync_file(path: Path | str) -> None:
    """fsync an existing file (the logs, before a checkpoint that counts their rows)."""
    path = Path(path)
    if path.is_symlink() or not path.is_file():
        return
    try:
        fd = os.open(path, os.O_RDONLY | NOFOLLOW | NONBLOCK)
        _regular(fd, path)
    except OSError as err:
        raise disk_error(err, path, "opening") from err
    try:
        os.fsync(fd)
    except OSError as err:
        raise disk_error(err, path, "syncing") from err
    finally:
        os.close(fd)


def remove_tree(path: Path) -> None:
    """Delete a directory (or file) if present."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def parse_jsonl(data: bytes, path: Path | str, with_lines: bool = False) -> list[Any]:
    """Rows of a JSON Lines log (its bytes, read by ``run_folder``). A truncated, garbled or
    too deeply nested *last* line (a kill or a full disk in the middle of an append) is skipped
    with a warning naming the file; a bad line before the last is an error naming the file and
    the line. ``with_lines``: ``(line number, row)`` pairs."""
    lines = data.decode("utf-8", errors="replace").split("\n")
    numbered = [(i, line) for i, line in enumerate(lines, start=1) if line.strip()]
    rows: list[Any] = []
    for n, (line_no, line) in enumerate(numbered):
        try:
            row = safe_json.loads(line, f"{path}:{line_no}")
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{line_no}: not a JSON object")
        except ValueError as err:
            reason = str(err).removeprefix(f"{path}:{line_no}: ")
            if n == len(numbered) - 1:
                warn(f"{path}:{line_no}: skipping a truncated last line ({reason})")
                break
            raise ValueError(
                f"{path}:{line_no}: not a JSON object ({reason}); fix or delete the line"
            ) from None
        rows.append((line_no, row) if with_lines else row)
    return rows


def warn(message: str) -> None:
    print(f"[warning] {message}", file=sys.stderr, flush=True)
