"""Opening files so that what is checked is what is used: one descriptor, checked by ``fstat``.

A path checked with ``is_file()`` and opened afterwards can be swapped in between (for a FIFO,
which blocks ``open`` and every read for ever, or a link); a FIFO, socket or device opened
without ``O_NONBLOCK`` may never return. So an input is opened once with ``O_NONBLOCK``, the
descriptor is checked with ``fstat`` (a regular file, or an error saying what it is), and the
caller reads or decodes from that descriptor, never from the path again. ``run_folder`` adds
``O_NOFOLLOW`` on every component below the run folder; the data manifests and audio files
(``data``) follow links, which is how datasets are usually shared.
"""

from __future__ import annotations

import errno
import os
import stat

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
NONBLOCK = getattr(os, "O_NONBLOCK", 0)
DIRECTORY = getattr(os, "O_DIRECTORY", 0)


class NotRegularFile(ValueError):
    """A path that is a FIFO, socket, device or directory where a regular file belongs."""


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


def open_regular(path: str | os.PathLike[str], what: str) -> int:
    """A read-only descriptor of the regular file ``path`` (links followed), opened with
    ``O_NONBLOCK`` and checked by ``fstat``. :class:`NotRegularFile` ``"{what} {path}: a FIFO
    (named pipe), not a regular file"`` for anything else (a socket, which cannot be opened,
    is named from ``stat``); ``FileNotFoundError`` and other ``OSError`` pass through."""
    try:
        fd = os.open(path, os.O_RDONLY | NONBLOCK)
    except OSError as err:
        if err.errno not in (errno.ENXIO, errno.EISDIR, errno.EOPNOTSUPP):
            raise
        mode = os.stat(path).st_mode  # ENXIO: a socket (open(2) refuses those)
        raise NotRegularFile(f"{what} {path}: {kind(mode)}, not a regular file") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegularFile(f"{what} {path}: {kind(mode)}, not a regular file")
    return fd
