"""Reference implementations written from the papers' equations as plain Python loops.

Slow on purpose: every sum is a loop over samples, so a vectorisation bug in the library
cannot hide in a shared helper. Inputs are lists of 1-d tensors or tensors indexed
element by element; outputs are 0-d tensors that keep the autograd graph.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def unit(x: Tensor) -> Tensor:
    return x / torch.sqrt((x * x).sum())


def sim(u: Tensor, v: Tensor, temperature: float) -> Tensor:
    return (unit(u) * unit(v)).sum() / temperature


def neg_log_softmax(scores: list[Tensor], pos: int) -> Tensor:
    """-log(exp(scores[pos]) / sum_j exp(scores[j])), written out."""
    m = max(float(s.detach()) for s in scores)  # a constant shift: no gradient
    denom = sum(torch.exp(s - m) for s in scores)
    return -(scores[pos] - m - torch.log(denom))


def info_nce(audio: Tensor, text: Tensor, temperature: float) -> Tensor:
    """CLIP loss: mean over i of (a->t + t->a)/2."""
    n = audio.shape[0]
    total = torch.zeros((), dtype=audio.dtype)
    for i in range(n):
        a2t = [sim(audio[i], text[j], temperature) for j in range(n)]
        t2a = [sim(text[i], audio[j], temperature) for j in range(n)]
        total = total + (neg_log_softmax(a2t, i) + neg_log_softmax(t2a, i)) / 2
    return total / n


def info_nce_ids(audio: Tensor, text: Tensor, ids: list[int], temperature: float) -> Tensor:
    """Multi-positive InfoNCE: a row's loss is the mean over its positives."""
    n = audio.shape[0]
    total = torch.zeros((), dtype=audio.dtype)
    for i in range(n):
        pos = [j for j in range(n) if ids[j] == ids[i]]
        a2t = [sim(audio[i], text[j], temperature) for j in range(n)]
        t2a = [sim(text[i], audio[j], temperature) for j in range(n)]
        la = sum(neg_log_softmax(a2t, p) for p in pos) / len(pos)
        lt = sum(neg_log_softmax(t2a, p) for p in pos) / len(pos)
        total = total + (la + lt) / 2
    return total / n


def siglip(audio: Tensor, text: Tensor, scale: float, bias: float) -> Tensor:
    """-1/N sum_i sum_j log sigmoid(z_ij (scale <a_i, t_j> + bias))."""
    n = audio.shape[0]
    total = torch.zeros((), dtype=audio.dtype)
    for i in range(n):
        for j in range(n):
            z = 1.0 if i == j else -1.0
            logit = scale * (unit(audio[i]) * unit(text[j])).sum() + bias
            total = total - torch.log(1 / (1 + torch.exp(-z * logit)))
    return total / n


def kcl(
    audio: Tensor, text: Tensor, temperature: float, mask: list[list[bool]] | None = None
) -> Tensor:
    """ATRI Eq. 9-11, per-language negatives; absent captions leave every sum."""
    n, k_langs = text.shape[0], text.shape[1]
    present = mask or [[True] * k_langs for _ in range(n)]
    total = torch.zeros((), dtype=audio.dtype)
    count = 0
    for k in range(k_langs):
        members = [j for j in range(n) if present[j][k]]
        for i in members:
            a2t = [sim(audio[i], text[j, k], temperature) for j in members]
            t2a = [sim(text[i, k], audio[j], temperature) for j in members]
            pos = members.index(i)
            total = total + neg_log_softmax(a2t, pos) + neg_log_softmax(t2a, pos)
            count += 1
    return total / (2 * count)


def kcl_all_languages(
    audio: Tensor, text: Tensor, temperature: float, mask: list[list[bool]] | None = None
) -> Tensor:
    """One audio against all present N*K captions (its own K positive, mean over them);
    each caption against all N audios. Per present pair: (a2t_i + t2a_ik) / 2."""
    n, k_langs = text.shape[0], text.shape[1]
    present = mask or [[True] * k_langs for _ in range(n)]
    captions = [(j, k) for j in range(n) for k in range(k_langs) if present[j][k]]
    total = torch.zeros((), dtype=audio.dtype)
    for i in range(n):
        scores = [sim(audio[i], text[j, k], temperature) for (j, k) in captions]
        own = [c for c, (j, _) in enumerate(captions) if j == i]
        a2t = sum(neg_log_softmax(scores, p) for p in own) / len(own)
        for k in range(k_langs):
            if not present[i][k]:
                continue
            t2a = [sim(text[i, k], audio[j], temperature) for j in range(n)]
            total = total + (a2t + neg_log_softmax(t2a, i)) / 2
    return total / len(captions)


def cacl(audio: Tensor, english: Tensor, other: Tensor, temperature: float) -> Tensor:
    """ATRI Eq. 12-13: (L_ae + L_at + L_et) / (6N), each L a sum of both directions."""
    n = audio.shape[0]
    total = torch.zeros((), dtype=audio.dtype)
    for x, y in ((audio, english), (audio, other), (english, other)):
        for i in range(n):
            x2y = [sim(x[i], y[j], temperature) for j in range(n)]
            y2x = [sim(y[i], x[j], temperature) for j in range(n)]
            total = total + neg_log_softmax(x2y, i) + neg_log_softmax(y2x, i)
    return total / (6 * n)


def log_uniform(n: int) -> float:
    return math.log(n)
