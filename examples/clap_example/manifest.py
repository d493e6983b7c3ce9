"""A checkpoint's ``manifest.json``: written last into its folder, checked before anything in it
is loaded.

A manifest speaks only for its own folder. It lists plain file names (no separator, no ``..``,
no absolute path) with their SHA-256 and size; the folder, the manifest and every file in it are
real files and directories, never symbolic links. :func:`verify` checks the manifest's shape
first (a malformed entry of any type is a :class:`CheckpointError` naming it, never a crash),
then every file's type and size from ``lstat`` (a 64 GiB sparse file costs one system call),
and only then the hashes, each file opened with ``O_NOFOLLOW``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from .durable import TMP_PREFIX, atomic_write_text

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
#: A manifest holds a few file digests and the run's options: far below this.
MAX_MANIFEST_BYTES = 1 << 22
#: What a manifest may list: a plain name in the checkpoint's folder (the trainer writes
#: ``state.pt`` and ``rng-rank<r>.pt``). No separator, no leading dot (so no ``.``/``..``).
PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
SHA256 = re.compile(r"[0-9a-f]{64}")


class CheckpointError(ValueError):
    """A checkpoint (or ``latest``) is missing, damaged or not usable; names the file."""


def file_digest(path: Path) -> dict[str, Any]:
    """SHA-256 and size of a regular file, opened without following a symbolic link."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    sha = hashlib.sha256()
    size = 0
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
            size += len(chunk)
    return {"sha256": sha.hexdigest(), "size": size}


def write_manifest(directory: Path, name: str, meta: dict[str, Any]) -> None:
    """``manifest.json``: digest of every file in ``directory`` plus ``meta``."""
    files = {
        p.name: file_digest(p)
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(TMP_PREFIX)
    }
    manifest = {"format": MANIFEST_FORMAT, "name": name, **meta, "files": files}
    atomic_write_text(directory / MANIFEST, json.dumps(manifest, indent=1, default=str))


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_entry(path: Path, name: Any, entry: Any) -> None:
    """One ``files`` entry: a plain name and ``{"sha256": 64 hex digits, "size": bytes}``."""
    if not isinstance(name, str) or not PLAIN_NAME.fullmatch(name) or name == MANIFEST:
        raise CheckpointError(
            f"{path}: lists {str(name)[:200]!r}, which is not a plain file name in the "
            "checkpoint's folder (a manifest names only its own files: no '/', no '..', no "
            "absolute path); the checkpoint is not used"
        )
    if not isinstance(entry, dict):
        raise CheckpointError(
            f"{path}: the entry of {name!r} is {json.dumps(entry)[:80]}, not an object "
            '{"sha256": ..., "size": ...}'
        )
    if not _whole(entry.get("size")):
        raise CheckpointError(
            f"{path}: the entry of {name!r} has size {entry.get('size')!r}, not a byte count"
        )
    if not isinstance(entry.get("sha256"), str) or not SHA256.fullmatch(entry["sha256"]):
        raise CheckpointError(
            f"{path}: the entry of {name!r} has sha256 {str(entry.get('sha256'))[:80]!r}, "
            "not 64 hexadecimal digits"
        )


def _read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest's JSON, checked for shape: every malformed field names itself."""
    path = directory / MANIFEST
    try:
        info = path.lstat()
    except FileNotFoundError:
        info = None
    if info is None or not (stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode)):
        raise CheckpointError(
            f"{path}: missing (the checkpoint is incomplete, or was written by a trainer "
            "without manifests): its files cannot be verified"
        )
    if stat.S_ISLNK(info.st_mode):
        raise CheckpointError(f"{path}: a symbolic link; a manifest must be a file of its folder")
    if info.st_size > MAX_MANIFEST_BYTES:
        raise CheckpointError(
            f"{path}: {info.st_size} bytes, far more than a manifest holds; not read"
        )
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except ValueError as err:
        raise CheckpointError(f"{path}: not a valid checkpoint manifest ({err})") from err
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(manifest).__name__}, not an object")
    if manifest.get("name") != directory.name:
        raise CheckpointError(
            f"{path}: describes checkpoint {str(manifest.get('name'))[:80]!r}, not "
            f"{directory.name!r} (a file or directory was swapped or renamed)"
        )
    for key in ("step", "epoch"):
        if not _whole(manifest.get(key)):
            raise CheckpointError(f"{path}: {key!r} is {manifest.get(key)!r}, not a count")
    if not isinstance(manifest.get("args", {}), dict):
        raise CheckpointError(f"{path}: 'args' is not a JSON object")
    files = manifest.get("files")
    if not isinstance(files, dict) or "state.pt" not in files:
        raise CheckpointError(
            f"{path}: not a valid checkpoint manifest (no 'files' object listing state.pt)"
        )
    for name, entry in files.items():
        _check_entry(path, name, entry)
    return manifest


def verify(directory: Path) -> dict[str, Any]:
    """The checkpoint's manifest, once every file matches it; else :class:`CheckpointError`
    naming the first entry or file that does not. Types and sizes are checked for every file
    before the first byte is hashed."""
    if directory.is_symlink():
        raise CheckpointError(
            f"{directory}: a symbolic link (to {os.readlink(directory)!r}); a checkpoint is a "
            "folder of its own, not a link"
        )
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    manifest = _read_manifest(directory)
    path, files = directory / MANIFEST, manifest["files"]
    for entry in sorted(directory.iterdir()):
        if entry.name == MANIFEST:
            continue
        if entry.is_symlink():
            raise CheckpointError(
                f"{entry}: a symbolic link (to {os.readlink(entry)!r}); a checkpoint's files "
                "are its own, never links"
            )
        if entry.name not in files:
            raise CheckpointError(f"{entry}: not listed in {path}")
    for name, expected in files.items():
        file = directory / name
        try:
            info = file.lstat()
        except FileNotFoundError:
            raise CheckpointError(f"{file}: listed in {path} but missing") from None
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{file}: listed in {path} but not a regular file")
        if info.st_size != expected["size"]:
            raise CheckpointError(
                f"{file}: {info.st_size} bytes, the manifest says {expected['size']} "
                "(truncated or replaced after it was saved)"
            )
    for name, expected in files.items():
        file = directory / name
        try:
            actual = file_digest(file)
        except OSError as err:  # replaced by a link or removed since the lstat above
            raise CheckpointError(f"{file}: cannot be read ({err.strerror})") from None
        if actual["size"] != expected["size"]:  # changed while it was being read
            raise CheckpointError(f"{file}: changed while it was being verified")
        if actual["sha256"] != expected["sha256"]:
            raise CheckpointError(
                f"{file}: sha256 {actual['sha256'][:16]}... does not match the manifest's "
                f"{expected['sha256'][:16]}... (the file changed after it was saved)"
            )
    return manifest
