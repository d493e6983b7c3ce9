"""Crash-consistent file writes for the trainer: a kill or a full disk never leaves a half file.

Every file is written to a temporary name in its directory, fsynced, and moved over the target
with ``os.replace`` (atomic on POSIX), then the directory is fsynced so the rename itself is
durable. A reader therefore sees the old file or the new one, never a mix. Appends (the
per-step logs) cannot be atomic; their reader skips a truncated last line instead.

Every call is relative to a descriptor of the file's directory (``dir_fd``, which ``run_folder``
opens with ``O_NOFOLLOW`` on every component): no path is looked up between the check of the
directories and the write, so a directory swapped for a link meanwhile is never written through.
All writes go through ``os.write`` on raw descriptors, so an ``OSError`` keeps its errno and the
messages here name the path; a full disk reads ``ENOSPC``.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import safe_json
from .descriptors import DIRECTORY, NOFOLLOW, NONBLOCK

TMP_PREFIX = ".tmp-"


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


def fsync_dir(dir_fd: int) -> None:
    """Make a rename or a new entry in the directory of ``dir_fd`` durable."""
    try:
        os.fsync(dir_fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic


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


def _unlink(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def atomic_write(
    dir_fd: int,
    path: Path,
    fill: Callable[[_FdWriter], object],
    check: Callable[[], None] | None = None,
) -> None:
    """Write ``path`` (named ``path.name`` in the directory open as ``dir_fd``; ``path`` is
    for messages) through ``fill(writer)`` via a temp file, fsync and ``os.replace``, every
    call relative to ``dir_fd``: no path is looked up again. ``check()``, called before the
    rename, may refuse to publish the file (the temporary file is then removed)."""
    path = Path(path)
    tmp = f"{TMP_PREFIX}{path.name}.{os.getpid()}"
    _unlink(tmp, dir_fd)  # a killed run's (or a planted link: removed, not followed)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o644, dir_fd=dir_fd)
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
        if check is not None:
            check()
    except BaseException:
        os.close(fd)
        _unlink(tmp, dir_fd)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as err:
        _unlink(tmp, dir_fd)
        raise disk_error(err, path, "renaming onto") from err
    fsync_dir(dir_fd)


def _regular(fd: int, path: Path) -> None:
    """Refuse (and close) a descriptor that is not of a regular file (a FIFO, a device)."""
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path}: not a regular file (mode {stat.filemode(mode)})")


def append_line(dir_fd: int, path: Path, line: str, sync: bool = False) -> None:
    """Append one line with a single ``write`` (a kill leaves at most a truncated last line);
    a link at ``path`` is not followed, and only a regular file is written."""
    data = line.encode("utf-8")
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | NOFOLLOW | NONBLOCK
    try:
        fd = os.open(path.name, flags, 0o644, dir_fd=dir_fd)
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


def fsync_file(dir_fd: int, path: Path) -> None:
    """fsync an existing regular file (the logs, before a checkpoint that counts their rows);
    nothing for an absent file, a link or a FIFO."""
    try:
        fd = os.open(path.name, os.O_RDONLY | NOFOLLOW | NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return  # absent, or a link (ELOOP): nothing of the run to sync
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.fsync(fd)
    except OSError as err:
        raise disk_error(err, path, "syncing") from err
    finally:
        os.close(fd)


def remove_at(dir_fd: int, name: str) -> None:
    """Delete the file or directory tree ``name`` of the directory open as ``dir_fd`` (if
    present); every step relative to a descriptor, a link removed and never followed."""
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        _unlink(name, dir_fd)
        return
    fd = os.open(name, os.O_RDONLY | DIRECTORY | NOFOLLOW, dir_fd=dir_fd)
    try:
        for entry in list(os.scandir(fd)):
            remove_at(fd, entry.name)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


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
