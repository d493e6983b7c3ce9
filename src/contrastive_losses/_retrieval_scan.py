"""The scan behind :mod:`contrastive_losses.metrics`: the checks of a similarity matrix and
its relevance (a matrix or ids), the chance-level refusal and warnings (a relevance under
which every ranking scores high; relevant items ranked far below chance), the reused
score and relevance blocks, and the chunked pass that ranks the relevant items of every
query and sums AP@k. Also the shared integer check and the L2-normalisation of
embeddings.

Private: import the public names from :mod:`contrastive_losses.metrics`.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import _shape, check_finite, check_float, check_ids, check_materialised, check_tensor
from ._warnings import warn_at_caller

DENOMINATORS = ("n_relevant", "min_n_relevant_k")

# Scores per chunk when ``chunk_size`` is None: 1M elements, 4 MB per float32 temporary.
_CHUNK_ELEMENTS = 1 << 20
# Up to this many relevant items to rank per query, one comparison pass per item; beyond,
# one sort of each row and a binary search per item.
_LOOP_MAX_RELEVANT = 16

BlockFn = Callable[[int, int], Tensor]


# --------------------------------------------------------------------------- validation


def _check_int(value: object, name: str, low: int, high: int | None, high_what: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    v = int(value)
    if v < low:
        raise ValueError(f"{name}: must be >= {low}, got {v}")
    if high is not None and v > high:
        raise ValueError(f"{name}: {v} exceeds {high_what} ({high})")
    return v


def _check_ks(k: object, name: str, n_gallery: int) -> tuple[int, ...]:
    if isinstance(k, (str, bytes)) or not isinstance(k, Sequence):
        raise TypeError(f"{name}: expected an int or a sequence of ints, got {type(k).__name__}")
    if len(k) == 0:
        raise ValueError(f"{name}: expected at least one cut-off, got an empty sequence")
    what = "the gallery size (columns of sim)"
    return tuple(_check_int(v, name, 1, n_gallery, what) for v in k)


# Said wherever a similarity-matrix function is handed something else.
_FROM_EMBEDDINGS = (
    "audio and text embeddings go to metrics.audio_text_retrieval(audio, text) "
    "(metrics.retrieval_report(audio, text, languages) for several languages)"
)


def _check_sim(sim: object) -> Tensor:
    sim = check_tensor(sim, "sim")
    if sim.dim() != 2:
        raise ValueError(
            f"sim: expected shape (Q, G), a similarity matrix (queries x gallery), got "
            f"{_shape(sim)}; {_FROM_EMBEDDINGS}"
        )
    check_float(sim, "sim")
    if sim.shape[0] == 0 or sim.shape[1] == 0:
        raise ValueError(f"sim: needs at least one query and one gallery item, got {_shape(sim)}")
    check_materialised(sim, "sim")
    return sim


def _relevance_fn(
    sim: Tensor,
    relevance: Tensor | None,
    query_ids: Tensor | None,
    gallery_ids: Tensor | None,
) -> BlockFn:
    """Return ``f(a, b) -> (b - a, G)`` bool relevance of query rows ``a:b``."""
    n_q, n_g = sim.shape
    if relevance is not None:
        if query_ids is not None or gallery_ids is not None:
            raise ValueError(
                "relevance: pass either a relevance matrix or query_ids/gallery_ids, not both"
            )
        rel = check_tensor(relevance, "relevance").detach()
        if rel.dtype != torch.bool:
            raise TypeError(_relevance_dtype_message(rel, n_q, n_g))
        if tuple(rel.shape) != (n_q, n_g):
            raise ValueError(
                f"relevance: expected shape ({n_q}, {n_g}) like sim, got {_shape(rel)}"
            )
        if rel.device != sim.device:
            raise ValueError(f"relevance: on device {rel.device} but sim is on {sim.device}")
        return lambda a, b: rel[a:b]
    if query_ids is None and gallery_ids is None and n_q != n_g:
        raise ValueError(
            f"sim: shape {_shape(sim)} is not square, and without relevance or "
            "query_ids/gallery_ids the relevant item of query i is column i, which needs "
            "Q == G; pass query_ids/gallery_ids (e.g. gallery_ids=caption_to_audio for A2T) "
            f"or relevance; {_FROM_EMBEDDINGS}"
        )
    if query_ids is None:
        qi = torch.arange(n_q, device=sim.device)
    else:
        qi = check_ids(
            query_ids, "query_ids", n_q, sim, what="one id per query (row of sim)", ref_name="sim"
        )
    if gallery_ids is None:
        gi = torch.arange(n_g, device=sim.device)
    else:
        gi = check_ids(
            gallery_ids,
            "gallery_ids",
            n_g,
            sim,
            what="one id per gallery item (column of sim)",
            ref_name="sim",
        )
    return _id_relevance(qi, gi)


def _relevance_dtype_message(rel: Tensor, n_q: int, n_g: int) -> str:
    """The TypeError for a non-bool relevance: a 0/1 mask of sim's shape is told to cast;
    anything else (embeddings, scores) is told where embeddings go, not to cast: ``.bool()``
    of an embedding matrix is True almost everywhere and every R@k would read 1.0."""
    head = f"relevance: expected a bool tensor of shape ({n_q}, {n_g}) like sim"
    got = f"got dtype {rel.dtype}, shape {_shape(rel)}"
    binary = (
        rel.dtype != torch.bool
        and not rel.dtype.is_complex
        and rel.device.type != "meta"
        and tuple(rel.shape) == (n_q, n_g)
        and bool(((rel == 0) | (rel == 1)).all())
    )
    if binary:
        return f"{head}, {got} holding only 0 and 1 (use relevance.bool())"
    return (
        f"{head}, {got} that is no 0/1 mask; recall_at_k, map_at_k and retrieval_ranks take "
        f"a similarity matrix sim (Q, G) and a bool relevance, or ids; {_FROM_EMBEDDINGS}"
    )


def _check_chance(sim: Tensor, n_relevant: Tensor, rel_name: str) -> None:
    """Refuse a relevance under which every ranking is perfect, and warn where a random
    ranking already scores R@1 above 1/2 (``n_relevant``: ``(Q,)`` relevant items per
    query; its mean share of the gallery is the expected R@1 of a random ranking)."""
    n_g = sim.shape[1]
    if n_g < 2:
        return
    chance = float(n_relevant.double().mean()) / n_g
    cast = (
        f" (relevance.bool() of an embedding matrix looks like this; {_FROM_EMBEDDINGS})"
        if rel_name == "relevance"
        else ""
    )
    if chance >= 1.0:
        raise ValueError(
            f"{rel_name}: every gallery item is relevant to every query, so R@k, mAP@k and "
            f"every rank read 1 whatever sim holds{cast}"
        )
    if chance > 0.5:
        warnings.warn(
            f"{rel_name}: {chance:.1%} of the (query, gallery) pairs are relevant, so a "
            f"random ranking already scores R@1 = {chance:.2f} on average{cast}",
            UserWarning,
            stacklevel=4,
        )


# A result this unlikely under a random ranking is no bad model but a mistake in the inputs.
_BELOW_CHANCE_P = 1e-6


def _chance_in_top(n_relevant: Tensor, n_gallery: int, m: int) -> Tensor:
    r"""``(Q,)`` float64: the probability that a random ranking of ``n_gallery`` items puts
    one of a query's ``n_relevant`` relevant items in the top ``m``,
    :math:`1 - \binom{G - n_q}{m} / \binom{G}{m}` (``m / G`` for one relevant item)."""
    n = n_relevant.double()
    g, top = float(n_gallery), float(m)
    rest = g - n  # irrelevant items
    log_miss = (  # log C(G - n, m) - log C(G, m)
        torch.lgamma(rest + 1)
        - torch.lgamma((rest - top + 1).clamp(min=1.0))
        - (math.lgamma(g + 1) - math.lgamma(g - top + 1))
    )
    return torch.where(rest < top, 1.0, -torch.expm1(log_miss))


def _warn_below_chance(
    first: Tensor,
    n_relevant: Tensor,
    n_gallery: int,
    score_name: str,
    constant_rows: Callable[[], float] | None,
) -> None:
    r"""Warn when the ranks ``first`` (``(Q,)``, 1-based) put the relevant items far below
    where a random ranking would: a distance matrix passed as similarities ranks every
    relevant item near the end.

    ``H``, the number of queries with a relevant item in the top half of the gallery
    (:math:`m = \lceil G/2 \rceil`), is under a random ranking a sum of independent
    Bernoulli(:math:`p_q`) (:func:`_chance_in_top`, :math:`p_q \ge 1/2`) with mean
    :math:`\mu`; the Chernoff bound :math:`P(H \le h) \le e^{h - \mu}(\mu/h)^h` below
    :data:`_BELOW_CHANCE_P` warns. So it never warns where the gallery and the number of
    queries are too small to tell (:math:`h = 0` needs :math:`\mu > 13.8`, about 28
    queries), and a random ranking warns at most once in a million evaluations.
    ``constant_rows`` gives the share of all-tied rows of the scores (read only to word
    the warning; None where the scores are not at hand)."""
    n_q = first.shape[0]
    m = (n_gallery + 1) // 2
    hits = int((first <= m).sum())
    mu = float(_chance_in_top(n_relevant, n_gallery, m).sum())
    if hits >= mu:
        return
    log_tail = hits - mu + (hits * math.log(mu / hits) if hits else 0.0)
    if log_tail >= math.log(_BELOW_CHANCE_P):
        return
    ties = "tied scores count against the query (pessimistic ranks)"
    if constant_rows is None:
        cause = f"Are the embeddings collapsed (all alike)? {ties}"
    elif constant_rows() > 0.5:
        cause = (
            f"Most rows of {score_name} hold one value throughout ({ties}): are the "
            "embeddings collapsed (all alike)?"
        )
    else:
        cause = (
            f"Is {score_name} a distance matrix (lower = closer, e.g. torch.cdist(text, "
            "audio))? The metrics rank higher scores first: pass -distances, or the "
            "similarities (text @ audio.T of L2-normalised embeddings)"
        )
    warn_at_caller(
        f"below chance {score_name}",  # (T2A and A2T from one line: each its own)
        f"{score_name}: the relevant items rank far below chance: {hits} of {n_q} queries "
        f"have one in the top {m} of the {n_gallery} gallery items, where a random ranking "
        f"puts {mu:.1f} on average (a result that unlikely under a random ranking: "
        f"P < {_BELOW_CHANCE_P:g}). {cause}",
    )


def _id_relevance(query_ids: Tensor, gallery_ids: Tensor) -> BlockFn:
    """``f(a, b)``: bool ``query_ids[a:b, None] == gallery_ids``, ``(b - a, G)``, reused buffer."""
    buffers: list[Tensor] = []

    def relevant(a: int, b: int) -> Tensor:
        if not buffers:  # sized by the first (largest) chunk
            buffers.append(
                torch.empty(b - a, len(gallery_ids), dtype=torch.bool, device=gallery_ids.device)
            )
        return torch.eq(query_ids[a:b, None], gallery_ids[None, :], out=buffers[0][: b - a])

    return relevant


def _matmul_scores(queries: Tensor, gallery: Tensor) -> BlockFn:
    """``f(a, b)``: ``queries[a:b] @ gallery.T``, ``(b - a, G)``, in a reused buffer."""
    buffers: list[Tensor] = []
    gallery_t = gallery.T  # (D, G)

    def scores(a: int, b: int) -> Tensor:
        if not buffers:  # sized by the first (largest) chunk
            buffers.append(queries.new_empty(b - a, gallery.shape[0]))
        return torch.matmul(queries[a:b], gallery_t, out=buffers[0][: b - a])

    return scores


def _chunk_rows(chunk_size: int | None, n_gallery: int) -> int:
    if chunk_size is None:
        return max(1, _CHUNK_ELEMENTS // max(n_gallery, 1))
    return _check_int(chunk_size, "chunk_size", 1, None)


# --------------------------------------------------------------------------- core scan


def _scan(
    scores: BlockFn,
    relevant: BlockFn,
    n_queries: int,
    n_gallery: int,
    *,
    map_k: int | None,
    denominator: str,
    chunk_size: int,
    dtype: torch.dtype,
    device: torch.device,
    score_name: str,
    relevance_name: str,
) -> tuple[Tensor, Tensor | None]:
    """One pass over query chunks.

    ``scores(a, b)`` and ``relevant(a, b)`` return the ``(b - a, G)`` scores and bool
    relevance of query rows ``a:b``; they may return views of buffers they reuse, valid
    until the next call.

    Returns the pessimistic 1-based rank of the best relevant item of every query,
    ``(Q,)`` int64, and AP@map_k of every query, ``(Q,)`` float64 (None when ``map_k`` is
    None). Per-query values, summed once at the end, make the result independent of the
    chunking down to the last bit.

    Memory: the ``(chunk, G)`` temporaries live in buffers allocated once (``out=``) and
    the per-query outputs are preallocated, so nothing allocated inside a chunk outlives
    it. With per-chunk results kept in a list, block-sized allocations interleaved with
    those small long-lived ones fragmented glibc's heap: the RSS of a 50k x 10k scan grew
    by up to 2 GB, the size of the whole similarity matrix.
    """
    first_ranks = torch.empty(n_queries, dtype=torch.int64, device=device)  # (Q,)
    aps = torch.empty(n_queries, dtype=torch.float64, device=device) if map_k else None  # (Q,)
    block = min(chunk_size, n_queries)
    work = torch.empty(block, n_gallery, dtype=dtype, device=device)  # (chunk, G)
    hits = torch.empty(block, n_gallery, dtype=torch.bool, device=device)  # (chunk, G)
    # Counting: copy_ bool -> int32 buffer, then an int32 sum, allocates nothing;
    # sum(dtype=...), count_nonzero or ge(out=int32) each allocate a block-sized temporary.
    counts = torch.empty(block, n_gallery, dtype=torch.int32, device=device)  # (chunk, G)
    sort_buffers: list[tuple[Tensor, Tensor]] = []  # (chunk, G) values, indices; on demand
    neg_inf = torch.tensor(float("-inf"), dtype=dtype, device=device)
    for a in range(0, n_queries, chunk_size):
        b = min(a + chunk_size, n_queries)
        s = scores(a, b)  # (q, G)
        # max/min propagate NaN: two cheap reductions instead of a full isfinite pass.
        finite = torch.isfinite(s.amax(dim=1)) & torch.isfinite(s.amin(dim=1))  # (q,)
        if not bool(finite.all()):
            rows = (torch.nonzero(~finite).flatten() + a).tolist()[:10]
            raise ValueError(
                f"{score_name}: NaN/Inf similarity in query row(s) {rows}; "
                "scores must be finite to be ranked"
            )
        rel = relevant(a, b)  # (q, G) bool
        q = b - a
        n_rel = counts[:q].copy_(rel).sum(dim=1, dtype=torch.int32).long()  # (q,)
        if not bool((n_rel > 0).all()):
            rows = (torch.nonzero(n_rel == 0).flatten() + a).tolist()[:10]
            raise ValueError(
                f"{relevance_name}: query row(s) {rows} have no relevant gallery item; "
                "every query needs at least one"
            )
        # Only the first min(n_rel, map_k) relevant items can land in the top map_k.
        n_rank = 1 if map_k is None else min(int(n_rel.max()), map_k)
        # Relevant scores, best first; -inf pads queries with fewer relevant items.
        rel_only = torch.where(rel, s, neg_inf, out=work[:q])  # (q, G)
        if n_rank == 1:
            rel_scores = rel_only.amax(dim=1, keepdim=True)  # (q, 1)
        else:
            rel_scores = rel_only.topk(n_rank, dim=1).values  # (q, R)
        # Relevant items set to -inf never count as ranked ahead (all scores are finite).
        irr = torch.where(rel, neg_inf, s, out=work[:q])  # (q, G)
        if n_rank <= _LOOP_MAX_RELEVANT:
            # (q, R): irrelevant items scored >= the r-th relevant one (ties pessimistic)
            ahead = torch.stack(
                [
                    counts[:q]
                    .copy_(torch.ge(irr, rel_scores[:, r : r + 1], out=hits[:q]))
                    .sum(dim=1, dtype=torch.int32)
                    for r in range(n_rank)
                ],
                dim=1,
            ).long()
        else:
            if not sort_buffers:
                indices = torch.empty(work.shape, dtype=torch.int64, device=device)
                sort_buffers.append((torch.empty_like(work), indices))
            values, indices = sort_buffers[0]
            srt, _ = torch.sort(irr, dim=1, out=(values[:q], indices[:q]))  # (q, G) ascending
            ahead = n_gallery - torch.searchsorted(srt, rel_scores.contiguous(), side="left")
        position = torch.arange(1, n_rank + 1, device=ahead.device)  # (R,)
        ranks = ahead + position  # (q, R) 1-based rank of the r-th best relevant item
        first_ranks[a:b] = ranks[:, 0]
        if aps is not None and map_k is not None:
            counted = (position <= n_rel[:, None]) & (ranks <= map_k)  # (q, R)
            # Exactly r relevant items sit in the top rank_r, so P@rank_r = r / rank_r.
            precision = position.double() / ranks.double()  # (q, R)
            ap_sum = torch.where(counted, precision, 0.0).sum(dim=1)  # (q,)
            if denominator == "n_relevant":
                denom = n_rel
            else:
                denom = n_rel.clamp(max=map_k)
            torch.div(ap_sum, denom, out=aps[a:b])
    return first_ranks, aps


def _prepare_sim(
    sim: object,
    relevance: Tensor | None,
    query_ids: Tensor | None,
    gallery_ids: Tensor | None,
) -> tuple[Tensor, BlockFn, str, Tensor]:
    """``sim`` checked and detached, its relevance function and name, and the ``(Q,)``
    number of relevant items of each query."""
    s = _check_sim(sim).detach()
    rel_fn = _relevance_fn(s, relevance, query_ids, gallery_ids)  # validates the ids too
    rel_name = "relevance" if relevance is not None else "query_ids/gallery_ids"
    n_rel = _n_relevant(s.shape, s.device, relevance, query_ids, gallery_ids)
    _check_chance(s, n_rel, rel_name)
    return s, rel_fn, rel_name, n_rel


def _n_relevant(
    shape: tuple[int, int] | torch.Size,
    device: torch.device,
    relevance: Tensor | None,
    query_ids: Tensor | None,
    gallery_ids: Tensor | None,
) -> Tensor:
    """``(Q,)`` number of relevant gallery items of each query (inputs validated)."""
    n_q, n_g = shape
    if relevance is not None:
        return relevance.detach().sum(dim=1)
    qi = torch.arange(n_q, device=device) if query_ids is None else query_ids.detach()
    gi = torch.arange(n_g, device=device) if gallery_ids is None else gallery_ids.detach()
    values, counts = torch.unique(gi, return_counts=True)  # sorted
    pos = torch.searchsorted(values, qi).clamp(max=len(values) - 1)  # (Q,)
    return torch.where(values[pos] == qi, counts[pos], 0)


def _sim_scan(
    s: Tensor,
    rel_fn: BlockFn,
    rel_name: str,
    n_rel: Tensor,
    chunk_size: int | None,
    map_k: int | None,
    denominator: str,
) -> tuple[Tensor, Tensor | None]:
    n_q, n_g = s.shape
    first, ap = _scan(
        lambda a, b: s[a:b],
        rel_fn,
        n_q,
        n_g,
        map_k=map_k,
        denominator=denominator,
        chunk_size=_chunk_rows(chunk_size, n_g),
        dtype=s.dtype,
        device=s.device,
        score_name="sim",
        relevance_name=rel_name,
    )
    _warn_below_chance(first, n_rel, n_g, "sim", lambda: _constant_rows(s))
    return first, ap


def _constant_rows(s: Tensor) -> float:
    """The share of the rows of ``s`` that hold one value throughout (all tied)."""
    return float((s.amax(dim=1) == s.amin(dim=1)).double().mean())


# --------------------------------------------------------------------------- embeddings


def _check_dim(dim: object, width: int) -> int | None:
    """A Matryoshka prefix size: ``None``, or an int in ``[1, D]``."""
    if dim is None:
        return None
    return _check_int(dim, "dim", 1, width, "the embeddings' dim D")


def _prepare(x: Tensor, name: str, normalize: bool, dim: int | None = None) -> Tensor:
    """``x`` checked finite, cut to its first ``dim`` features (a Matryoshka prefix) and
    L2-normalised (``normalize``): the prefix is normalised, not the full row."""
    if dim is not None:
        x = x[..., :dim]
    check_finite(x, name)
    if normalize:
        norms = x.detach().abs().amax(dim=-1)
        if not bool((norms > 0).all()):
            idx = tuple(torch.nonzero(norms == 0)[0].tolist())
            raise ValueError(f"{name}: embedding at index {idx} is all zeros; cannot normalise it")
        return F.normalize(x, dim=-1)
    return x
