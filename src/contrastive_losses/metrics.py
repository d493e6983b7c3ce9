r"""Retrieval and cross-lingual consistency metrics for audio-text retrieval.

Pure functions on a similarity matrix or on embeddings, CPU or CUDA, chunked over queries.
From embeddings (:func:`audio_text_retrieval`, :func:`retrieval_report`) a 50k x 10k
evaluation never holds more than one block of scores: about 15 MB of reused buffers with
the default block of ~1M scores (14 bytes per score), whatever the sizes.

Conventions (the ones of the ML-CLAP / ATRI / SupCLAP / ASK tables, see DESIGN.md §3):

* Rows of ``sim`` are queries, columns the gallery. Text-to-audio (T2A) has one relevant
  audio per caption; audio-to-text (A2T) counts every caption of the clip as relevant
  (5 per clip in the AudioCaps and Clotho test sets).
* ``R@k`` is the share of queries with at least one relevant item in the top ``k`` (a
  hit rate; with one relevant item it is also the recall).
* ``mAP@k`` is the mean over queries of :math:`\sum_{r \le k} P@r \cdot rel(r) / n_q` with
  :math:`n_q` the number of relevant items of the query (ML-CLAP / DCASE convention);
  ``denominator="min_n_relevant_k"`` divides by :math:`\min(n_q, k)` instead.
* Negative similarities are ordinary scores (no score is dropped for being <= 0).
* Ties are broken pessimistically: an irrelevant item with the same score as a relevant
  one ranks ahead of it. A rank is therefore
  :math:`\mathrm{rank}_r = r + \#\{\text{irrelevant } g : s_g \ge s_{(r)}\}` for the
  r-th best relevant item.
* Scalar summaries (R@k, mAP@k, MRV) are returned as Python ``float``; per-item results
  (ranks, per-language gap and distance) as tensors on the input's device.

What each function takes (a wrong layout is refused with the function that fits):

* :func:`retrieval_ranks`, :func:`recall_at_k`, :func:`map_at_k`: a similarity matrix
  ``sim`` ``(Q, G)`` and a bool ``relevance`` ``(Q, G)`` or ``query_ids``/``gallery_ids``;
  with neither, ``sim`` must be square (the relevant item of row ``i`` is column ``i``).
  A relevance under which every gallery item is relevant to every query is refused (every
  ranking would score 1); one under which a random ranking scores R@1 above 1/2 warns.
  Scores are similarities, higher first: ranks far below chance (``torch.cdist`` distances
  passed as ``sim``) warn, naming ``-distances``; these and the embedding functions also
  warn for all-tied scores (collapsed embeddings).
* :func:`audio_text_retrieval`: embeddings, audio ``(N, D)`` and text ``(N, C, D)`` or
  ``(N, D)``, one language.
* :func:`retrieval_report`: embeddings, audio ``(N, D)`` and text ``(N, K, C, D)``;
  ``(N, K, D)`` (KCLLoss's layout) with ``K`` language names; ``(N, C, D)`` with one.
* :func:`embedding_gap`, :func:`embedding_distance`: text ``(N, K, D)``.
* :func:`mean_rank_variance`: 1-based ranks ``(N, K)``.
"""

from __future__ import annotations

import csv
import io
import math
import numbers
import warnings
from collections.abc import Callable, Sequence
from typing import Any, overload

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import (
    _shape,
    check_choice,
    check_embeddings,
    check_finite,
    check_float,
    check_ids,
    check_materialised,
    check_same_device_dtype,
    check_same_size,
    check_tensor,
)
from ._warnings import warn_at_caller

__all__ = [
    "RetrievalReport",
    "audio_text_retrieval",
    "embedding_distance",
    "embedding_gap",
    "map_at_k",
    "mean_rank_variance",
    "recall_at_k",
    "retrieval_ranks",
    "retrieval_report",
]

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


# --------------------------------------------------------------------------- public: sim


