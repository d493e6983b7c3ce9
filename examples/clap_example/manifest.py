"""A checkpoint's ``manifest.json``: written last into its folder, checked before anything in it
is loaded.

A manifest speaks only for its own folder. It lists plain file names (no separator, no ``..``,
no absolute path) with their SHA-256 and size; the folder, the manifest and every file in it are
real files and directories, never symbolic links. :func:`verify` checks the manifest's shape
first (a malformed entry of any type, or JSON nested too deeply, is a :class:`CheckpointError`
naming it, never a crash), then every file's type and size from ``lstat`` (a 64 GiB sparse file
costs one system call). The bytes themselves are checked by :func:`read_verified` as they are
read for loading: each file is read once through a descriptor opened with ``O_NOFOLLOW |
O_NONBLOCK`` (``run_folder``), those bytes are hashed, and only those bytes are loaded, so a
file swapped, linked or replaced by a FIFO after :func:`verify` is refused by name, never loaded
and never waited on.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from . import safe_json
from .durable import TMP_PREFIX
from .run_folder import MAX_MANIFEST_BYTES, RunFolder, RunFolderError

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
#: What a manifest may list: a plain name in the checkpoint's folder (the trainer writes
#: ``state.pt`` and ``rng-rank<r>.pt``). No separator, no leading dot (so no ``.``/``..``).
PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
SHA256 = re.compile(r"[0-9a-f]{64}")


class CheckpointError(ValueError):
    """A checkpoint (or ``latest``) is missing, damaged or not usable; names the file."""


def file_digest(folder: RunFolder, path: Path) -> dict[str, Any]:
    """SHA-256 and size of a regular file of the run folder, read through one descriptor
    (``RunFolder.open_file``: no link followed, a FIFO never waited on)."""
    sha = hashlib.sha256()
    size = 0
    with folder.open_file(path) as fd:
        if fd is None:
            raise CheckpointError(f"{path}: vanished while the manifest was written")
        while chunk := os.read(fd, 1 << 20):
            sha.update(chunk)
            size += len(chunk)
    return {"sha256": sha.hexdigest(), "size": size}


def write_manifest(folder: RunFolder, directory: Path, name: str, meta: dict[str, Any]) -> None:
    """``manifest.json``: digest of every file in ``directory`` plus ``meta``, listed, read
    and written through the run folder's descriptors."""
    files = {
        file: file_digest(folder, directory / file)
        for file in folder.files(directory)
        if file != MANIFEST and not file.startswith(TMP_PREFIX)
    }
    manifest = {"format": MANIFEST_FORMAT, "name": name, **meta, "files": files}
    folder.write_text(directory / MANIFEST, json.dumps(manifest, indent=1, default=str))


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
        data = RunFolder(directory).read_bytes(path, MAX_MANIFEST_BYTES)
        if data is None:
            raise CheckpointError(
                f"{path}: missing (the checkpoint is incomplete, or was written by a trainer "
                "without manifests): its files cannot be verified"
            )
        manifest = safe_json.loads(data, str(path))
    except CheckpointError:
        raise
    except RunFolderError as err:
        raise CheckpointError(f"{err}; a manifest must be a file of its folder") from None
    except ValueError as err:
        reason = str(err).removeprefix(f"{path}: ")
        raise CheckpointError(f"{path}: not a valid checkpoint manifest ({reason})") from None
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
    """The checkpoint's manifest, once it is well formed, lists every file of the folder and
    every file it lists is a regular one of its size; else :class:`CheckpointError` naming the
    first entry or file that does not. The hashes are checked by :func:`read_verified`, on the
    bytes that are loaded."""
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
    return manifest


def read_verified(
    directory: Path, name: str, manifest: dict[str, Any], root: Path | None = None
) -> bytes:
    """The bytes of ``name``, a file :func:`verify` checked, read once (``O_NOFOLLOW |
    O_NONBLOCK`` on every component below ``root``, default the checkpoint's parent; a regular
    file of exactly the manifest's size) and hashed: what a caller loads is what matched the
    manifest. :class:`CheckpointError` naming the file when it is now a link, a FIFO, a device,
    of another size, or holds other bytes."""
    file, expected = directory / name, manifest["files"][name]
    folder = RunFolder(directory.parent if root is None else root)
    try:
        data = folder.read_bytes(file, expected["size"], size=expected["size"])
    except RunFolderError as err:
        raise CheckpointError(f"{err} (changed after the checkpoint was verified)") from None
    except OSError as err:
        raise CheckpointError(f"{file}: cannot be read ({err.strerror or err})") from None
    if data is None:
        raise CheckpointError(f"{file}: listed in {directory / MANIFEST} but missing")
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected["sha256"]:
        raise CheckpointError(
            f"{file}: sha256 {digest[:16]}... does not match the manifest's "
            f"{expected['sha256'][:16]}... (the file changed after it was saved)"
        )
    return data
