"""SupCLAP support vector regularisation written from the paper as plain loops.

Eq. 5-6: t_sup = t + R (a_pos - t)/||a_pos - t||, L_svr = cross-entropy of <t_sup, a_j>/tau
over every candidate j (positive included). Eq. 5 sums the two directions of the base
and Eq. 6 adds alpha times the SVR term of each direction used; the library's base is the
mean of the two directions, so its SVR and constraint terms are the sums over the
directions halved (uni: half the text-anchor term). Sec. 3.2: the radius predictor reads
the anchor's row of s = cos/tau as [s_pos, negatives sorted descending] (App. B), cut or
padded with the row minimum, and the constraint is relu(R - ||a_pos - t||) + relu(-R).
dL/dR of one anchor, from t_sup's definition: (1/tau) sum_j P_j <u_hat, a_j - a_pos>.
Everything is a loop over single samples; tensors are indexed element by element.
"""

from __future__ import annotations

import torch
from reference import neg_log_softmax, unit
from torch import Tensor


def support_row(anchor: Tensor, positive: Tensor, radius: Tensor | float) -> Tensor:
    """Eq. 5: the support vector of one (normalised) anchor, not re-normalised."""
    u = positive - anchor
    return anchor + radius * u / torch.sqrt((u * u).sum())


def support_vector_term(
    anchor: Tensor,
    candidates: Tensor,
    radius: list[Tensor | float],
    temperature: float,
    mask: list[bool] | None = None,
) -> Tensor:
    """Eq. 6, mean over present anchors; absent pairs are neither anchors nor candidates."""
    n = anchor.shape[0]
    present = mask or [True] * n
    members = [j for j in range(n) if present[j]]
    total = torch.zeros((), dtype=anchor.dtype)
    for i in members:
        t_sup = support_row(unit(anchor[i]), unit(candidates[i]), radius[i])
        scores = [(t_sup * unit(candidates[j])).sum() / temperature for j in members]
        total = total + neg_log_softmax(scores, members.index(i))
    return total / len(members)


def radius_slope(anchor: Tensor, candidates: Tensor, i: int, radius: float, temperature: float):
    """tau * dL_i/dR: sum_j P_j <u_hat, a_j - a_i>, P the softmax at the support vector."""
    x, pos = unit(anchor[i]), unit(candidates[i])
    u = (pos - x) / torch.sqrt(((pos - x) ** 2).sum())
    t_sup = x + radius * u
    scores = torch.stack([(t_sup * unit(c)).sum() / temperature for c in candidates])
    probs = torch.softmax(scores, dim=0)
    return sum(probs[j] * (u * (unit(candidates[j]) - pos)).sum() for j in range(len(scores)))


def radius_features(row: list[float], pos: int, num_features: int) -> list[float]:
    """App. B: [s_pos, negatives sorted descending], cut or padded with the row minimum."""
    negatives = sorted((s for j, s in enumerate(row) if j != pos), reverse=True)
    feats = [row[pos], *negatives][:num_features]
    return feats + [min(row)] * (num_features - len(feats))


def constraint_row(radius: Tensor | float, distance: float) -> Tensor:
    r = torch.as_tensor(radius)
    return torch.relu(r - distance) + torch.relu(-r)


def regularizer(
    pairs: list[tuple[Tensor, Tensor, list[bool] | None]],
    radius_of,  # (direction, pair index, row, row of cos/tau, positive index) -> radius
    temperature: float,
    direction: str,
) -> tuple[Tensor, Tensor]:
    """SVR and constraint terms of the regulariser: per direction the mean over every
    present anchor of every pair, summed over the directions ("uni": text anchors; "bi":
    text and audio anchors) and halved."""
    svr = torch.zeros((), dtype=torch.float64)
    con = torch.zeros((), dtype=torch.float64)
    count = 0
    dirs = ["t2a", "a2t"] if direction == "bi" else ["t2a"]
    for p, (audio, text, mask) in enumerate(pairs):
        n = audio.shape[0]
        present = mask or [True] * n
        members = [j for j in range(n) if present[j]]
        for d in dirs:
            anchors, cands = (text, audio) if d == "t2a" else (audio, text)
            for i in members:
                x = unit(anchors[i])
                sims = [float((x * unit(cands[j])).sum()) / temperature for j in members]
                r = radius_of(d, p, i, sims, members.index(i))
                t_sup = support_row(x, unit(cands[i]), r)
                scores = [(t_sup * unit(cands[j])).sum() / temperature for j in members]
                svr = svr + neg_log_softmax(scores, members.index(i))
                distance = float(torch.sqrt(((unit(cands[i]) - x) ** 2).sum()))
                con = con + constraint_row(r, distance)
                count += 1
    per_direction = count // len(dirs)
    return svr / (2 * per_direction), con / (2 * per_direction)
