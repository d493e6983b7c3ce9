"""Cross-lingual consistency metrics of :mod:`contrastive_losses.metrics`: the mean rank
variance across languages, and the embedding gap and distance of every language to the
anchor language.

Private: import the public names from :mod:`contrastive_losses.metrics`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import _shape, check_embeddings, check_finite, check_tensor
from ._retrieval_scan import _FROM_EMBEDDINGS, _check_int, _prepare

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
