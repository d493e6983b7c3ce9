"""The knowledge bank's search: query checks, the exact chunked torch top-k with id
exclusion, and the faiss indexes (flat, fp16 scalar-quantised, IVF) with the same contract.

Private: :class:`~contrastive_losses.bank.KnowledgeBank` calls these from ``search`` and
``search_prototypes``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor

from ._checks import _shape, check_embeddings, check_finite, check_int, stable_row_norms


def check_queries(queries: object, k: int, dim: int) -> Tensor:
    """``(B, D)`` queries of the bank's dim and a ``k >= 1``, shared by both searches."""
    queries = check_embeddings(
        queries, "queries", ndim=2, dims="(B, D)", min_batch=1, check_values=False
    )
    if queries.shape[1] != dim:
        raise ValueError(
            f"queries: embedding dim {queries.shape[1]} does not match the bank's dim "
            f"{dim} (shape {_shape(queries)})"
        )
    check_int(k, "k", 1)
    check_finite(queries, "queries")  # a NaN query ranks rows arbitrarily
    # Scores are float32 inner products with unit rows: |score| <= ||query||.
    norms = stable_row_norms(queries)
    limit = torch.finfo(torch.float32).max
    if bool((norms > limit).any()):
        raise ValueError(
            f"queries: a row norm exceeds float32's max {limit:.3g}, so its scores "
            "overflow; normalise the queries"
        )
    return queries


def search_torch(
    keys: Tensor,
    bank_ids: Tensor | None,
    queries: Tensor,
    k: int,
    excl: Tensor | None,
    chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """Exact top-``k`` of ``keys`` ``(N, D)`` (on the queries' device) by inner product,
    ``chunk_size`` rows at a time; rows whose id equals the query's ``excl`` are skipped."""
    dev = queries.device
    q = queries.detach().float()
    ex = excl.to(dev) if excl is not None else None
    best_s = q.new_empty((q.shape[0], 0))
    best_i = torch.empty((q.shape[0], 0), dtype=torch.long, device=dev)
    with torch.no_grad():
        for start in range(0, keys.shape[0], chunk_size):
            block = keys[start : start + chunk_size].float()  # (C, D)
            s = q @ block.T  # (B, C)
            if ex is not None and bank_ids is not None:
                same = bank_ids[start : start + block.shape[0]].unsqueeze(0) == ex.unsqueeze(1)
                s = s.masked_fill(same, -math.inf)
            top_s, top_i = s.topk(min(k, block.shape[0]), dim=-1)
            best_s = torch.cat([best_s, top_s], dim=-1)
            best_i = torch.cat([best_i, top_i + start], dim=-1)
            if best_s.shape[1] > k:
                best_s, pos = best_s.topk(k, dim=-1)
                best_i = best_i.gather(-1, pos)
    return best_s, best_i


def faiss_index(
    faiss: Any, rows: Tensor, index_type: str, nlist: int | None, nprobe: int, fp16: bool
) -> tuple[Any, Any]:
    """A faiss inner-product index over ``rows`` ``(N, D)``, and its IVF quantizer (which
    must be kept alive as long as the index) or ``None``."""
    x = rows.detach().float().cpu().contiguous().numpy()
    n, dim = x.shape
    metric = faiss.METRIC_INNER_PRODUCT
    quantizer = None
    if index_type == "ivf":
        nlist = nlist or max(1, min(n, int(4 * math.sqrt(n))))
        quantizer = faiss.IndexFlatIP(dim)
        if fp16:
            index = faiss.IndexIVFScalarQuantizer(
                quantizer, dim, nlist, faiss.ScalarQuantizer.QT_fp16, metric
            )
        else:
            index = faiss.IndexIVFFlat(quantizer, dim, nlist, metric)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            index.train(x)
        index.nprobe = min(nprobe, nlist)
    elif fp16:
        index = faiss.IndexScalarQuantizer(dim, faiss.ScalarQuantizer.QT_fp16, metric)
    else:
        index = faiss.IndexFlatIP(dim)
    index.add(x)
    return index, quantizer


def search_faiss(
    index: Any,
    bank_ids: Tensor,
    queries: Tensor,
    k: int,
    excl: Tensor | None,
    max_dup: int,
    nprobe: int,
) -> tuple[Tensor, Tensor]:
    """Top-``k`` from a faiss ``index`` over the bank's rows, fetching ``max_dup`` extra rows
    so the excluded ids can be dropped; results on the queries' device."""
    q = queries.detach().float().cpu().contiguous().numpy()
    fetch = min(int(bank_ids.shape[0]), k + (max_dup if excl is not None else 0))
    dist, idx = index.search(q, fetch)
    scores = torch.from_numpy(dist)  # (B, fetch), sorted descending
    rows = torch.from_numpy(idx).long()
    valid = rows >= 0  # IVF returns -1 when a probe finds too few rows
    if excl is not None:
        valid &= bank_ids.cpu()[rows.clamp_min(0)] != excl.cpu().unsqueeze(1)
    # stable sort puts the valid rows first, keeping faiss's order among them
    order = torch.sort((~valid).to(torch.int8), dim=-1, stable=True).indices[:, :k]
    if not bool(valid.gather(-1, order).all()):
        raise RuntimeError(
            f"faiss returned fewer than k={k} valid rows; raise nprobe (now {nprobe}) "
            "or use index='flat'"
        )
    out_s = scores.gather(-1, order).to(queries.device)
    out_i = rows.gather(-1, order).to(queries.device)
    return out_s, out_i
