"""The knowledge bank's prototypes: k-means on the concatenated pairs (faiss, or a torch
Lloyd's fallback) and the max-pooled, normalised prototype of each cluster.

Private: :class:`~contrastive_losses.bank.KnowledgeBank` calls these from ``build``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ._warnings import warn_at_caller


def _kmeans_torch(x: Tensor, k: int, niter: int, seed: int, chunk: int = 16384) -> Tensor:
    """Lloyd's k-means (squared L2), random distinct points as init; returns assignments."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    init = torch.randperm(x.shape[0], generator=gen)[:k].to(x.device)
    centroids = x[init].clone()  # (M, 2D)

    def assign(c: Tensor) -> Tensor:
        half_sq = 0.5 * (c * c).sum(-1)  # (M,)
        return torch.cat(
            [(x[i : i + chunk] @ c.T - half_sq).argmax(-1) for i in range(0, x.shape[0], chunk)]
        )

    for _ in range(niter):
        labels = assign(centroids)  # (N,)
        sums = torch.zeros_like(centroids).index_add_(0, labels, x)
        counts = torch.bincount(labels, minlength=k).to(x.dtype)
        filled = counts > 0
        centroids[filled] = sums[filled] / counts[filled].unsqueeze(-1)  # empty: keep old
    return assign(centroids)


def kmeans_faiss(faiss: Any, pairs: Tensor, k: int, niter: int, seed: int) -> Tensor:
    """``faiss.Kmeans`` assignments of ``pairs`` ``(N, 2D)`` to ``k`` centroids ``(N,)``."""
    x = pairs.cpu().float().contiguous().numpy()
    km = faiss.Kmeans(x.shape[1], k, niter=niter, seed=seed, verbose=False)
    # faiss prints this warning to the C stderr; say it through `warnings` instead and
    # lower faiss's threshold (it only gates the message) so it stays quiet.
    wanted = k * int(km.cp.min_points_per_centroid)
    if x.shape[0] < wanted:
        warn_at_caller(
            "k-means points",
            f"k-means: clustering {x.shape[0]} points to {k} centroids: faiss advises at "
            f"least {wanted} training points (fewer prototypes: num_prototypes)",
        )
    km.cp.min_points_per_centroid = 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        km.train(x)
    _, labels = km.index.search(x, 1)
    return torch.from_numpy(labels[:, 0]).long().to(pairs.device)


def make_prototypes(
    audio: Tensor, text: Tensor, num_prototypes: int, kmeans: Callable[[Tensor, int], Tensor]
) -> tuple[Tensor, Tensor]:
    """Paired prototypes of unit rows ``audio``, ``text`` ``(N, D)``: ``kmeans`` (``pairs
    (N, 2D), k -> labels (N,)``) on the concatenated pairs, then :func:`pool_prototypes`;
    ``num_prototypes`` above ``N`` is clamped with a warning."""
    n = audio.shape[0]
    k = num_prototypes
    if k > n:
        warn_at_caller(
            "num_prototypes", f"num_prototypes={k} exceeds the bank size {n}; using {n} clusters"
        )
        k = n
    pairs = torch.cat([audio, text], dim=-1)  # (N, 2D)
    labels = kmeans(pairs, k)  # (N,)
    return pool_prototypes(audio, text, labels, k)


def pool_prototypes(
    audio: Tensor, text: Tensor, labels: Tensor, num_clusters: int
) -> tuple[Tensor, Tensor]:
    """See :meth:`~contrastive_losses.bank.KnowledgeBank.pool_prototypes`."""
    dim = audio.shape[1]
    index = labels.unsqueeze(-1).expand(-1, dim)
    out = []
    for x in (audio, text):
        pooled = torch.full((num_clusters, dim), -math.inf, dtype=x.dtype, device=x.device)
        pooled.scatter_reduce_(0, index, x, reduce="amax", include_self=True)
        out.append(pooled)
    filled = torch.bincount(labels, minlength=num_clusters) > 0
    return F.normalize(out[0][filled], dim=-1), F.normalize(out[1][filled], dim=-1)
