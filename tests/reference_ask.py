"""ASK (arXiv 2512.19703, Eq. 8-18) written from the paper as plain loops.

Per sample i and granularity g: Eq. 8 injects the mean of the k retrieved audios into
u_i (rho = share of knowledge) and the mean of the k retrieved texts into v_i; Eq. 10-12
weight the partners of the other modality's neighbours by a softmax of their mean
similarity to this modality's neighbours and give Psi = sum_j w_j exp(<u_i, u'_j>);
Eq. 16 F = mean_i -log Psi per direction; Eq. 14 mixes each similarity matrix with its
transport plan; Eq. 15, 17, 18 sum the granularities' cross-entropies per direction,
modulate them by (1 + lambda_f F_f + lambda_c F_c) and average the two directions.
Every sum is a loop; tensors are indexed element by element and the autograd graph is
kept, so float64 gradients can be compared with the library's.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from reference import neg_log_softmax, unit
from torch import Tensor


def dot(x: Tensor, y: Tensor) -> Tensor:
    return sum((x[d] * y[d] for d in range(x.shape[0])), torch.zeros((), dtype=x.dtype))


def mean(rows: list[Tensor]) -> Tensor:
    return sum(rows[1:], rows[0]) / len(rows)


def weights(partners: list[Tensor], retrieved: list[Tensor]) -> list[float]:
    """Eq. 10-11: softmax over j of mean_l <partner_j, retrieved_l> (constants)."""
    s = [sum(float(dot(p, r).detach()) for r in retrieved) / len(retrieved) for p in partners]
    z = sum(math.exp(x) for x in s)
    return [math.exp(x) / z for x in s]


def log_psi(anchor: Tensor, partners: list[Tensor], retrieved: list[Tensor]) -> Tensor:
    """Eq. 12, log of sum_j w_j exp(<anchor, partner_j>)."""
    w = weights(partners, retrieved)
    return torch.log(sum(w[j] * torch.exp(dot(anchor, partners[j])) for j in range(len(w))))


def retrieve(query: Tensor, table: Tensor, k: int, own: int | None, ids: list[int]) -> list[int]:
    """Indices of the k rows of ``table`` most similar to ``query``, skipping id ``own``."""
    scored = [(float(dot(query, table[n])), n) for n in range(table.shape[0]) if ids[n] != own]
    scored.sort(key=lambda sn: -sn[0])
    return [n for _, n in scored[:k]]


def ask(
    audio: Tensor,
    text: Tensor,
    knowledge: dict[str, tuple[Tensor, Tensor]],
    rho: float,
    beta: float,
    lambdas: dict[str, float],
    tau: float,
    plan_fn: Callable[[Tensor], Tensor] | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``knowledge[g] = (pairs retrieved by audio, pairs retrieved by text)``, each
    ``(B, K, 2, D)`` with ``[..., 0, :]`` the audio and ``[..., 1, :]`` the text of a
    pair. ``plan_fn`` maps the detached ``(B, B)`` similarities to a transport plan
    (``None``: no transport)."""
    b = audio.shape[0]
    u = [unit(audio[i]) for i in range(b)]
    v = [unit(text[i]) for i in range(b)]
    ce: dict[tuple[str, str], Tensor] = {}
    pot: dict[tuple[str, str], Tensor] = {}
    for g, (ka, kt) in knowledge.items():
        u2, v2, lp_t2a, lp_a2t = [], [], [], []
        for i in range(b):
            u_ret = [ka[i, l, 0] for l in range(ka.shape[1])]  # retrieved by the audio
            v_par = [ka[i, l, 1] for l in range(ka.shape[1])]  # ... and their captions
            u_par = [kt[i, j, 0] for j in range(kt.shape[1])]  # audios of the text's pairs
            v_ret = [kt[i, j, 1] for j in range(kt.shape[1])]  # retrieved by the text
            u2.append((1 - rho) * u[i] + rho * mean(u_ret))  # Eq. 8
            v2.append((1 - rho) * v[i] + rho * mean(v_ret))
            lp_t2a.append(log_psi(u[i], u_par, u_ret))  # Eq. 10-12
            lp_a2t.append(log_psi(v[i], v_par, v_ret))
        pot[g, "t2a"] = sum(-x for x in lp_t2a) / b  # Eq. 16
        pot[g, "a2t"] = sum(-x for x in lp_a2t) / b
        s = [[dot(u2[i], v2[j]) for j in range(b)] for i in range(b)]
        if plan_fn is None:
            mix = [[float(i == j) for j in range(b)] for i in range(b)]
        else:
            q = plan_fn(
                torch.tensor([[float(x.detach()) for x in row] for row in s], dtype=audio.dtype)
            )
            mix = [[(1 - beta) * (i == j) + beta * b * float(q[i, j]) for j in range(b)]
                   for i in range(b)]  # fmt: skip
        a2t, t2a = [], []
        for i in range(b):  # Eq. 14-15
            row_a = [sum(mix[i][m] * s[m][j] for m in range(b)) / tau for j in range(b)]
            row_t = [sum(mix[m][i] * s[j][m] for m in range(b)) / tau for j in range(b)]
            a2t.append(neg_log_softmax(row_a, i))
            t2a.append(neg_log_softmax(row_t, i))
        ce[g, "a2t"] = sum(a2t) / b
        ce[g, "t2a"] = sum(t2a) / b
    total = torch.zeros((), dtype=audio.dtype)
    terms: dict[str, Tensor] = {}
    for d in ("t2a", "a2t"):
        loss_d = sum(ce[g, d] for g in knowledge)  # Eq. 15: sum over granularities
        mod = 1 + sum(lambdas[g] * pot[g, d] for g in knowledge)  # Eq. 17
        total = total + 0.5 * mod * loss_d  # Eq. 18
        terms[f"loss_{d}"], terms[f"modulation_{d}"] = loss_d, mod
        for g in knowledge:
            terms[f"ce_{g}_{d}"], terms[f"potential_{g}_{d}"] = ce[g, d], pot[g, d]
    return total, terms
