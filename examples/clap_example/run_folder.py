"""The run folder's one rule: everything the trainer reads or writes under ``--output-dir`` is a
real file or directory inside it.

``checkpoints/`` (its checkpoints and ``latest``), ``best/``, ``eval/``, ``plots/``,
``tensorboard/``, the logs, ``config.json`` and ``summary.json`` are reached through a
:class:`RunFolder`, which refuses by name anything below its root that is a symbolic link, a FIFO,
a device or a socket (the root itself, ``--output-dir``, may be a link: that is the user's
choice):

- a directory is checked component by component from the root (``lstat``), and created when
  asked;
- a file is read through a descriptor opened with ``O_NOFOLLOW | O_NONBLOCK`` relative to
  descriptors of its directories (each opened with ``O_NOFOLLOW``), so a link is never followed,
  a FIFO never blocks, and what is read is what was checked; only a regular file is read, and
  only when ``fstat`` puts it under the caller's size cap (the read stops one byte past the cap
  should the file grow meanwhile);
- a file is written through a temporary name created with ``O_EXCL | O_NOFOLLOW`` and renamed
  over its target (``durable``): a link, FIFO or device at the target is replaced, never
  followed or opened, and named in a warning; appends open with ``O_NOFOLLOW | O_NONBLOCK`` and
  write to a regular file only. (A write checks its directories just before it writes, by
  path: a directory swapped for a link in that instant is the one race reads close and writes
  do not.)

A refusal is a :class:`RunFolderError` (a ``ValueError``) naming the path; callers that can do
without a file (a log the checkpoint recreates, a summary that is rewritten) warn and go on.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import durable, safe_json
from .durable import NOFOLLOW, NONBLOCK

DIRECTORY = getattr(os, "O_DIRECTORY", 0)

#: Size caps of the files the trainer reads back (bytes).
MAX_LATEST_BYTES = 256
MAX_MANIFEST_BYTES = 1 << 22
MAX_LOG_BYTES = 1 << 30
MAX_SUMMARY_BYTES = 1 << 26


class RunFolderError(ValueError):
    """A path under the run folder that is not a real file or directory of it, or a file
    larger than its cap; the message names the path."""


def kind(mode: int) -> str:
    """What a file of ``mode`` is, in words."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def refusal(path: Path, what: str, expected: str = "a regular file") -> RunFolderError:
    link = ""
    if what == "a symbolic link":
        try:
            link = f" (to {os.readlink(path)!r})"
        except OSError:
            pass
    return RunFolderError(
        f"{path}: {what}{link}, not {expected}; everything the trainer reads or writes in the "
        "run folder must be a real file or directory inside it (remove or replace it)"
    )


