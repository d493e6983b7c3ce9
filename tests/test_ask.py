"""ASK loss: reference loops from the equations, gradcheck, Module == function, bad input."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from contrastive_losses.ask import ASKLoss, ask, inject, reliability
from contrastive_losses.bank import KnowledgeBank, _faiss_available
from contrastive_losses.distributed import resolve_gather
from contrastive_losses.ot import sinkhorn

ot = pytest.importorskip("ot")
DT = torch.float64


def _batch(b: int, d: int, k: int, kc: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=DT)  # noqa: E731
    return r(b, d), r(b, d), r(b, k, d), r(b, k, d), r(b, kc, d), r(b, kc, d)


def _unit(x):
    return x / math.sqrt(float((x * x).sum()))


def _pot_plan(cos: torch.Tensor, eps: float, iters: int) -> torch.Tensor:
    n = cos.shape[0]
    a = np.full(n, 1.0 / n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = ot.sinkhorn(a, a, -cos.numpy(), eps, method="sinkhorn_log", numItermax=iters, stopThr=0)
    return torch.from_numpy(q)


def ref_ask(audio, text, fa, ft, ca, ct, rho, beta, lam_f, lam_c, tau, eps, iters):
    """ASK written as loops over samples, straight from the equations (DESIGN §3)."""
    b = audio.shape[0]
    u = [_unit(audio[i]) for i in range(b)]
    v = [_unit(text[i]) for i in range(b)]
    sources = {}
    for name, ka, kt in (("fine", fa, ft), ("coarse", ca, ct)):
        if ka is None:
            continue
        mean_a = [sum(ka[i, j] for j in range(ka.shape[1])) / ka.shape[1] for i in range(b)]
        mean_t = [sum(kt[i, j] for j in range(kt.shape[1])) / kt.shape[1] for i in range(b)]
        # reliability (Eq. 10-12): both directions of the knowledge-to-knowledge softmax
        r = [[float(_unit(mean_a[i]) @ _unit(mean_t[j])) / tau for j in range(b)] for i in range(b)]
        psi = []
        for i in range(b):
            p_a = math.exp(r[i][i]) / sum(math.exp(r[i][j]) for j in range(b))
            p_t = math.exp(r[i][i]) / sum(math.exp(r[j][i]) for j in range(b))
            psi.append(math.sqrt(p_a * p_t))
        potential = sum(-math.log(p) for p in psi) / b  # Eq. 16
        sources[name] = (mean_a, mean_t, psi, potential)
    n_src = len(sources)
    u2, v2 = [], []
    for i in range(b):  # injection, reliability-weighted
        du = sum((s[2][i] * (s[0][i] - u[i]) for s in sources.values()), torch.zeros_like(u[i]))
        dv = sum((s[2][i] * (s[1][i] - v[i]) for s in sources.values()), torch.zeros_like(v[i]))
        u2.append(_unit(u[i] + rho / max(n_src, 1) * du))
        v2.append(_unit(v[i] + rho / max(n_src, 1) * dv))
    cos = torch.tensor([[float(u2[i] @ v2[j]) for j in range(b)] for i in range(b)], dtype=DT)
    q = _pot_plan(cos, eps, iters)
    mix = [[(1 - beta) * (i == j) + beta * b * float(q[i, j]) for j in range(b)] for i in range(b)]
    l_a2t, l_t2a = [], []
    for i in range(b):  # Eq. 14-15
        s_a2t = [sum(mix[i][m] * float(cos[m, j]) for m in range(b)) / tau for j in range(b)]
        s_t2a = [sum(mix[m][i] * float(cos[j, m]) for m in range(b)) / tau for j in range(b)]
        l_a2t.append(-s_a2t[i] + math.log(sum(math.exp(x) for x in s_a2t)))
        l_t2a.append(-s_t2a[i] + math.log(sum(math.exp(x) for x in s_t2a)))
    contrastive = sum(0.5 * (x + y) for x, y in zip(l_a2t, l_t2a, strict=True)) / b
    pf = sources["fine"][3] if "fine" in sources else 0.0
    pc = sources["coarse"][3] if "coarse" in sources else 0.0
    total = (1 + lam_f * pf + lam_c * pc) * contrastive  # Eq. 17-18
    return total, {
        "loss_a2t": sum(l_a2t) / b,
        "loss_t2a": sum(l_t2a) / b,
        "contrastive": contrastive,
        "potential_fine": pf,
        "potential_coarse": pc,
        "psi": {k: s[2] for k, s in sources.items()},
    }


@pytest.mark.parametrize("which", ["both", "fine", "none"])
@pytest.mark.parametrize(("rho", "beta", "eps"), [(0.2, 0.2, 0.05), (0.7, 0.9, 0.5)])
def test_matches_reference_loop(which, rho, beta, eps):
    a, t, fa, ft, ca, ct = _batch(5, 4, 3, 2, seed=1)
    if which != "both":
        ca = ct = None
    if which == "none":
        fa = ft = None
    kw = dict(injection_ratio=rho, ot_weight=beta, lambda_fine=0.2, lambda_coarse=0.3,
              temperature=0.1, epsilon=eps, sinkhorn_iters=30)  # fmt: skip
    loss, terms = ask(a, t, fa, ft, ca, ct, return_terms=True, **kw)
    ref, rterms = ref_ask(a, t, fa, ft, ca, ct, rho, beta, 0.2, 0.3, 0.1, eps, 30)
    torch.testing.assert_close(loss, torch.tensor(ref, dtype=DT))
    for key in ("loss_a2t", "loss_t2a", "contrastive", "potential_fine", "potential_coarse"):
        torch.testing.assert_close(terms[key], torch.tensor(rterms[key], dtype=DT), msg=key)
    for g, psi in rterms["psi"].items():
        torch.testing.assert_close(terms[f"reliability_{g}"], torch.tensor(psi, dtype=DT).mean())


def test_reliability_and_injection_match_loops():
    _, _, fa, ft, _, _ = _batch(6, 4, 3, 1, seed=2)
    ka, kt = fa.mean(1), ft.mean(1)
    psi = reliability(ka, kt, temperature=0.2)
    _, rterms = ref_ask(*_batch(6, 4, 3, 1, seed=2)[:2], fa, ft, None, None,
                        0.2, 0.2, 0, 0, 0.2, 0.05, 1)  # fmt: skip
    torch.testing.assert_close(psi, torch.tensor(rterms["psi"]["fine"], dtype=DT))
    x = F.normalize(torch.randn(6, 4, dtype=DT), dim=-1)
    out = inject(x, [ka], [psi], 0.3)
    for i in range(6):
        torch.testing.assert_close(out[i], _unit(x[i] + 0.3 * psi[i] * (ka[i] - x[i])))


def test_no_knowledge_no_transport_is_symmetric_infonce():
    a, t, *_ = _batch(7, 5, 1, 1, seed=3)
    logits = F.normalize(a, dim=-1) @ F.normalize(t, dim=-1).T / 0.07
    target = torch.arange(7)
    infonce = 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))
    torch.testing.assert_close(ask(a, t, None, None, ot_weight=0.0), infonce)


def test_reduction_and_modulation():
    a, t, fa, ft, ca, ct = _batch(6, 4, 3, 2, seed=4)
    per, terms = ask(a, t, fa, ft, ca, ct, reduction="none", return_terms=True)
    assert per.shape == (6,)
    torch.testing.assert_close(ask(a, t, fa, ft, ca, ct, reduction="sum"), per.sum())
    torch.testing.assert_close(ask(a, t, fa, ft, ca, ct), per.mean())
    m = 1 + 0.2 * terms["potential_fine"] + 0.3 * terms["potential_coarse"]
    torch.testing.assert_close(terms["modulation"], m)
    torch.testing.assert_close(per.mean(), m * terms["contrastive"])
    assert terms["potential_fine"] > 0 and terms["potential_coarse"] > 0
    torch.testing.assert_close(
        terms["reliability"], (terms["reliability_fine"] + terms["reliability_coarse"]) / 2
    )
    assert all(not v.requires_grad for v in terms.values())


@given(seed=st.integers(0, 10_000), b=st.integers(2, 8))
def test_reliability_properties(seed, b):
    g = torch.Generator().manual_seed(seed)
    ka, kt = torch.randn(b, 4, generator=g, dtype=DT), torch.randn(b, 4, generator=g, dtype=DT)
    psi = reliability(ka, kt, 0.07)
    assert ((psi > 0) & (psi <= 1)).all()
    perm = torch.randperm(b, generator=g)
    torch.testing.assert_close(reliability(ka[perm], kt[perm], 0.07), psi[perm])
    # scale invariance: reliability compares directions
    torch.testing.assert_close(reliability(3 * ka, 0.5 * kt, 0.07), psi)


def test_consistent_knowledge_is_reliable_inconsistent_is_not():
    k = torch.eye(4, dtype=DT)
    assert (reliability(k, k, 0.07) > 0.99).all()
    assert (reliability(k, k.roll(1, 0), 0.07) < 0.01).all()


def test_injection_limits():
    x = F.normalize(torch.randn(3, 4, dtype=DT), dim=-1)
    kn = torch.randn(3, 4, dtype=DT)
    ones = torch.ones(3, dtype=DT)
    torch.testing.assert_close(inject(x, [kn], [ones], 0.0), x)
    torch.testing.assert_close(inject(x, [kn], [ones], 1.0), F.normalize(kn, dim=-1))
    torch.testing.assert_close(inject(x, [kn], [torch.zeros(3, dtype=DT)], 0.9), x)


def test_gradcheck_with_constant_plan():
    a, t, fa, ft, ca, ct = _batch(4, 3, 2, 1, seed=5)
    a.requires_grad_(True)
    t.requires_grad_(True)
    with torch.no_grad():
        plan = sinkhorn(torch.rand(4, 4, dtype=DT), 0.1, max_iter=20)

    def fn(x, y):
        return ask(x, y, fa, ft, ca, ct, plan=plan, temperature=0.2)

    assert torch.autograd.gradcheck(fn, (a, t))
    assert torch.autograd.gradgradcheck(fn, (a, t))


def test_gradcheck_through_the_plan():
    a, t, fa, ft, _, _ = _batch(4, 3, 2, 1, seed=6)
    a.requires_grad_(True)
    t.requires_grad_(True)

    def fn(x, y):
        return ask(x, y, fa, ft, detach_plan=False, epsilon=0.3, sinkhorn_iters=10, temperature=0.2)

    assert torch.autograd.gradcheck(fn, (a, t))


def test_detached_plan_gradient_equals_passing_the_plan():
    a, t, fa, ft, ca, ct = _batch(5, 4, 2, 1, seed=7)
    a.requires_grad_(True)
    (g1,) = torch.autograd.grad(ask(a, t, fa, ft, ca, ct), a)
    # recompute the same plan from the same injected similarities
    psi_f = reliability(fa.mean(1), ft.mean(1), 0.07)
    psi_c = reliability(ca.mean(1), ct.mean(1), 0.07)
    u = inject(F.normalize(a.detach(), dim=-1), [fa.mean(1), ca.mean(1)], [psi_f, psi_c], 0.2)
    v = inject(F.normalize(t, dim=-1), [ft.mean(1), ct.mean(1)], [psi_f, psi_c], 0.2)
    plan = sinkhorn(u @ v.T, 0.05, max_iter=50)
    (g2,) = torch.autograd.grad(ask(a, t, fa, ft, ca, ct, plan=plan), a)
    torch.testing.assert_close(g1, g2)
    (g3,) = torch.autograd.grad(ask(a, t, fa, ft, ca, ct, detach_plan=False), a)
    assert (g3 - g1).abs().max() > 1e-6  # the flag changes the gradient


def _bank(n=40, d=8, seed=0, backend="torch", protos=4, dup=1, gather=None):
    g = torch.Generator().manual_seed(seed)
    audio, text = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)
    ids = torch.arange(n) // dup
    bank = KnowledgeBank(d, backend=backend, num_prototypes=protos)
    return bank.build(audio, text, ids, gather=gather), ids


BACKENDS = [
    "torch",
    pytest.param("faiss", marks=pytest.mark.skipif(not _faiss_available(), reason="no faiss")),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_equals_function_with_manual_retrieval(backend):
    kb, bank_ids = _bank(backend=backend, dup=2)
    loss_fn = ASKLoss(kb, k=4, k_coarse=2)
    # the batch is bank rows with their ids: the worst case for leakage
    a = kb.audio[:6].float() + 0.01 * torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    t = kb.text[:6].float().clone()
    ids = bank_ids[:6]
    loss, terms = loss_fn(a, t, ids, return_terms=True)
    ia = kb.search(F.normalize(a, dim=-1), 4, "audio", exclude_ids=ids)[1]
    it = kb.search(F.normalize(t, dim=-1), 4, "text", exclude_ids=ids)[1]
    assert not (kb.ids[ia] == ids[:, None]).any() and not (kb.ids[it] == ids[:, None]).any()
    pa = kb.search_prototypes(F.normalize(a, dim=-1), 2, "audio")[1]
    pt = kb.search_prototypes(F.normalize(t, dim=-1), 2, "text")[1]
    ref = ask(a, t, kb.audio[ia], kb.text[it], kb.prototype_audio[pa], kb.prototype_text[pt])
    torch.testing.assert_close(loss, ref)
    assert 0 < float(terms["reliability"]) <= 1
    knowledge = loss_fn.retrieve(a, t, ids)
    assert torch.equal(knowledge["fine_audio"], kb.audio[ia])


@pytest.mark.skipif(not _faiss_available(), reason="no faiss")
def test_module_faiss_equals_torch():
    kt, ids = _bank(backend="torch", seed=3)
    kf, _ = _bank(backend="faiss", seed=3)
    g = torch.Generator().manual_seed(2)
    a, t = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    # same data, but k-means differs by backend: compare the fine-only loss
    la = ASKLoss(kt, k=5, use_coarse=False)(a, t, ids[:8])
    lb = ASKLoss(kf, k=5, use_coarse=False)(a, t, ids[:8])
    torch.testing.assert_close(la, lb)


def test_module_backward_and_float16_bank():
    g = torch.Generator().manual_seed(4)
    kb = KnowledgeBank(8, backend="torch", num_prototypes=3, dtype=torch.float16)
    kb.build(torch.randn(30, 8, generator=g), torch.randn(30, 8, generator=g), torch.arange(30))
    a = torch.randn(5, 8, generator=g, requires_grad=True)
    t = torch.randn(5, 8, generator=g, requires_grad=True)
    loss = ASKLoss(kb, k=3)(a, t, torch.arange(100, 105))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert a.grad is not None and torch.isfinite(a.grad).all() and a.grad.abs().sum() > 0


def test_module_bad_input():
    kb, _ = _bank()
    a, t = torch.randn(4, 8), torch.randn(4, 8)
    ids = torch.arange(4)
    with pytest.raises(TypeError, match="bank"):
        ASKLoss("not a bank")
    with pytest.raises(ValueError, match="backend"):
        ASKLoss(KnowledgeBank(8, backend="gpu-magic"))
    with pytest.raises(ValueError, match="empty"):
        ASKLoss(KnowledgeBank(8, backend="torch"))(a, t, ids)
    with pytest.raises(ValueError, match="dim"):
        ASKLoss(kb)(torch.randn(4, 6), torch.randn(4, 6), ids)
    with pytest.raises(ValueError, match="k"):
        ASKLoss(kb, k=40)(a, t, ids)  # 40 rows minus the sample's own
    with pytest.raises(ValueError, match="ids"):
        ASKLoss(kb)(a, t)
    with pytest.raises(ValueError, match="ids"):
        ASKLoss(kb)(a, t, torch.arange(3))
    with pytest.raises(TypeError, match="ids"):
        ASKLoss(kb)(a, t, ids.float())
    with pytest.raises(ValueError, match="k_coarse"):
        ASKLoss(kb, k_coarse=5)(a, t, ids)
    with pytest.raises(ValueError, match="prototypes"):
        ASKLoss(_bank(protos=0)[0])(a, t, ids)
    ASKLoss(_bank(protos=0)[0], use_coarse=False)(a, t, ids)
    with pytest.raises(ValueError, match="k"):
        ASKLoss(kb, k=0)
    with pytest.raises(ValueError, match="text"):
        ASKLoss(kb)(a, torch.randn(5, 8), ids)
    with pytest.raises(ValueError, match="temperature"):
        ASKLoss(kb, temperature=0.0)


def test_function_bad_input():
    a, t, fa, ft, ca, ct = _batch(4, 3, 2, 1, seed=8)
    with pytest.raises(ValueError, match="fine_audio, fine_text"):
        ask(a, t, fa, None)
    with pytest.raises(ValueError, match="fine_text"):
        ask(a, t, fa, ft[:, :, :2])
    with pytest.raises(ValueError, match="coarse_audio"):
        ask(a, t, fa, ft, ca[:3], ct)
    with pytest.raises(ValueError, match="fine_audio"):
        ask(a, t, fa[:, :, :, None], ft)
    with pytest.raises(ValueError, match="injection_ratio"):
        ask(a, t, fa, ft, injection_ratio=1.5)
    with pytest.raises(ValueError, match="ot_weight"):
        ask(a, t, fa, ft, ot_weight=-0.1)
    with pytest.raises(ValueError, match="plan"):
        ask(a, t, fa, ft, plan=torch.ones(3, 3, dtype=DT))
    with pytest.raises(ValueError, match="reduction"):
        ask(a, t, fa, ft, reduction="max")
    with pytest.raises(ValueError, match="audio"):
        ask(a[:1], t[:1], fa[:1], ft[:1])
    with pytest.raises(ValueError, match="fine_audio"):
        ask(a, t, fa * float("nan"), ft)


# ------------------------------------------------------------------ two ranks, gloo


def _ask_rank_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import os
    from pathlib import Path

    import torch.distributed as dist
    from helpers import rank_rows

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        a, t, ids = _ask_global_batch()
        rows = rank_rows(rank)
        results = {}
        for reduction in ("mean", "none"):
            # Every rank holds the whole bank (not a distributed build of rank shards).
            loss_fn = ASKLoss(_bank(gather=False)[0], k=3, reduction=reduction)
            assert resolve_gather(loss_fn.gather)
            la, lt = a[rows].clone().requires_grad_(), t[rows].clone().requires_grad_()
            loss = loss_fn(la, lt, ids[rows])
            loss.sum().backward()
            results[reduction] = (loss.detach(), la.grad, lt.grad)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _ask_global_batch():
    from helpers import RANK_SIZES

    g = torch.Generator().manual_seed(5)
    n = sum(RANK_SIZES)
    a = torch.randn(n, 8, generator=g, dtype=torch.float64)
    t = a + 0.5 * torch.randn(n, 8, generator=g, dtype=torch.float64)
    return a, t, torch.arange(n) * 5  # ids 0, 5, 10, ... are in the bank of _bank()


def test_gathered_ask_matches_single_process(tmp_path):
    """Uneven batches (5 and 3): the mean of the rank losses is the loss of the whole
    batch, and the rank gradients averaged as DDP does are its gradient."""
    from helpers import RANK_SIZES, spawn_ranks

    ranks = spawn_ranks(_ask_rank_worker, tmp_path)
    world = len(RANK_SIZES)
    a, t, ids = _ask_global_batch()
    for reduction in ("mean", "none"):
        a1, t1 = a.clone().requires_grad_(), t.clone().requires_grad_()
        loss = ASKLoss(_bank()[0], k=3, reduction=reduction)(a1, t1, ids)
        loss.sum().backward()
        if reduction == "mean":
            mean = sum(r[reduction][0] for r in ranks) / world
            torch.testing.assert_close(mean, loss.detach(), rtol=1e-6, atol=0)
            scale = world  # every rank holds the global loss; DDP divides by world
        else:
            torch.testing.assert_close(torch.cat([r[reduction][0] for r in ranks]), loss.detach())
            scale = 1  # each rank backpropagates only its own rows of the global losses
        grad_a = torch.cat([r[reduction][1] for r in ranks]) / scale
        grad_t = torch.cat([r[reduction][2] for r in ranks]) / scale
        torch.testing.assert_close(grad_a, a1.grad, rtol=1e-6, atol=1e-12)
        torch.testing.assert_close(grad_t, t1.grad, rtol=1e-6, atol=1e-12)