def retrieval_ranks(
    sim: Tensor,
    relevance: Tensor | None = None,
    *,
    query_ids: Tensor | None = None,
    gallery_ids: Tensor | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    r"""Pessimistic 1-based rank of the best relevant gallery item of every query.

    .. math::

        \mathrm{rank}_q = 1 + \#\{g \text{ irrelevant to } q :
        s_{qg} \ge \max_{g' \text{ relevant}} s_{qg'}\}

    Ties count against the query: an irrelevant item scored equal to the best relevant
    one ranks ahead of it. This is the rank behind ``R@k`` (``R@k = mean(rank <= k)``)
    and behind :func:`mean_rank_variance` in :func:`retrieval_report`.

    Args:
        sim: similarity scores, queries in rows, gallery in columns. Any real values.
        relevance: optional bool matrix, ``relevance[q, g]`` True when gallery item ``g``
            is relevant to query ``q``. Mutually exclusive with the ids.
        query_ids: optional integer id per query; gallery item ``g`` is relevant to query
            ``q`` when ``gallery_ids[g] == query_ids[q]``. Defaults to ``arange(Q)``.
        gallery_ids: optional integer id per gallery item. Defaults to ``arange(G)``.
            With neither ids nor ``relevance``, the relevant item of row ``i`` is
            column ``i`` (the paired, diagonal case).
        chunk_size: query rows scored per block (``None``: about 1M scores per block).
            Results do not depend on it.

    Returns:
        ``(Q,)`` int64 tensor on ``sim``'s device, values in ``[1, G]``.

    Raises:
        ValueError: wrong shapes (a non-square ``sim`` without ``relevance`` or ids), NaN/Inf
            scores, a query with no relevant item, a relevance under which every gallery
            item is relevant to every query, tensors on different devices.
        TypeError: non-float ``sim``, non-bool ``relevance`` (embeddings passed as
            ``(audio, text)`` are pointed to :func:`audio_text_retrieval`), non-integer ids.

    Warns:
        UserWarning: when a random ranking would score R@1 above 1/2 under the relevance
        (the mean share of relevant gallery items per query), so the numbers say little;
        and when the relevant items rank far below chance (a distance matrix passed as
        ``sim``: pass ``-distances``; or all-tied scores): fewer queries with a relevant
        item in the top half of the gallery than a random ranking gives with probability
        1e-6 (a Chernoff bound; the Metrics page derives it).

    Shape:
        - sim: :math:`(Q, G)`, Q queries, G gallery items.
        - relevance: :math:`(Q, G)` bool; query_ids: :math:`(Q,)`; gallery_ids: :math:`(G,)`.
        - output: :math:`(Q,)`.

    Example:
        >>> import torch
        >>> from contrastive_losses.metrics import retrieval_ranks
        >>> sim = torch.tensor([[0.9, 0.1, 0.3], [0.2, 0.8, 0.8], [0.5, 0.4, 0.1]])
        >>> retrieval_ranks(sim)  # row 1 ties with an irrelevant item; row 2 is last
        tensor([1, 2, 3])
    """
    s, rel_fn, rel_name, n_rel = _prepare_sim(sim, relevance, query_ids, gallery_ids)
    first, _ = _sim_scan(s, rel_fn, rel_name, n_rel, chunk_size, None, "")
    return first


@overload
def recall_at_k(
    sim: Tensor,
    relevance: Tensor | None = ...,
    *,
    query_ids: Tensor | None = ...,
    gallery_ids: Tensor | None = ...,
    k: int,
    chunk_size: int | None = ...,
) -> float: ...


@overload
def recall_at_k(
    sim: Tensor,
    relevance: Tensor | None = ...,
    *,
    query_ids: Tensor | None = ...,
    gallery_ids: Tensor | None = ...,
    k: Sequence[int] = ...,
    chunk_size: int | None = ...,
) -> dict[int, float]: ...


def recall_at_k(
    sim: Tensor,
    relevance: Tensor | None = None,
    *,
    query_ids: Tensor | None = None,
    gallery_ids: Tensor | None = None,
    k: int | Sequence[int] = (1, 5, 10),
    chunk_size: int | None = None,
) -> float | dict[int, float]:
    r"""Recall at k: share of queries with a relevant item among their top ``k``.

    .. math::

        R@k = \frac{1}{Q} \sum_{q=1}^{Q} \mathbb{1}[\mathrm{rank}_q \le k]

    with :math:`\mathrm{rank}_q` the pessimistic rank of the best relevant item
    (:func:`retrieval_ranks`): ties count against the query, negative scores are ordinary
    scores. With several relevant items per query (A2T) this is a hit rate, as in the
    audio-text retrieval literature, not the fraction of relevant items retrieved.

    Directions, with ``text`` flattened to ``(N*C, D)`` and ``cap_audio[j]`` the audio index
    of caption ``j``:

    - T2A: ``recall_at_k(text @ audio.T, query_ids=cap_audio)``
    - A2T: ``recall_at_k(audio @ text.T, gallery_ids=cap_audio)``

    (:func:`audio_text_retrieval` does both from embeddings.)

    Args:
        sim: similarity scores, queries in rows, gallery in columns.
        relevance: optional bool relevance matrix; see :func:`retrieval_ranks`.
        query_ids: optional integer id per query; see :func:`retrieval_ranks`.
        gallery_ids: optional integer id per gallery item; see :func:`retrieval_ranks`.
        k: a cut-off or a sequence of cut-offs, each in ``[1, G]``.
        chunk_size: query rows per block; results do not depend on it.

    Returns:
        ``float`` in ``[0, 1]`` for an int ``k``; ``{k: float}`` for a sequence.

    Raises:
        ValueError: ``k <= 0`` or ``k > G``, plus everything :func:`retrieval_ranks` raises.
        TypeError: non-int ``k``, and as :func:`retrieval_ranks`.

    Shape:
        - sim: :math:`(Q, G)`; relevance: :math:`(Q, G)`; query_ids: :math:`(Q,)`;
          gallery_ids: :math:`(G,)`.

    Example:
        >>> import torch
        >>> from contrastive_losses.metrics import recall_at_k
        >>> sim = torch.tensor([[0.9, 0.1, 0.3], [0.2, 0.8, 0.8], [0.5, 0.4, 0.1]])
        >>> recall_at_k(sim, k=(1, 2, 3))  # relevant item of row i is column i
        {1: 0.3333333333333333, 2: 0.6666666666666666, 3: 1.0}
    """
    s, rel_fn, rel_name, n_rel = _prepare_sim(sim, relevance, query_ids, gallery_ids)
    single = isinstance(k, numbers.Integral) and not isinstance(k, bool)
    ks = _check_ks([k] if single else k, "k", s.shape[1])
    first, _ = _sim_scan(s, rel_fn, rel_name, n_rel, chunk_size, None, "")
    out = {kk: int((first <= kk).sum()) / s.shape[0] for kk in ks}
    return out[ks[0]] if single else out


def map_at_k(
    sim: Tensor,
    relevance: Tensor | None = None,
    *,
    query_ids: Tensor | None = None,
    gallery_ids: Tensor | None = None,
    k: int = 10,
    denominator: str = "n_relevant",
    chunk_size: int | None = None,
) -> float:
    r"""Mean average precision at k.

    .. math::

        \mathrm{mAP}@k = \frac{1}{Q} \sum_{q=1}^{Q} \frac{1}{n_q}
        \sum_{r=1}^{k} P_q@r \cdot rel_q(r),
        \qquad P_q@r = \frac{1}{r} \sum_{j \le r} rel_q(j)

    with :math:`rel_q(r) = 1` when the item at rank ``r`` of query ``q`` is relevant.
    ``denominator="n_relevant"`` (default) uses :math:`n_q` = the number of relevant items
    of the query, the ML-CLAP / DCASE convention: relevant items outside the top ``k``
    lower the score. ``denominator="min_n_relevant_k"`` uses :math:`\min(n_q, k)` (the
    convention of some recommender-system libraries). With one relevant item (T2A) both
    equal ``1 / rank`` if ``rank <= k`` else 0. Ranking is pessimistic under ties; negative
    scores are ordinary scores.

    Note that torchmetrics' ``RetrievalMAP(top_k=k)`` divides by the number of relevant
    items found in the top ``k`` and drops scores <= 0; it agrees with this function only
    for one relevant item per query, or ``k = G``, on positive tie-free scores.

    Args:
        sim: similarity scores, queries in rows, gallery in columns.
        relevance: optional bool relevance matrix; see :func:`retrieval_ranks`.
        query_ids: optional integer id per query; see :func:`retrieval_ranks`.
        gallery_ids: optional integer id per gallery item; see :func:`retrieval_ranks`.
        k: cut-off in ``[1, G]``.
        denominator: ``"n_relevant"`` or ``"min_n_relevant_k"``.
        chunk_size: query rows per block; results do not depend on it.

    Returns:
        ``float`` in ``[0, 1]``.

    Raises:
        ValueError, TypeError: as :func:`recall_at_k`, and for an unknown ``denominator``.

    Shape:
        - sim: :math:`(Q, G)`; relevance: :math:`(Q, G)`; query_ids: :math:`(Q,)`;
          gallery_ids: :math:`(G,)`.

    Example:
        >>> import torch
        >>> from contrastive_losses.metrics import map_at_k
        >>> sim = torch.tensor([[0.9, 0.3, 0.1, 0.6],    # relevant at ranks 1 and 3
        ...                     [0.1, 0.2, 0.7, 0.3]])   # relevant at ranks 2 and 3
        >>> relevance = torch.tensor([[True, True, False, False],
        ...                           [False, True, False, True]])
        >>> map_at_k(sim, relevance, k=2)  # ((1/1) / 2 + (1/2) / 2) / 2
        0.375
        >>> map_at_k(sim, relevance, k=3)  # ((1 + 2/3) / 2 + (1/2 + 2/3) / 2) / 2
        0.7083333333333333
    """
    s, rel_fn, rel_name, n_rel = _prepare_sim(sim, relevance, query_ids, gallery_ids)
    map_k = _check_int(k, "k", 1, s.shape[1], "the gallery size (columns of sim)")
    check_choice(denominator, "denominator", DENOMINATORS)
    _, ap = _sim_scan(s, rel_fn, rel_name, n_rel, chunk_size, map_k, denominator)
    assert ap is not None  # map_k given
    return float(ap.sum()) / s.shape[0]


# --------------------------------------------------------------------------- embeddings


def _check_audio_text(audio: object, text: object) -> tuple[Tensor, Tensor]:
    """audio (N, D), text (N, C, D) or (N, D); returns text as (N, C, D)."""
    audio = check_embeddings(audio, "audio", ndim=2, dims="(N, D)", min_batch=1, check_values=False)
    text = check_tensor(text, "text")
    if text.dim() == 4:
        raise ValueError(
            f"text: expected shape (N, C, D) or (N, D) (one language), got {_shape(text)}; "
            "captions in several languages (N, K, C, D) go to "
            "metrics.retrieval_report(audio, text, languages)"
        )
    if text.dim() == 2:
        text = text[:, None, :]
    text = check_embeddings(
        text, "text", ndim=3, dims="(N, C, D) or (N, D)", min_batch=1, check_values=False
    )
    check_same_size(audio, "audio", text, "text", 0, "number of audio clips N")
    check_same_size(audio, "audio", text, "text", -1, "embedding dimension D")
    check_same_device_dtype([(audio, "audio"), (text, "text")])
    if text.shape[1] == 0:
        raise ValueError(f"text: needs at least one caption per clip, got {_shape(text)}")
    return audio, text


def _prepare(x: Tensor, name: str, normalize: bool) -> Tensor:
    check_finite(x, name)
    if normalize:
        norms = x.detach().abs().amax(dim=-1)
        if not bool((norms > 0).all()):
            idx = tuple(torch.nonzero(norms == 0)[0].tolist())
            raise ValueError(f"{name}: embedding at index {idx} is all zeros; cannot normalise it")
        return F.normalize(x, dim=-1)
    return x


def _direction(
    queries: Tensor,
    gallery: Tensor,
    query_ids: Tensor,
    gallery_ids: Tensor,
    ks: tuple[int, ...],
    map_k: int,
    denominator: str,
    chunk_size: int | None,
    score_name: str,
) -> tuple[dict[str, float], Tensor]:
    n_q, n_g = queries.shape[0], gallery.shape[0]
    first, ap = _scan(
        _matmul_scores(queries, gallery),
        _id_relevance(query_ids, gallery_ids),
        n_q,
        n_g,
        map_k=map_k,
        denominator=denominator,
        chunk_size=_chunk_rows(chunk_size, n_g),
        dtype=queries.dtype,
        device=queries.device,
        score_name=score_name,
        relevance_name="ids",
    )
    n_rel = _n_relevant((n_q, n_g), queries.device, None, query_ids, gallery_ids)
    _warn_below_chance(first, n_rel, n_g, score_name, None)
    out = {f"R@{kk}": int((first <= kk).sum()) / n_q for kk in ks}
    assert ap is not None  # map_k given
    out[f"mAP@{map_k}"] = float(ap.sum()) / n_q
    return out, first


def _check_cutoffs(
    k: Sequence[int], map_k: int, n_audio: int, denominator: str
) -> tuple[tuple[int, ...], int]:
    what = "the number of audio clips N (the T2A gallery)"
    if isinstance(k, (str, bytes)) or not isinstance(k, Sequence):
        raise TypeError(f"k: expected a sequence of ints, got {type(k).__name__}")
    if len(k) == 0:
        raise ValueError("k: expected at least one cut-off, got an empty sequence")
    ks = tuple(_check_int(v, "k", 1, n_audio, what) for v in k)
    mk = _check_int(map_k, "map_k", 1, n_audio, what)
    check_choice(denominator, "denominator", DENOMINATORS)
    return ks, mk


def audio_text_retrieval(
    audio: Tensor,
    text: Tensor,
    *,
    k: Sequence[int] = (1, 5, 10),
    map_k: int = 10,
    denominator: str = "n_relevant",
    normalize: bool = True,
    chunk_size: int | None = None,
) -> dict[str, dict[str, float]]:
    r"""R@k and mAP@k in both directions from embeddings, in one chunked pass each.

    Similarity is the inner product, of L2-normalised embeddings when ``normalize=True``
    (cosine; default). Caption ``c`` of clip ``i`` is relevant to audio ``i`` only.

    - ``"t2a"``: each of the ``N*C`` captions queries the ``N`` clips (one relevant).
    - ``"a2t"``: each of the ``N`` clips queries the ``N*C`` captions (``C`` relevant).

    See :func:`recall_at_k` and :func:`map_at_k` for the definitions (pessimistic ties,
    mAP divided by the number of relevant items by default). Scores are computed block by
    block (``chunk_size`` query rows at a time), never as a full ``(N*C, N)`` matrix; the
    extra memory is the normalised embeddings plus about 14 bytes per score of one block.

    Args:
        audio: audio embeddings, one per clip.
        text: caption embeddings, ``C`` per clip (a 2-D ``(N, D)`` tensor means ``C = 1``).
        k: recall cut-offs, each in ``[1, N]``.
        map_k: mAP cut-off in ``[1, N]``.
        denominator: ``"n_relevant"`` or ``"min_n_relevant_k"``, see :func:`map_at_k`.
        normalize: L2-normalise both embeddings first.
        chunk_size: query rows per block; results do not depend on it.

    Returns:
        ``{"t2a": {"R@1": ..., "R@5": ..., "R@10": ..., "mAP@10": ...}, "a2t": {...}}``.

    Shape:
        - audio: :math:`(N, D)`.
        - text: :math:`(N, C, D)` or :math:`(N, D)`.

    Example:
        Caption 0 of clip ``i`` matches it exactly; caption 1 is the embedding of clip
        ``3 - i``. In T2A, caption 1 scores 0 against its own clip, tied with two other
        clips: rank 4. In A2T, clip ``i`` scores 1 with its caption 0 and with an
        irrelevant caption: the tie puts its best relevant caption at rank 2.

        >>> import torch
        >>> from contrastive_losses.metrics import audio_text_retrieval
        >>> audio = torch.eye(4)
        >>> text = torch.stack([torch.eye(4), torch.eye(4).flip(0)], dim=1)  # (4, 2, 4)
        >>> audio_text_retrieval(audio, text, k=(1, 2), map_k=4)  # doctest: +NORMALIZE_WHITESPACE
        {'t2a': {'R@1': 0.5, 'R@2': 0.5, 'mAP@4': 0.625},
         'a2t': {'R@1': 0.0, 'R@2': 1.0, 'mAP@4': 0.25}}
    """
    audio, text = _check_audio_text(audio, text)
    audio, text = audio.detach(), text.detach()  # a metric: no graph, and out= buffers
    n, c = text.shape[0], text.shape[1]
    audio = _prepare(audio, "audio", normalize)
    flat = _prepare(text, "text", normalize).reshape(n * c, -1)  # (N*C, D)
    ks, mk = _check_cutoffs(k, map_k, n, denominator)
    audio_ids = torch.arange(n, device=audio.device)  # (N,)
    caption_ids = audio_ids.repeat_interleave(c)  # (N*C,)
    setting = (ks, mk, denominator, chunk_size)
    t2a, _ = _direction(flat, audio, caption_ids, audio_ids, *setting, "text")
    a2t, _ = _direction(audio, flat, audio_ids, caption_ids, *setting, "audio")
    return {"t2a": t2a, "a2t": a2t}


# --------------------------------------------------------------------------- consistency


def mean_rank_variance(ranks: Tensor) -> float:
    r"""Mean rank variance across languages (ATRI Eq. 16).

    .. math::

        \mathrm{MRV} = \frac{1}{NK} \sum_{i=1}^{N} \sum_{k=1}^{K}
        \left(\mathrm{rank}_{ik} - \frac{1}{K} \sum_{k'=1}^{K} \mathrm{rank}_{ik'}\right)^2

    The population variance (divide by ``K``, not ``K - 1``) of each sample's ranks
    across its ``K`` language versions, averaged over samples; a variance, not a standard
    deviation. 0 when every language ranks every sample the same. Computed in float64.

    Args:
        ranks: ``ranks[i, k]`` is the rank obtained by the language-``k`` version of query
            ``i`` (e.g. :func:`retrieval_ranks` of each language, stacked on dim 1).

    Returns:
        ``float`` >= 0.

    Shape:
        - ranks: :math:`(N, K)`, integer or floating.

    Example:
        >>> import torch
        >>> from contrastive_losses.metrics import mean_rank_variance
        >>> mean_rank_variance(torch.tensor([[1, 3], [2, 2]]))  # (1 + 1 + 0 + 0) / 4
        0.5
    """
    ranks = check_tensor(ranks, "ranks")
    if ranks.dim() != 2:
        raise ValueError(f"ranks: expected shape (N, K) (samples x languages), got {_shape(ranks)}")
    if ranks.dtype == torch.bool or ranks.dtype.is_complex:
        raise TypeError(f"ranks: expected an integer or floating tensor, got dtype {ranks.dtype}")
    if ranks.numel() == 0:
        raise ValueError(f"ranks: needs at least one sample and one language, got {_shape(ranks)}")
    r = ranks.detach().double()
    check_finite(r, "ranks")
    low = float(r.min())
    if low < 1:
        raise ValueError(
            f"ranks: expected 1-based ranks (>= 1), got a minimum of {low:.4g}; rank each "
            "language with metrics.retrieval_ranks and stack them on dim 1 (similarity "
            "scores are no ranks)"
        )
    return float((r - r.mean(dim=1, keepdim=True)).square().mean())


def _check_multilingual(text: object, anchor: object, normalize: bool) -> tuple[Tensor, int]:
    if isinstance(anchor, Tensor):
        raise TypeError(
            "anchor: expected an int (the anchor language's index on dim 1 of text), got a "
            "Tensor; the function takes one text tensor (N, K, D), the K language versions "
            f"of N sentences, not two embedding matrices ({_FROM_EMBEDDINGS})"
        )
    text = check_tensor(text, "text")
    if text.dim() == 4:
        raise ValueError(
            f"text: expected shape (N, K, D), got {_shape(text)}; for captions (N, K, C, D) "
            "pass text.transpose(1, 2).flatten(0, 1), caption c of clip i in K languages"
        )
    text = check_embeddings(text, "text", ndim=3, dims="(N, K, D)", min_batch=1, check_values=False)
    n_lang = text.shape[1]
    if n_lang == 0:
        raise ValueError(f"text: needs at least one language, got {_shape(text)}")
    a = _check_int(anchor, "anchor", 0, n_lang - 1, "the last language index K - 1")
    return _prepare(text, "text", normalize), a


def embedding_gap(text: Tensor, anchor: int = 0, *, normalize: bool = True) -> Tensor:
    r"""Embedding gap of every language to the anchor language (ATRI Eq. 14).

    .. math::

        \mathrm{gap}_k = \left\lVert \frac{1}{N} \sum_{i=1}^{N} t_{i,a}
        - \frac{1}{N} \sum_{i=1}^{N} t_{i,k} \right\rVert_2

    The distance between the centroids of two languages, ``a`` the anchor (English).
    With ``normalize=True`` (default) each embedding is L2-normalised first, as in
    retrieval; the result is then in ``[0, 2]``.

    Args:
        text: ``text[i, k]`` is the language-``k`` version of sentence ``i``.
        anchor: index of the anchor language (0: English by convention).
        normalize: L2-normalise each embedding first.

    Returns:
        ``(K,)`` tensor in ``text``'s dtype and device; entry ``anchor`` is 0.

    Shape:
        - text: :math:`(N, K, D)`.
        - output: :math:`(K,)`.

    Example:
        >>> import torch
        >>> from contrastive_losses.metrics import embedding_gap
        >>> text = torch.tensor([[[1.0, 0.0], [0.0, 1.0]],
        ...                      [[1.0, 0.0], [0.0, 1.0]]])  # 2 sentences, 2 languages
        >>> embedding_gap(text)  # ||(1, 0) - (0, 1)|| = sqrt(2)
        tensor([0.0000, 1.4142])
    """
    t, a = _check_multilingual(text, anchor, normalize)
    centroids = t.mean(dim=0)  # (K, D)
    return torch.linalg.vector_norm(centroids[a : a + 1] - centroids, dim=-1)


def embedding_distance(text: Tensor, anchor: int = 0, *, normalize: bool = True) -> Tensor:
    r"""Mean embedding distance of every language to the anchor language (ATRI Eq. 15).

    .. math::

        \mathrm{dis}_k = \frac{1}{N} \sum_{i=1}^{N} \lVert t_{i,a} - t_{i,k} \rVert_2

    The average distance between a sentence and its translation. Always
    ``>= embedding_gap`` (the norm of a mean is at most the mean of the norms). With
    ``normalize=True`` (default) each embedding is L2-normalised first.

    Args:
        text: ``text[i, k]`` is the language-``k`` version of sentence ``i``.
        anchor: index of the anchor language (0: English by convention).
        normalize: L2-normalise each embedding first.

    Returns:
        ``(K,)`` tensor in ``text``'s dtype and device; entry ``anchor`` is 0.

    Shape:
        - text: :math:`(N, K, D)`.
        - output: :math:`(K,)`.

    Example:
        >>> import torch
        >>> from contrastive_losses.metrics import embedding_distance
        >>> text = torch.tensor([[[1.0, 0.0], [0.0, 1.0]],
        ...                      [[1.0, 0.0], [1.0, 0.0]]])
        >>> embedding_distance(text)  # (sqrt(2) + 0) / 2
        tensor([0.0000, 0.7071])
    """
    t, a = _check_multilingual(text, anchor, normalize)
    return torch.linalg.vector_norm(t[:, a : a + 1] - t, dim=-1).mean(dim=0)


# --------------------------------------------------------------------------- report


def _fmt(value: float | None, scale: float, digits: int) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


class RetrievalReport(dict[str, Any]):
    """The result of :func:`retrieval_report`: a plain ``dict`` plus table renderers.

    Keys (all values are plain Python, so ``json.dumps(report)`` works):

    - ``"languages"``: list of names; ``"anchor"``: the anchor's name.
    - ``"n_audio"``, ``"n_captions"``, ``"k"``, ``"map_k"``, ``"denominator"``,
      ``"normalize"``: the setting.
    - ``"per_language"``: ``{lang: {"t2a": {"R@1": ..., "mAP@10": ...}, "a2t": {...},
      "gap": float, "distance": float}}``; retrieval values are fractions in ``[0, 1]``.
    - ``"average"``: ``{"t2a": ..., "a2t": ...}`` averaged over all languages, plus
      ``"gap"`` and ``"distance"`` averaged over the non-anchor languages (None if K = 1).
    - ``"mrv"``: mean rank variance of the T2A ranks across languages (None if K = 1).
    """

    def table(self) -> tuple[list[str], list[list[float | str | None]]]:
        """The table as ``(header, rows)``: one row per language, then ``"average"``."""
        keys = [f"R@{k}" for k in self["k"]] + [f"mAP@{self['map_k']}"]
        header = ["language"]
        header += [f"T2A {key}" for key in keys] + [f"A2T {key}" for key in keys]
        header += ["gap", "distance", "MRV"]
        out: list[list[float | str | None]] = []
        entries = [(lang, self["per_language"][lang], None) for lang in self["languages"]]
        entries.append(("average", self["average"], self["mrv"]))
        for name, entry, mrv in entries:
            row: list[float | str | None] = [name]
            row += [entry["t2a"][key] for key in keys] + [entry["a2t"][key] for key in keys]
            row += [entry["gap"], entry["distance"], mrv]
            out.append(row)
        return header, out

    def to_markdown(self, *, percent: bool = True, digits: int = 2) -> str:
        """A GitHub markdown table.

        Args:
            percent: show R@k and mAP as percentages (as the papers' tables do; the
                header carries no unit) with ``digits`` decimals; otherwise as fractions
                with ``digits + 2`` decimals. Gap and distance get 4 decimals, MRV 2.
            digits: decimals of the percentages.
        """
        header, rows = self.table()
        n_retrieval = 2 * (len(self["k"]) + 1)
        scale = 100.0 if percent else 1.0
        lines = ["| " + " | ".join(header) + " |"]
        lines.append("|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|")
        for row in rows:
            cells = [str(row[0])]
            for i, v in enumerate(row[1:], start=1):
                value = v if isinstance(v, float) or v is None else float(v)
                if i <= n_retrieval:
                    cells.append(_fmt(value, scale, digits if percent else digits + 2))
                elif header[i] == "MRV":
                    cells.append(_fmt(value, 1.0, 2))
                else:
                    cells.append(_fmt(value, 1.0, 4))
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def to_csv(self) -> str:
        """CSV text: the :meth:`table`, full precision, R@k / mAP as fractions in [0, 1],
        an empty cell for None."""
        header, rows = self.table()
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(header)
        for row in rows:
            writer.writerow(["" if v is None else v for v in row])
        return buf.getvalue()


_REPORT_LAYOUTS = "(N, K, C, D), (N, K, D) with K language names, or (N, C, D) with one name"


def _language_names(languages: object) -> list[str] | None:
    if languages is None:
        return None
    if isinstance(languages, str) or not isinstance(languages, Sequence):
        raise TypeError(f"languages: expected a sequence of str, got {type(languages).__name__}")
    names = list(languages)
    if not all(isinstance(x, str) for x in names):
        raise TypeError(f"languages: expected a sequence of str, got {names!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"languages: names must be distinct, got {names}")
    return names


def _report_text(
    audio: Tensor, text: object, languages: object
) -> tuple[Tensor, list[str], Callable[[Tensor], Tensor]]:
    """``text`` validated as passed, the K language names, and the view that makes it
    ``(N, K, C, D)``. Every check runs on the tensor as passed (the caller normalises it
    before the view), so no message shows a shape or index the caller did not pass.

    A 3-D text is ``(N, K, D)`` (K languages, one caption each: KCLLoss's layout) or
    ``(N, C, D)`` (one language, C captions); ``languages`` says which: K names or one.
    Without it only a middle dimension of 1 is unambiguous."""
    text_t = check_tensor(text, "text")
    names = _language_names(languages)
    shape = _shape(text_t)
    if text_t.dim() not in (3, 4):
        raise ValueError(f"text: expected shape {_REPORT_LAYOUTS}, got {shape}")
    text_t = check_embeddings(
        text_t, "text", ndim=text_t.dim(), dims=_REPORT_LAYOUTS, min_batch=1, check_values=False
    )
    check_same_size(audio, "audio", text_t, "text", 0, "number of audio clips N")
    check_same_size(audio, "audio", text_t, "text", -1, "embedding dimension D")
    check_same_device_dtype([(audio, "audio"), (text_t, "text")])
    if any(size == 0 for size in text_t.shape[1:-1]):
        raise ValueError(f"text: needs at least one language and one caption, got {shape}")
    if text_t.dim() == 3:
        middle = text_t.shape[1]
        if names is None and middle > 1:
            raise ValueError(
                f"text: shape {shape} is ambiguous: (N, K, D) with K = {middle} languages, "
                f"one caption each (KCLLoss's layout), or (N, C, D) with one language and "
                f"C = {middle} captions per clip; say which with languages=: {middle} names "
                "for K languages, one name for one language (or pass (N, K, C, D): "
                "text[:, :, None] for K languages, text[:, None] for one)"
            )
        if names is not None and len(names) not in (1, middle):
            raise ValueError(
                f"languages: {len(names)} name(s) {names} for text of shape {shape}, read as "
                f"(N, K, D) with K = {middle} languages (pass {middle} names) or as (N, C, D) "
                "with one language (pass one name)"
            )
        one_language = names is not None and len(names) == 1 and middle > 1
        view = _one_language if one_language else _one_caption
    else:
        view = _as_is
    n_lang = view(text_t).shape[1]
    if names is None:
        names = [f"lang{i}" for i in range(n_lang)]
    elif len(names) != n_lang:
        raise ValueError(
            f"languages: {len(names)} name(s) {names} for K = {n_lang} languages in text "
            f"of shape {shape}"
        )
    return text_t, names, view


def _one_language(text: Tensor) -> Tensor:
    return text[:, None]  # (N, C, D) -> (N, 1, C, D)


def _one_caption(text: Tensor) -> Tensor:
    return text[:, :, None]  # (N, K, D) -> (N, K, 1, D)


def _as_is(text: Tensor) -> Tensor:
    return text


def retrieval_report(
    audio: Tensor,
    text: Tensor,
    languages: Sequence[str] | None = None,
    *,
    anchor: int | str = 0,
    k: Sequence[int] = (1, 5, 10),
    map_k: int = 10,
    denominator: str = "n_relevant",
    normalize: bool = True,
    chunk_size: int | None = None,
) -> RetrievalReport:
    r"""Per-language retrieval and cross-lingual consistency report (ATRI Tab. 1-3 numbers).

    For every language ``k``: T2A and A2T ``R@k`` and ``mAP@map_k`` of the captions of
    language ``k`` against the audio (:func:`audio_text_retrieval`), the embedding gap and
    distance to the anchor language (:func:`embedding_gap`, :func:`embedding_distance`,
    computed over the ``N*C`` captions, caption ``c`` of clip ``i`` in language ``k`` being
    the translation of the same caption in the anchor language). Then the average over
    languages, and the mean rank variance

    .. math::

        \mathrm{MRV} = \frac{1}{NCK} \sum_{i,c,k}
        (\mathrm{rank}_{ick} - \overline{\mathrm{rank}}_{ic})^2

    where :math:`\mathrm{rank}_{ick}` is the T2A rank (pessimistic, 1-based, among the
    ``N`` clips) of audio ``i`` for caption ``c`` in language ``k`` and the bar is the mean
    over languages (:func:`mean_rank_variance`).

    Args:
        audio: audio embeddings.
        text: caption embeddings, ``(N, K, C, D)``: ``K`` languages, ``C`` captions per
            clip. A 3-D text needs ``languages`` to say what dim 1 is: ``K`` names read it
            as ``(N, K, D)``, ``K`` languages with one caption each (KCLLoss's layout);
            one name as ``(N, C, D)``, one language with ``C`` captions. Without
            ``languages`` a 3-D text is refused unless its dim 1 is 1.
        languages: ``K`` distinct names, in the order of dim 1 of ``text``
            (default ``"lang0"``, ``"lang1"``, ...; required for a 3-D text, see above).
        anchor: index or name of the reference language for gap and distance (English).
        k: recall cut-offs, each in ``[1, N]``.
        map_k: mAP cut-off in ``[1, N]``.
        denominator: mAP denominator, see :func:`map_at_k`.
        normalize: L2-normalise embeddings before retrieval and gap/distance.
        chunk_size: query rows per block; results do not depend on it.

    Returns:
        :class:`RetrievalReport`, a ``dict`` with ``to_markdown()`` and ``to_csv()``.

    Shape:
        - audio: :math:`(N, D)`.
        - text: :math:`(N, K, C, D)`; :math:`(N, K, D)` with ``K`` names; :math:`(N, C, D)`
          with one name.

    Example:
        >>> import torch
        >>> from contrastive_losses.metrics import retrieval_report
        >>> audio = torch.eye(10)
        >>> text = torch.stack([torch.eye(10), torch.eye(10)], dim=1)[:, :, None]
        >>> report = retrieval_report(audio, text, ["en", "fr"], k=(1,))
        >>> report["average"]["t2a"]
        {'R@1': 1.0, 'mAP@10': 1.0}
        >>> print(report.to_markdown())
        | language | T2A R@1 | T2A mAP@10 | A2T R@1 | A2T mAP@10 | gap | distance | MRV |
        |---|---:|---:|---:|---:|---:|---:|---:|
        | en | 100.00 | 100.00 | 100.00 | 100.00 | 0.0000 | 0.0000 | - |
        | fr | 100.00 | 100.00 | 100.00 | 100.00 | 0.0000 | 0.0000 | - |
        | average | 100.00 | 100.00 | 100.00 | 100.00 | 0.0000 | 0.0000 | 0.00 |
    """
    audio_t = check_embeddings(
        audio, "audio", ndim=2, dims="(N, D)", min_batch=1, check_values=False
    )
    text_t, names, view = _report_text(audio_t, text, languages)
    n, n_lang, c = view(text_t).shape[:3]
    if isinstance(anchor, str):
        if anchor not in names:
            raise ValueError(f"anchor: {anchor!r} is not one of languages {names}")
        anchor_idx = names.index(anchor)
    else:
        anchor_idx = _check_int(anchor, "anchor", 0, n_lang - 1, "the last language index K - 1")
    ks, mk = _check_cutoffs(k, map_k, n, denominator)

    audio_n = _prepare(audio_t.detach(), "audio", normalize)  # (N, D)
    text_n = view(_prepare(text_t.detach(), "text", normalize))  # (N, K, C, D)
    audio_ids = torch.arange(n, device=audio_n.device)  # (N,)
    caption_ids = audio_ids.repeat_interleave(c)  # (N*C,)

    setting = (ks, mk, denominator, chunk_size)
    per_language: dict[str, dict[str, Any]] = {}
    t2a_ranks = []
    by_sentence = text_n.transpose(1, 2).reshape(n * c, n_lang, -1)  # (N*C, K, D)
    gaps = embedding_gap(by_sentence, anchor_idx, normalize=False).tolist()
    dists = embedding_distance(by_sentence, anchor_idx, normalize=False).tolist()
    for i, lang in enumerate(names):
        flat = by_sentence[:, i]  # (N*C, D)
        t2a, ranks = _direction(flat, audio_n, caption_ids, audio_ids, *setting, "text")
        a2t, _ = _direction(audio_n, flat, audio_ids, caption_ids, *setting, "audio")
        t2a_ranks.append(ranks)
        per_language[lang] = {"t2a": t2a, "a2t": a2t, "gap": gaps[i], "distance": dists[i]}

    average: dict[str, Any] = {}
    for direction in ("t2a", "a2t"):
        keys = per_language[names[0]][direction].keys()
        average[direction] = {
            key: sum(per_language[lang][direction][key] for lang in names) / n_lang for key in keys
        }
    others = [lang for i, lang in enumerate(names) if i != anchor_idx]
    for key in ("gap", "distance"):
        values = [per_language[lang][key] for lang in others]
        average[key] = sum(values) / len(values) if values else None
    mrv = mean_rank_variance(torch.stack(t2a_ranks, dim=1)) if n_lang > 1 else None
    return RetrievalReport(
        languages=names,
        anchor=names[anchor_idx],
        n_audio=n,
        n_captions=c,
        k=list(ks),
        map_k=mk,
        denominator=denominator,
        normalize=normalize,
        per_language=per_language,
        average=average,
        mrv=mrv,
    )