class RunFolder:
    """The files and directories of one run folder, each checked before it is used."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    def _parts(self, path: Path | str) -> tuple[str, ...]:
        relative = os.path.relpath(os.path.abspath(path), os.path.abspath(self.root))
        parts = Path(relative).parts
        if relative == ".":
            return ()
        if parts[0] == ".." or os.path.isabs(relative):
            raise RunFolderError(f"{path}: outside the run folder {self.root}")
        return parts

    def dir(self, path: Path | str, create: bool = False) -> Path | None:
        """``path``, a real directory of the run folder (every component below the root
        checked; created when ``create``), or ``None`` when it is absent and not created."""
        current = self.root
        for part in self._parts(path):
            current = current / part
            try:
                info = current.lstat()
            except FileNotFoundError:
                if not create:
                    return None
                try:
                    current.mkdir()
                except FileExistsError:
                    pass
                info = current.lstat()
            if not stat.S_ISDIR(info.st_mode):
                raise refusal(current, kind(info.st_mode), "a directory")
        return self.root.joinpath(*self._parts(path))

    def lstat(self, path: Path | str) -> os.stat_result | None:
        """``lstat`` of a path whose directories are real ones (``None``: absent)."""
        path = Path(path)
        if self.dir(path.parent) is None:
            return None
        try:
            return path.lstat()
        except FileNotFoundError:
            return None

    def is_file(self, path: Path | str) -> bool:
        """A regular file of the run folder (a link, FIFO or device is not one, nor a file in a
        directory the run folder refuses)."""
        try:
            info = self.lstat(path)
        except RunFolderError:
            return False
        return info is not None and stat.S_ISREG(info.st_mode)

    # --- reading -------------------------------------------------------------------------

    def _open(self, path: Path) -> int | None:
        """A descriptor of ``path`` opened without following a link anywhere below the root
        (``O_NONBLOCK``: a FIFO does not block); ``None`` when it is absent."""
        parts = self._parts(path)
        if not parts:
            raise RunFolderError(f"{path}: the run folder itself, not a file of it")
        fd = os.open(self.root, os.O_RDONLY | DIRECTORY)
        current = self.root
        try:
            for part in parts[:-1]:
                current = current / part
                try:
                    child = os.open(part, os.O_RDONLY | DIRECTORY | NOFOLLOW, dir_fd=fd)
                except FileNotFoundError:
                    return None
                except OSError as err:
                    if err.errno in (errno.ELOOP, errno.ENOTDIR):
                        mode = current.lstat().st_mode
                        raise refusal(current, kind(mode), "a directory") from None
                    raise
                os.close(fd)
                fd = child
            try:
                return os.open(parts[-1], os.O_RDONLY | NOFOLLOW | NONBLOCK, dir_fd=fd)
            except FileNotFoundError:
                return None
            except OSError as err:
                if err.errno == errno.ELOOP:
                    raise refusal(path, "a symbolic link") from None
                raise
        finally:
            os.close(fd)

    def read_bytes(self, path: Path | str, max_bytes: int, size: int | None = None) -> bytes | None:
        """The bytes of a regular file of the run folder (``None``: absent), read once through
        one descriptor; :class:`RunFolderError` naming it when it is a link, FIFO or device, or
        when it holds more than ``max_bytes`` (or not exactly ``size`` bytes, when given)."""
        path = Path(path)
        fd = self._open(path)
        if fd is None:
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise refusal(path, kind(info.st_mode))
            if size is not None and info.st_size != size:
                raise RunFolderError(
                    f"{path}: {info.st_size} bytes, expected {size} (replaced or truncated)"
                )
            if info.st_size > max_bytes:
                raise RunFolderError(
                    f"{path}: {info.st_size} bytes, more than the {max_bytes} such a file may "
                    "hold; not read"
                )
            chunks = []
            left = max_bytes + 1
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 24))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
        finally:
            os.close(fd)
        data = b"".join(chunks)
        if len(data) > max_bytes or (size is not None and len(data) != size):
            raise RunFolderError(f"{path}: changed size while it was read")
        return data

    def read_json(self, path: Path | str, max_bytes: int) -> Any:
        """The JSON value of a file of the run folder (``None``: absent); a ``ValueError``
        naming the file when it is refused, too big, not JSON or nested too deeply."""
        data = self.read_bytes(path, max_bytes)
        return None if data is None else safe_json.loads(data, str(path))

    def read_jsonl(
        self, path: Path | str, with_lines: bool = False, max_bytes: int = MAX_LOG_BYTES
    ) -> list[Any]:
        """The rows of a JSON Lines log of the run folder (``[]``: absent), as
        :func:`durable.parse_jsonl` reads them."""
        data = self.read_bytes(path, max_bytes)
        return [] if data is None else durable.parse_jsonl(data, path, with_lines)

    # --- writing -------------------------------------------------------------------------

    def _target(self, path: Path | str) -> Path:
        """``path``, whose directory is a real one of the run folder (created when absent);
        a link, FIFO or device at ``path`` is named in a warning (it is replaced)."""
        path = Path(path)
        self.dir(path.parent, create=True)
        info = self.lstat(path)
        if info is not None and not stat.S_ISREG(info.st_mode):
            if stat.S_ISDIR(info.st_mode):
                raise refusal(path, "a directory")
            durable.warn(
                f"{path}: {kind(info.st_mode)}, not a file of the run folder; replaced by a "
                "fresh file (never followed or opened)"
            )
        return path

    def write(self, path: Path | str, fill: Callable[[Any], object]) -> None:
        durable.atomic_write(self._target(path), fill)

    def write_bytes(self, path: Path | str, data: bytes) -> None:
        durable.atomic_write_bytes(self._target(path), data)

    def write_text(self, path: Path | str, text: str) -> None:
        durable.atomic_write_text(self._target(path), text)

    def write_lines(self, path: Path | str, lines: list[str]) -> None:
        durable.write_lines(self._target(path), lines)

    def torch_save(self, obj: Any, path: Path | str) -> None:
        durable.atomic_torch_save(obj, self._target(path))

    def append(self, path: Path | str, line: str, sync: bool = False) -> None:
        """Append one line to a regular file of the run folder (created when absent)."""
        path = Path(path)
        self.dir(path.parent, create=True)
        durable.append_line(path, line, sync)

    def remove(self, path: Path | str) -> None:
        """Delete a file or directory of the run folder (a link is removed, not followed)."""
        path = Path(path)
        if self.dir(path.parent) is not None:
            durable.remove_tree(path)

    def fsync(self, path: Path | str) -> None:
        path = Path(path)
        if self.dir(path.parent) is not None:
            durable.fsync_file(path)
