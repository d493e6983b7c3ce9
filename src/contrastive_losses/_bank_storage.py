"""The knowledge bank's storage: the checks and conversions of what it stores (unit rows,
integer ids, a saved state), the gathering of rows across ranks, and the lazy faiss import.

Private: :class:`~contrastive_losses.bank.KnowledgeBank` uses these; its public methods are
the API.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import Tensor

from ._checks import (
    _shape,
    check_embeddings,
    check_finite,
    check_materialised,
    check_row_norms,
    check_tensor,
)

BACKENDS = ("auto", "faiss", "torch")
MODALITIES = ("audio", "text")
INDEX_TYPES = ("flat", "ivf")
STATE_TENSORS = ("audio", "text", "ids", "prototype_audio", "prototype_text")
_FAISS_HINT = (
    "faiss is not installed; install the extra with `pip install contrastive-losses[faiss]` "
    "or use backend='torch'"
)


def _import_faiss() -> Any:
    try:
        return importlib.import_module("faiss")
    except ImportError as err:  # also raised when sys.modules["faiss"] is None
        raise ImportError(_FAISS_HINT) from err


def _faiss_available() -> bool:
    try:
        importlib.import_module("faiss")
    except ImportError:
        return False
    return True


def _check_int_ids(ids: object, name: str, n: int) -> Tensor:
    ids = check_tensor(ids, name)
    check_materialised(ids, name)
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor, got dtype {ids.dtype}")
    if ids.dim() != 1 or ids.shape[0] != n:
        raise ValueError(
            f"{name}: expected shape ({n},) matching the embeddings, got {_shape(ids)}"
        )
    return ids.long()


def _unit_rows(x: Tensor, name: str) -> Tensor:
    """Detached float32 unit rows; raises on NaN/Inf, zero rows and unrepresentable norms.

    Not ``F.normalize``: its ``eps = 1e-12`` floor leaves rows with smaller norms
    un-normalised, and in float32 rows with entries above ~1e19 become zeros.
    """
    xf = x.detach().float()
    return xf / check_row_norms(xf, name).unsqueeze(-1)  # stable norms where squares overflow


def _dist_world() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _all_gather_rows(x: Tensor) -> Tensor:
    """Concatenate ``x`` (rows may differ per rank) from every rank, in rank order."""
    dist = torch.distributed
    world = dist.get_world_size()
    n = torch.tensor([x.shape[0]], dtype=torch.long, device=x.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    counts = [int(s.item()) for s in sizes]
    pad = max(counts)
    buf = x.new_zeros((pad, *x.shape[1:]))
    buf[: x.shape[0]] = x
    out = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(out, buf.contiguous())
    return torch.cat([o[:c] for o, c in zip(out, counts, strict=True)], dim=0)


def _broadcast_rows(x: Tensor | None, like: Tensor, src: int = 0) -> Tensor:
    """Rank ``src``'s ``x`` on every rank (other ranks pass ``None``); shape may vary."""
    dist = torch.distributed
    rank = dist.get_rank()
    n = torch.tensor([x.shape[0] if rank == src and x is not None else 0], device=like.device)
    dist.broadcast(n, src)
    rows = int(n.item())
    buf = x.contiguous() if rank == src and x is not None else like.new_empty((rows, like.shape[1]))
    dist.broadcast(buf, src)
    return buf


def check_state_rows(state: dict[str, Any], dim: int) -> int:
    """Shapes of a saved state's tensors agree with each other and ``dim``; returns ``N``."""
    for key in STATE_TENSORS:
        check_materialised(check_tensor(state[key], f"state['{key}']"), f"state['{key}']")
    n = state["ids"].shape[0] if state["ids"].dim() == 1 else -1
    if n < 0 or state["ids"].dtype.is_floating_point or state["ids"].dtype == torch.bool:
        raise ValueError(
            f"state['ids']: expected an integer (N,) tensor, got dtype "
            f"{state['ids'].dtype} shape {_shape(state['ids'])}"
        )
    m = state["prototype_audio"].shape[0] if state["prototype_audio"].dim() == 2 else -1
    for key, rows in (("audio", n), ("text", n), ("prototype_audio", m), ("prototype_text", m)):
        x = state[key]
        if x.dim() != 2 or x.shape[1] != dim or x.shape[0] != rows:
            want = f"({n if rows == n else 'M'}, {dim})"
            raise ValueError(
                f"state['{key}']: expected shape {want} (N = {n} ids), got {_shape(x)}"
            )
        if not x.dtype.is_floating_point:
            raise TypeError(f"state['{key}']: expected a floating tensor, got {x.dtype}")
        check_finite(x, f"state['{key}']")
    return n


def checked_pairs(
    audio_emb: object, text_emb: object, ids: object, dim: int, min_batch: int
) -> tuple[Tensor, Tensor, Tensor]:
    """What ``KnowledgeBank.build`` stores: detached float32 unit rows of both modalities
    (``(N, D)``, on the audio's device) and int64 ids ``(N,)``, every argument checked."""
    audio_emb = check_embeddings(
        audio_emb,
        "audio_emb",
        ndim=2,
        dims="(N, D)",
        min_batch=min_batch,
        check_values=False,
    )
    text_emb = check_embeddings(
        text_emb,
        "text_emb",
        ndim=2,
        dims="(N, D)",
        min_batch=min_batch,
        check_values=False,
    )
    for x, name in ((audio_emb, "audio_emb"), (text_emb, "text_emb")):
        if x.shape[1] != dim:
            raise ValueError(
                f"{name}: embedding dim {x.shape[1]} does not match the bank's dim "
                f"{dim} (shape {_shape(x)})"
            )
    if text_emb.shape[0] != audio_emb.shape[0]:
        raise ValueError(
            f"text_emb: {text_emb.shape[0]} rows but audio_emb has {audio_emb.shape[0]}; "
            "the bank stores pairs"
        )
    ids = _check_int_ids(ids, "ids", audio_emb.shape[0]).to(audio_emb.device)
    audio = _unit_rows(audio_emb, "audio_emb")
    text = _unit_rows(text_emb, "text_emb").to(audio.device)
    return audio, text, ids
