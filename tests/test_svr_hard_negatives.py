"""SupCLAP Fig. 7 as a behaviour of the RadiusPredictor: trained through the SVR term, it
predicts a larger radius for anchors whose batch holds more hard negatives.

Fixed embeddings of a clustered world (items of one cluster are each other's hard
negatives; a caption is its clip plus noise), batches of 24 in which the first K + 1 pairs
share a cluster (K hard negatives each) and the others come from distinct clusters. A tiny
predictor learns from the SVR term of the text anchors plus the constraint (SupCLAP
Eq. 6 and 9; the base loss does not depend on the predictor when the embeddings are
fixed). Two controls keep the test from passing trivially: the untrained predictor
(constant radius) and a predictor trained on the rows of an *independent* batch (its input
says nothing about the anchor's own batch) must not show the increase.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from contrastive_losses import RadiusPredictor
from contrastive_losses.functional import support_vector_term

TAU, BATCH, DIM, CLUSTERS = 0.07, 24, 16, 256
HARD = (0, 6, 12, 18)  # hard negatives per anchor of the first group, as SupCLAP Fig. 7
BETA, STEPS = 0.1, 400


def _batch(g: torch.Generator, k: int, centres: Tensor) -> tuple[Tensor, Tensor]:
    """Audio and text ``(24, D)``: rows 0..k share a cluster, the others are distinct."""
    c = torch.randperm(len(centres), generator=g)[: BATCH - k]
    labels = torch.cat([c[:1].repeat(k), c])
    audio = F.normalize(centres[labels] + 0.35 * torch.randn(BATCH, DIM, generator=g), dim=-1)
    text = F.normalize(audio + 0.6 * torch.randn(BATCH, DIM, generator=g) / DIM**0.5, dim=-1)
    return audio, text


def _radius(predictor: RadiusPredictor, audio: Tensor, text: Tensor) -> Tensor:
    """Per text anchor, from its row of cos / tau (SupCLAP Sec. 3.2)."""
    return predictor(text @ audio.T / TAU)


def _train(independent_rows: bool, seed: int = 0) -> tuple[RadiusPredictor, Tensor]:
    """The predictor after ``STEPS`` Adam steps on batches with K ~ U{0..18}; with
    ``independent_rows`` its radius for each anchor is read from another batch's row."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    centres = torch.randn(CLUSTERS, DIM, generator=g)
    predictor = RadiusPredictor(num_features=BATCH, hidden=16, validate_args=False)
    opt = torch.optim.Adam(predictor.parameters(), lr=3e-3)
    for _ in range(STEPS):
        audio, text = _batch(g, int(torch.randint(0, 19, (), generator=g)), centres)
        rows = audio, text
        if independent_rows:
            rows = _batch(g, int(torch.randint(0, 19, (), generator=g)), centres)
        radius = _radius(predictor, *rows)
        dist = (audio - text).norm(dim=-1)
        constraint = (F.relu(radius - dist) + F.relu(-radius)).mean()
        svr = support_vector_term(text, audio, radius, TAU, validate_args=False)
        loss = svr + BETA * constraint
        opt.zero_grad()
        loss.backward()
        opt.step()
    return predictor, centres


@torch.no_grad()
def _radius_by_hard_negatives(predictor: RadiusPredictor, centres: Tensor) -> list[float]:
    """Mean radius of the anchors with K hard negatives, for each K of ``HARD``."""
    g = torch.Generator().manual_seed(123)
    out = []
    for k in HARD:
        radii = []
        for _ in range(20):
            audio, text = _batch(g, k, centres)
            radii.append(_radius(predictor, audio, text)[: k + 1].mean())
        out.append(float(torch.stack(radii).mean()))
    return out


def _rises(radii: list[float], margin: float = 0.15) -> bool:
    """Every K > 0 above K = 0, and R(18) - R(0) above ``margin``."""
    return all(r > radii[0] for r in radii[1:]) and radii[-1] - radii[0] > margin


def test_more_hard_negatives_give_a_larger_radius() -> None:
    predictor, centres = _train(independent_rows=False)
    radii = _radius_by_hard_negatives(predictor, centres)
    assert _rises(radii), f"radius per K = {HARD}: {radii}"
    # Controls: the same predicate fails for the untrained predictor (a constant radius) ...
    untrained = _radius_by_hard_negatives(RadiusPredictor(num_features=BATCH, hidden=16), centres)
    assert not _rises(untrained), untrained
    # ... and a predictor whose input is an independent batch's row learns a much weaker
    # dependence on K (what it shows comes from the features alone, not from training).
    control, _ = _train(independent_rows=True)
    control_radii = _radius_by_hard_negatives(control, centres)
    gain, control_gain = radii[-1] - radii[0], control_radii[-1] - control_radii[0]
    assert control_gain < gain / 2, (radii, control_radii)
