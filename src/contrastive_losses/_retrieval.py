"""Retrieval metrics of :mod:`contrastive_losses.metrics`: R@k, mAP@k and the ranks from a
similarity matrix, and both directions (T2A, A2T) from audio and text embeddings.

Private: import the public names from :mod:`contrastive_losses.metrics`.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import overload

import torch
from torch import Tensor

from ._checks import (
    _shape,
    check_choice,
    check_embeddings,
    check_same_device_dtype,
    check_same_size,
    check_tensor,
)
from ._retrieval_scan import (
    DENOMINATORS,
    _check_dim,
    _check_int,
    _check_ks,
    _chunk_rows,
    _id_relevance,
    _matmul_scores,
    _n_relevant,
    _prepare,
    _prepare_sim,
    _scan,
    _sim_scan,
    _warn_below_chance,
)

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
    dim: int | None = None,
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
        dim: score only the first ``dim`` features (a Matryoshka prefix,
            :class:`~contrastive_losses.MatryoshkaLoss`), re-normalised with
            ``normalize``; ``None``: all ``D``. An int in ``[1, D]``.

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
    dim = _check_dim(dim, audio.shape[-1])
    audio = _prepare(audio, "audio", normalize, dim)
    flat = _prepare(text, "text", normalize, dim).reshape(n * c, -1)  # (N*C, dim or D)
    ks, mk = _check_cutoffs(k, map_k, n, denominator)
    audio_ids = torch.arange(n, device=audio.device)  # (N,)
    caption_ids = audio_ids.repeat_interleave(c)  # (N*C,)
    setting = (ks, mk, denominator, chunk_size)
    t2a, _ = _direction(flat, audio, caption_ids, audio_ids, *setting, "text")
    a2t, _ = _direction(audio, flat, audio_ids, caption_ids, *setting, "audio")
    return {"t2a": t2a, "a2t": a2t}
