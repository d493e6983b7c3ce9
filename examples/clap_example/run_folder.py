"""The run folder's one rule: everything the trainer reads or writes under ``--output-dir`` is a
real file or directory inside it.

``checkpoints/`` (its checkpoints and ``latest``), ``best/``, ``eval/``, ``plots/``,
``tensorboard/``, the logs, ``config.json`` and ``summary.json`` are reached through a
:class:`RunFolder`, which refuses by name anything below its root that is a symbolic link, a FIFO,
a device or a socket (the root itself, ``--output-dir``, may be a link: that is the user's
choice):

- every read and write walks the path from a descriptor of the root, opening each directory
  once with ``O_NOFOLLOW`` relative to its parent's descriptor (creating it when asked), and
  does everything else relative to the last one (``dir_fd``): no path is looked up again
  between the check and the use, so a directory swapped for a link is refused by name when it
  is met, and is never written through when it is swapped afterwards;
- a file is read through a descriptor opened with ``O_NOFOLLOW | O_NONBLOCK``, so a link is
  never followed, a FIFO never blocks, and what is read is what was checked; only a regular
  file is read, and only when ``fstat`` puts it under the caller's size cap (the read stops
  one byte past the cap should the file grow meanwhile);
- a file is written through a temporary name created with ``O_EXCL | O_NOFOLLOW`` and renamed
  over its target (``durable``): a link, FIFO or device at the target is replaced, never
  followed or opened, and named in a warning; appends open with ``O_NOFOLLOW | O_NONBLOCK`` and
  write to a regular file only. Before the rename the directory's path must still lead to the
  directory written into: one moved away or swapped for a link meanwhile is named in an error,
  and the file is not published (its bytes went only to the directory that was checked);
- the root may be a link, but must stay the directory it was when the run first used it.

A refusal is a :class:`RunFolderError` (a ``ValueError``) naming the path; callers that can do
without a file (a log the checkpoint recreates, a summary that is rewritten) warn and go on.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from . import durable, safe_json
from .descriptors import DIRECTORY, NOFOLLOW, NONBLOCK, kind

#: Size caps of the files the trainer reads back (bytes).
MAX_LATEST_BYTES = 256
MAX_MANIFEST_BYTES = 1 << 22
MAX_LOG_BYTES = 1 << 30
MAX_SUMMARY_BYTES = 1 << 26

__all__ = ["RunFolder", "RunFolderError", "kind", "refusal"]


class RunFolderError(ValueError):
    """A path under the run folder that is not a real file or directory of it, or a file
    larger than its cap; the message names the path."""


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


def _identity(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


class RunFolder:
    """The files and directories of one run folder, each checked as it is used."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        #: ``(st_dev, st_ino)`` of the root when first opened: the run's own folder.
        self._root_id: tuple[int, int] | None = None

    def _parts(self, path: Path | str) -> tuple[str, ...]:
        relative = os.path.relpath(os.path.abspath(path), os.path.abspath(self.root))
        parts = Path(relative).parts
        if relative == ".":
            return ()
        if parts[0] == ".." or os.path.isabs(relative):
            raise RunFolderError(f"{path}: outside the run folder {self.root}")
        return parts

    def _open_root(self) -> int | None:
        """A descriptor of the root (a link there is followed: ``--output-dir`` is the user's
        choice), which must stay the directory it was when first opened."""
        try:
            fd = os.open(self.root, os.O_RDONLY | DIRECTORY)
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            raise refusal(self.root, kind(self.root.stat().st_mode), "a directory") from None
        identity = _identity(os.fstat(fd))
        if self._root_id is None:
            self._root_id = identity
        elif identity != self._root_id:
            os.close(fd)
            now = " (now a symbolic link)" if self.root.is_symlink() else ""
            raise RunFolderError(
                f"{self.root}: replaced by another directory{now} since the run first used it; "
                "nothing is read or written there (move the run folder back)"
            )
        return fd

    def _open_dirs(self, parts: tuple[str, ...], create: bool) -> int | None:
        """A descriptor of the directory ``root/parts...``, each component opened with
        ``O_NOFOLLOW`` relative to its parent's descriptor (created when ``create``); ``None``
        when a component is absent and not created. A component that is a link, FIFO, device
        or file is refused by name."""
        fd = self._open_root()
        if fd is None:
            if create:
                raise RunFolderError(f"{self.root}: the run folder does not exist")
            return None
        current = self.root
        try:
            for part in parts:
                current = current / part
                try:
                    child = os.open(part, os.O_RDONLY | DIRECTORY | NOFOLLOW, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        return None
                    try:
                        os.mkdir(part, dir_fd=fd)
                    except FileExistsError:
                        pass  # created meanwhile (or a link planted): the open decides
                    child = self._reopen(fd, part, current)
                except OSError as err:
                    if err.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    mode = os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode
                    raise refusal(current, kind(mode), "a directory") from None
                os.close(fd)
                fd = child
            result, fd = fd, -1
            return result
        finally:
            if fd >= 0:
                os.close(fd)

    @staticmethod
    def _reopen(fd: int, part: str, current: Path) -> int:
        try:
            return os.open(part, os.O_RDONLY | DIRECTORY | NOFOLLOW, dir_fd=fd)
        except OSError as err:
            if err.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            mode = os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode
            raise refusal(current, kind(mode), "a directory") from None

    @contextmanager
    def directory(self, path: Path | str, create: bool = False) -> Iterator[int | None]:
        """A descriptor of ``path``, a real directory of the run folder (``None``: absent and
        not created), closed on exit; every later call relative to it."""
        fd = self._open_dirs(self._parts(path), create)
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    def open_dir(self, path: Path | str, create: bool = False) -> int:
        """A descriptor of ``path``, a real directory of the run folder, that the caller
        closes (:class:`RunFolderError` when absent and not created)."""
        fd = self._open_dirs(self._parts(path), create)
        if fd is None:
            raise RunFolderError(f"{path}: absent")
        return fd

    def dir(self, path: Path | str, create: bool = False) -> Path | None:
        """``path``, a real directory of the run folder (every component below the root
        checked; created when ``create``), or ``None`` when it is absent and not created."""
        with self.directory(path, create) as fd:
            return None if fd is None else self.root.joinpath(*self._parts(path))

    def lstat(self, path: Path | str) -> os.stat_result | None:
        """``lstat`` of a path whose directories are real ones (``None``: absent)."""
        path = Path(path)
        with self.directory(path.parent) as fd:
            if fd is None:
                return None
            try:
                return os.stat(path.name, dir_fd=fd, follow_symlinks=False)
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

    def files(self, path: Path | str) -> list[str]:
        """Names of the regular files in the directory ``path`` of the run folder, sorted
        (listed through its descriptor; links, FIFOs and subdirectories left out)."""
        with self.directory(path) as fd:
            if fd is None:
                return []
            return sorted(e.name for e in os.scandir(fd) if e.is_file(follow_symlinks=False))

    # --- reading -------------------------------------------------------------------------

    @contextmanager
    def open_file(self, path: Path | str) -> Iterator[int | None]:
        """A read-only descriptor of the regular file ``path`` (``None``: absent), opened
        without following a link anywhere below the root and with ``O_NONBLOCK`` (a FIFO does
        not block), checked by ``fstat``; closed on exit."""
        path = Path(path)
        if not self._parts(path):
            raise RunFolderError(f"{path}: the run folder itself, not a file of it")
        with self.directory(path.parent) as parent:
            if parent is None:
                fd = None
            else:
                try:
                    fd = os.open(path.name, os.O_RDONLY | NOFOLLOW | NONBLOCK, dir_fd=parent)
                except FileNotFoundError:
                    fd = None
                except OSError as err:
                    if err.errno == errno.ELOOP:
                        raise refusal(path, "a symbolic link") from None
                    raise
        if fd is None:
            yield None
            return
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise refusal(path, kind(mode))
            yield fd
        finally:
            os.close(fd)

    def read_bytes(self, path: Path | str, max_bytes: int, size: int | None = None) -> bytes | None:
        """The bytes of a regular file of the run folder (``None``: absent), read once through
        one descriptor; :class:`RunFolderError` naming it when it is a link, FIFO or device, or
        when it holds more than ``max_bytes`` (or not exactly ``size`` bytes, when given)."""
        path = Path(path)
        with self.open_file(path) as fd:
            if fd is None:
                return None
            info = os.fstat(fd)
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

    @contextmanager
    def _target(self, path: Path) -> Iterator[int]:
        """A descriptor of ``path``'s directory, a real one of the run folder (created when
        absent); a link, FIFO or device at ``path`` is named in a warning (it is replaced)."""
        with self.directory(path.parent, create=True) as fd:
            assert fd is not None
            try:
                info: os.stat_result | None = os.stat(path.name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                info = None
            if info is not None and not stat.S_ISREG(info.st_mode):
                if stat.S_ISDIR(info.st_mode):
                    raise refusal(path, "a directory")
                durable.warn(
                    f"{path}: {kind(info.st_mode)}, not a file of the run folder; replaced by a "
                    "fresh file (never followed or opened)"
                )
            yield fd

    def _still_there(self, fd: int, directory: Path) -> None:
        """Refuse to publish a file whose directory was moved away or swapped for a link while
        it was written (its bytes went to the directory that was checked, never through the
        link; the temporary file is removed)."""
        try:
            moved = _identity(os.stat(directory)) != _identity(os.fstat(fd))
            # a link back to the same directory (moved aside inside the run folder) passes
            # the identity test: no component below the root may be a link
            below = [directory, *directory.parents][: len(self._parts(directory))]
            moved = moved or any(os.path.islink(p) for p in below)
        except OSError:
            moved = True
        if moved:
            what = kind(os.lstat(directory).st_mode) if os.path.lexists(directory) else "gone"
            raise RunFolderError(
                f"{directory}: replaced while a file was written into it (now {what}); the "
                "file is not published, nothing is written through a link"
            )

    def write(self, path: Path | str, fill: Callable[[Any], object]) -> None:
        """Replace ``path`` atomically with what ``fill(writer)`` writes (``durable``), every
        step relative to the descriptor of its directory."""
        path = Path(path)
        with self._target(path) as fd:
            durable.atomic_write(fd, path, fill, lambda: self._still_there(fd, path.parent))

    def write_bytes(self, path: Path | str, data: bytes) -> None:
        self.write(path, lambda w: w.write(data))

    def write_text(self, path: Path | str, text: str) -> None:
        self.write_bytes(path, text.encode("utf-8"))

    def write_lines(self, path: Path | str, lines: list[str]) -> None:
        """Replace ``path`` with ``lines`` (each already ending in a newline), atomically."""
        self.write_bytes(path, "".join(lines).encode("utf-8"))

    def torch_save(self, obj: Any, path: Path | str) -> None:
        self.write(path, lambda w: torch.save(obj, w))

    def append(self, path: Path | str, line: str, sync: bool = False) -> None:
        """Append one line to a regular file of the run folder (created when absent)."""
        path = Path(path)
        with self.directory(path.parent, create=True) as fd:
            assert fd is not None
            durable.append_line(fd, path, line, sync)

    def rename(self, source: Path | str, target: Path | str) -> None:
        """Rename ``source`` to ``target``, both in one directory of the run folder (through
        its descriptor), and make the rename durable."""
        source, target = Path(source), Path(target)
        if source.parent != target.parent:
            raise RunFolderError(f"{source} -> {target}: not in one directory")
        fd = self.open_dir(source.parent)
        try:
            os.rename(source.name, target.name, src_dir_fd=fd, dst_dir_fd=fd)
            durable.fsync_dir(fd)
        finally:
            os.close(fd)

    def remove(self, path: Path | str) -> None:
        """Delete a file or directory of the run folder (a link is removed, not followed)."""
        path = Path(path)
        with self.directory(path.parent) as fd:
            if fd is not None:
                durable.remove_at(fd, path.name)

    def fsync(self, path: Path | str) -> None:
        path = Path(path)
        with self.directory(path.parent) as fd:
            if fd is not None:
                durable.fsync_file(fd, path)
