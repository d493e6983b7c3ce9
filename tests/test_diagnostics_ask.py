"""ASK diagnostics: out-of-batch influence (Eq. 2) and representation-drift mismatch (Eq. 3-4)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from contrastive_losses.ask import ASKLoss
from contrastive_losses.bank import KnowledgeBank
from contrastive_losses.diagnostics import out_of_batch_influence, representation_drift_mismatch


def _infonce(audio, text, temperature=0.07):
    logits = F.normalize(audio, dim=-1) @ F.normalize(text, dim=-1).T / temperature
    target = torch.arange(audio.shape[0])
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))


def _setup(seed=0, n=30, d=6, b=5):
    g = torch.Generator().manual_seed(seed)
    kb = KnowledgeBank(d, backend="torch", num_prototypes=3)
    kb.build(torch.randn(n, d, generator=g), torch.randn(n, d, generator=g), torch.arange(n))
    a = torch.randn(b, d, generator=g, requires_grad=True)
    t = torch.randn(b, d, generator=g, requires_grad=True)
    return kb, a, t, torch.arange(100, 100 + b)


def test_infonce_has_zero_out_of_batch_influence():
    kb, a, t, _ = _setup()
    infl = out_of_batch_influence(_infonce, a, t, outside=[kb.audio, kb.text])
    assert infl.shape == (len(kb),)
    assert torch.equal(infl, torch.zeros_like(infl))


def test_ask_influence_is_positive_exactly_on_the_retrieved_rows():
    kb, a, t, ids = _setup()
    loss_fn = ASKLoss(kb, k=4, use_coarse=False)
    infl = out_of_batch_influence(loss_fn, a, t, ids, outside=[kb.audio, kb.text])
    know = loss_fn.retrieve(a, t, ids)  # pairs actually retrieved, (B, k, 2, D)
    rows = set()
    for m, col in (("audio", 0), ("text", 1)):  # pairs retrieved by the audio / by the text
        hits = know[f"fine_{m}"][:, :, col].unsqueeze(2) == kb.embeddings(m)[None, None]
        rows |= set(hits.all(-1).nonzero()[:, 2].tolist())
    assert set((infl > 0).nonzero().flatten().tolist()) == rows
    assert (
        out_of_batch_influence(loss_fn, a, t, ids, outside=[kb.audio, kb.text], reduction="sum") > 0
    )
    both = [kb.audio, kb.text]
    # Eq. 8 alone (no potentials) and Eq. 12 alone (no injection) each reach the bank ...
    no_potentials = ASKLoss(kb, k=4, use_coarse=False, lambda_fine=0.0, lambda_coarse=0.0)
    assert out_of_batch_influence(no_potentials, a, t, ids, outside=both, reduction="sum") > 0
    no_inject = ASKLoss(kb, k=4, use_coarse=False, injection_ratio=0.0)
    assert out_of_batch_influence(no_inject, a, t, ids, outside=both, reduction="sum") > 0
    # ... without both, back to the in-batch bottleneck
    neither = ASKLoss(
        kb, k=4, use_coarse=False, injection_ratio=0.0, lambda_fine=0.0, lambda_coarse=0.0
    )
    assert out_of_batch_influence(neither, a, t, ids, outside=both, reduction="sum") == 0


def test_influence_equals_manual_gradient_norms_and_restores_state():
    kb, a, t, ids = _setup(seed=1)
    loss_fn = ASKLoss(kb, k=3, k_coarse=2)
    got = out_of_batch_influence(loss_fn, a, t, ids=ids, outside=(kb.audio, kb.text))
    assert not kb.audio.requires_grad and not kb.text.requires_grad
    assert a.grad is None  # parameters' .grad untouched
    kb.audio.requires_grad_(True)
    kb.text.requires_grad_(True)
    ga, gt = torch.autograd.grad(loss_fn(a, t, ids), (kb.audio, kb.text))
    kb.audio.requires_grad_(False)
    kb.text.requires_grad_(False)
    manual = torch.stack(
        [torch.sqrt((ga[n] ** 2).sum() + (gt[n] ** 2).sum()) for n in range(len(kb))]
    )
    torch.testing.assert_close(got.float(), manual)
    torch.testing.assert_close(
        out_of_batch_influence(
            loss_fn, a, t, ids=ids, outside=(kb.audio, kb.text), reduction="mean"
        ),
        got.mean(),
    )


def test_influence_bad_input():
    kb, a, t, _ = _setup()
    with pytest.raises(TypeError, match="loss_fn"):
        out_of_batch_influence("loss", outside=kb.audio)
    with pytest.raises(ValueError, match="outside"):
        out_of_batch_influence(_infonce, a, t, outside=[kb.audio, kb.text[:3]])
    with pytest.raises(ValueError, match="outside"):
        out_of_batch_influence(_infonce, a, t, outside=[])
    with pytest.raises(TypeError, match="outside"):
        out_of_batch_influence(_infonce, a, t, outside=kb.ids)
    with pytest.raises(ValueError, match="loss_fn"):
        out_of_batch_influence(lambda: torch.ones(3), outside=kb.audio)
    with pytest.raises(ValueError, match="reduction"):
        out_of_batch_influence(_infonce, a, t, outside=kb.audio, reduction="max")
    assert not kb.audio.requires_grad


@given(seed=st.integers(0, 10_000), n=st.integers(1, 12), d=st.integers(1, 6))
def test_rdm_matches_loops(seed, n, d):
    g = torch.Generator().manual_seed(seed)
    cur, old = (
        torch.randn(n, d, generator=g, dtype=torch.float64),
        torch.randn(n, d, generator=g, dtype=torch.float64),
    )
    cos = representation_drift_mismatch(cur, old, reduction="none")
    l2 = representation_drift_mismatch(cur, old, metric="l2", reduction="none")
    for i in range(n):
        p, q = cur[i] / cur[i].norm(), old[i] / old[i].norm()
        torch.testing.assert_close(cos[i], 1 - p @ q)
        torch.testing.assert_close(l2[i], (p - q).norm())
    torch.testing.assert_close(l2**2, 2 * cos)  # unit vectors: |p - q|^2 = 2 (1 - <p, q>)
    torch.testing.assert_close(representation_drift_mismatch(cur, old), cos.mean())
    torch.testing.assert_close(representation_drift_mismatch(cur, old, reduction="sum"), cos.sum())
    assert (cos >= -1e-12).all()
    assert float(representation_drift_mismatch(cur, 3.0 * cur)) < 1e-12


class _Enc(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.t = nn.Linear(4, 6)

    def forward(self, batch):
        x, y, i = batch
        return self.a(x), self.t(y), i


def test_refresh_makes_rdm_zero_after_training_drift():
    torch.manual_seed(0)
    enc = _Enc()
    g = torch.Generator().manual_seed(3)
    data = [
        (
            torch.randn(6, 4, generator=g),
            torch.randn(6, 4, generator=g),
            torch.arange(6 * b, 6 * b + 6),
        )
        for b in range(4)
    ]
    kb = KnowledgeBank(6, backend="torch", num_prototypes=4).refresh(enc, data, progress=False)

    def current():
        with torch.no_grad():
            return torch.cat([enc(b)[0] for b in data])

    assert float(representation_drift_mismatch(current(), kb.audio)) < 1e-6
    loss_fn = ASKLoss(kb, k=3, k_coarse=1)
    opt = torch.optim.SGD(enc.parameters(), lr=0.5)
    for batch in data:  # one epoch of ASK training moves the encoder
        a, t, i = enc(batch)
        opt.zero_grad()
        loss_fn(a, t, i).backward()
        opt.step()
    assert float(representation_drift_mismatch(current(), kb.audio)) > 1e-3
    kb.refresh(enc, data, progress=False)
    assert float(representation_drift_mismatch(current(), kb.audio)) < 1e-6
    assert float(representation_drift_mismatch(current(), kb.audio, metric="l2")) < 1e-3


def test_rdm_bad_input():
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="stale"):
        representation_drift_mismatch(x, x[:3])
    with pytest.raises(ValueError, match="current"):
        representation_drift_mismatch(torch.randn(4), x)
    with pytest.raises(ValueError, match="metric"):
        representation_drift_mismatch(x, x, metric="kl")
    with pytest.raises(ValueError, match="reduction"):
        representation_drift_mismatch(x, x, reduction="max")
    with pytest.raises(ValueError, match="stale"):
        representation_drift_mismatch(x, torch.zeros(4, 3))
