"""ASK loss: loops from Eq. 8-18, gradcheck, properties, Module == function, bad input."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import reference_ask as ref
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from reference import info_nce

from contrastive_losses.ask import ASKLoss, ask, inject, reliability
from contrastive_losses.bank import KnowledgeBank, _faiss_available
from contrastive_losses.distributed import resolve_gather
from contrastive_losses.ot import sinkhorn

ot = pytest.importorskip("ot")
DT = torch.float64
LAMBDAS = {"fine": 0.2, "coarse": 0.3}


def _batch(b: int, d: int, k: int, kc: int, seed: int):
    """audio, text (B, D) and fine/coarse knowledge pairs (B, K, 2, D), float64."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=DT)  # noqa: E731
    return r(b, d), r(b, d), r(b, k, 2, d), r(b, k, 2, d), r(b, kc, 2, d), r(b, kc, 2, d)


def _pot_plan(eps: float, iters: int):
    def plan(cos: torch.Tensor) -> torch.Tensor:
        n = cos.shape[0]
        a = np.full(n, 1.0 / n)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            q = ot.sinkhorn(
                a, a, -cos.numpy(), eps, method="sinkhorn_log", numItermax=iters, stopThr=0
            )
        return torch.from_numpy(q)

    return plan


def _leaves(*xs):
    return [None if x is None else x.clone().requires_grad_(True) for x in xs]


@pytest.mark.parametrize("coarse", [True, False], ids=["fine+coarse", "fine"])
@pytest.mark.parametrize(("rho", "beta", "eps"), [(0.2, 0.2, 0.05), (0.7, 0.9, 0.5)])
def test_matches_reference_loop_value_and_gradients(coarse, rho, beta, eps):
    data = _batch(4, 3, 3, 2, seed=1)
    if not coarse:
        data = (*data[:4], None, None)
    lib_in, ref_in = _leaves(*data), _leaves(*data)
    kw = dict(injection_ratio=rho, ot_weight=beta, lambda_fine=0.2, lambda_coarse=0.3,
              temperature=0.1, epsilon=eps, sinkhorn_iters=30)  # fmt: skip
    loss, terms = ask(*lib_in, return_terms=True, **kw)
    a, t, fa, ft, ca, ct = ref_in
    knowledge = {"fine": (fa, ft), **({"coarse": (ca, ct)} if coarse else {})}
    want, rterms = ref.ask(a, t, knowledge, rho, beta, LAMBDAS, 0.1, _pot_plan(eps, 30))
    torch.testing.assert_close(loss, want)
    for key, value in rterms.items():
        torch.testing.assert_close(terms[key], value.detach(), msg=key)
    if not coarse:
        assert float(terms["ce_coarse_t2a"]) == 0 and math.isnan(terms["weight_entropy_coarse"])
    loss.backward()
    want.backward()
    for name, x, y in zip(("audio", "text", "fa", "ft", "ca", "ct"), lib_in, ref_in, strict=True):
        if x is not None:
            torch.testing.assert_close(x.grad, y.grad, msg=name)


@pytest.mark.parametrize("use_coarse", [True, False], ids=["fine+coarse", "fine"])
def test_module_matches_reference_with_self_exclusion(use_coarse):
    """Retrieval written as loops too; the batch is made of bank rows (with caption
    siblings sharing an id), the case where not excluding the own id leaks the positive."""
    kb, bank_ids = _bank(n=24, d=5, protos=6, dup=2, dtype=DT)
    g = torch.Generator().manual_seed(1)
    a0 = kb.audio[:5] + 0.05 * torch.randn(5, 5, generator=g, dtype=DT)
    t0 = kb.text[:5].clone()
    ids = bank_ids[:5]
    loss_fn = ASKLoss(kb, k=3, k_coarse=2, use_coarse=use_coarse, temperature=0.1)
    a1, t1 = a0.clone().requires_grad_(), t0.clone().requires_grad_()
    loss = loss_fn(a1, t1, ids)
    loss.backward()

    a2, t2 = a0.clone().requires_grad_(), t0.clone().requires_grad_()
    ids_list = bank_ids.tolist()
    u = [ref.unit(a2[i]).detach() for i in range(5)]
    v = [ref.unit(t2[i]).detach() for i in range(5)]

    def pairs(rows_per_sample, ta, tb):
        return torch.stack([torch.stack([torch.stack([ta[n], tb[n]]) for n in rows])
                            for rows in rows_per_sample])  # fmt: skip

    ia = [ref.retrieve(u[i], kb.audio, 3, int(ids[i]), ids_list) for i in range(5)]
    it = [ref.retrieve(v[i], kb.text, 3, int(ids[i]), ids_list) for i in range(5)]
    for rows, i in ((ia, 0), (it, 0)):
        assert all(ids_list[n] != int(ids[i]) for n in rows[i])
    knowledge = {"fine": (pairs(ia, kb.audio, kb.text), pairs(it, kb.audio, kb.text))}
    if use_coarse:
        pa, pt, m = kb.prototype_audio, kb.prototype_text, kb.num_built_prototypes
        no_ids = [-1] * m
        ca = [ref.retrieve(u[i], pa, 2, None, no_ids) for i in range(5)]
        ct = [ref.retrieve(v[i], pt, 2, None, no_ids) for i in range(5)]
        knowledge["coarse"] = (pairs(ca, pa, pt), pairs(ct, pa, pt))
    want, _ = ref.ask(a2, t2, knowledge, 0.2, 0.2, LAMBDAS, 0.1, _pot_plan(0.05, 50))
    want.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(a1.grad, a2.grad)
    torch.testing.assert_close(t1.grad, t2.grad)


def test_zero_rho_beta_lambda_fine_only_is_infonce():
    a, t, fa, ft, _, _ = _batch(7, 5, 3, 1, seed=3)
    kw = dict(injection_ratio=0.0, ot_weight=0.0, lambda_fine=0.0, temperature=0.07)
    got = ask(a, t, fa, ft, **kw)
    torch.testing.assert_close(got, info_nce(a, t, 0.07))
    # with everything switched on, it is something else
    assert not torch.allclose(ask(a, t, fa, ft), got)


def test_reduction_terms_and_modulation():
    a, t, fa, ft, ca, ct = _batch(6, 4, 3, 2, seed=4)
    per, terms = ask(a, t, fa, ft, ca, ct, reduction="none", return_terms=True)
    assert per.shape == (6,)
    torch.testing.assert_close(ask(a, t, fa, ft, ca, ct, reduction="sum"), per.sum())
    torch.testing.assert_close(ask(a, t, fa, ft, ca, ct), per.mean())
    for d in ("t2a", "a2t"):
        m = 1 + 0.2 * terms[f"potential_fine_{d}"] + 0.3 * terms[f"potential_coarse_{d}"]
        torch.testing.assert_close(terms[f"modulation_{d}"], m)
        torch.testing.assert_close(
            terms[f"loss_{d}"], terms[f"ce_fine_{d}"] + terms[f"ce_coarse_{d}"]
        )
    torch.testing.assert_close(
        per.mean(),
        0.5 * (terms["modulation_t2a"] * terms["loss_t2a"]
               + terms["modulation_a2t"] * terms["loss_a2t"]),
    )  # fmt: skip
    for g, k in (("fine", 3), ("coarse", 2)):  # entropy of a distribution over k
        assert 0 < float(terms[f"weight_entropy_{g}"]) <= math.log(k) + 1e-12
    assert all(not v.requires_grad for v in terms.values())


def test_potentials_can_be_negative_and_match_their_closed_form():
    """Partners equal to the anchor: Psi = e^1, F = -1 (any weights); orthogonal: F = 0."""
    a, t, fa, ft, _, _ = _batch(4, 3, 2, 1, seed=9)
    u, v = F.normalize(a, dim=-1), F.normalize(t, dim=-1)
    ft[:, :, 0] = u[:, None]  # audio partners of the text-retrieved pairs
    fa[:, :, 1] = v[:, None]  # captions of the audio-retrieved pairs
    _, terms = ask(a, t, fa, ft, return_terms=True)
    torch.testing.assert_close(terms["potential_fine_t2a"], torch.tensor(-1.0, dtype=DT))
    torch.testing.assert_close(terms["potential_fine_a2t"], torch.tensor(-1.0, dtype=DT))
    assert float(terms["modulation_t2a"]) < 1  # the modulation can shrink the loss
    ortho = torch.zeros(1, 2, 3, dtype=DT)
    ortho[0, :, 1] = 1.0
    log_psi, w = reliability(torch.tensor([[1.0, 0.0, 0.0]], dtype=DT), ortho, ortho)
    torch.testing.assert_close(log_psi, torch.zeros(1, dtype=DT))
    torch.testing.assert_close(w, torch.full((1, 2), 0.5, dtype=DT))


def test_reliability_and_injection_match_loops():
    a, _, fa, ft, _, _ = _batch(5, 4, 3, 1, seed=2)
    log_psi, w = reliability(a, ft[:, :, 0], fa[:, :, 0])
    for i in range(5):
        u_par = [ft[i, j, 0] for j in range(3)]
        u_ret = [fa[i, l, 0] for l in range(3)]
        torch.testing.assert_close(w[i], torch.tensor(ref.weights(u_par, u_ret), dtype=DT))
        torch.testing.assert_close(log_psi[i], ref.log_psi(a[i], u_par, u_ret))
    out = inject(a, fa[:, :, 0], 0.3)
    for i in range(5):
        torch.testing.assert_close(
            out[i], 0.7 * a[i] + 0.3 * ref.mean([fa[i, l, 0] for l in range(3)])
        )


@given(seed=st.integers(0, 10_000), b=st.integers(2, 6), k=st.integers(1, 4))
def test_properties(seed, b, k):
    a, t, fa, ft, ca, ct = _batch(b, 3, k, 2, seed=seed)
    g = torch.Generator().manual_seed(seed)
    per = ask(a, t, fa, ft, ca, ct, reduction="none")
    # permuting the batch permutes the per-sample losses
    p = torch.randperm(b, generator=g)
    torch.testing.assert_close(
        ask(a[p], t[p], fa[p], ft[p], ca[p], ct[p], reduction="none"), per[p]
    )
    # the order of the retrieved neighbours does not matter
    q = torch.randperm(k, generator=g)
    torch.testing.assert_close(ask(a, t, fa[:, q], ft[:, q], ca, ct, reduction="none"), per)
    # normalize=True: only directions count
    torch.testing.assert_close(ask(3 * a, 0.5 * t, fa, ft, ca, ct, reduction="none"), per)
    # log Psi lies between the smallest and largest partner similarity; w is a distribution
    log_psi, w = reliability(F.normalize(a, dim=-1), ft[:, :, 0], fa[:, :, 0])
    sims = torch.einsum("bd,bkd->bk", F.normalize(a, dim=-1), ft[:, :, 0])
    assert (log_psi >= sims.amin(-1) - 1e-9).all() and (log_psi <= sims.amax(-1) + 1e-9).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(b, dtype=DT))
    # rho = 1 and no potentials: the injected embeddings no longer depend on u, v
    a1 = a.clone().requires_grad_()
    loss = ask(a1, t, fa, ft, ca, ct, injection_ratio=1.0, lambda_fine=0.0, lambda_coarse=0.0)
    (grad,) = torch.autograd.grad(loss, a1, allow_unused=True)
    assert grad is None or float(grad.abs().max()) == 0.0


def test_gradcheck_with_constant_plans():
    """In the embeddings; the knowledge also sets the weights w, constants by Eq. 29, so
    its gradient is checked against the reference loops instead."""
    a, t, fa, ft, ca, ct = _batch(4, 3, 2, 2, seed=5)
    a.requires_grad_(True)
    t.requires_grad_(True)
    with torch.no_grad():
        plan = torch.stack([sinkhorn(torch.rand(4, 4, dtype=DT), 0.1, max_iter=20) for _ in "fc"])

    def fn(x, y):
        return ask(x, y, fa, ft, ca, ct, plan=plan, temperature=0.2)

    assert torch.autograd.gradcheck(fn, (a, t))
    assert torch.autograd.gradgradcheck(fn, (a, t))


def test_gradcheck_through_the_plan():
    a, t, fa, ft, ca, ct = _leaves(*_batch(4, 3, 2, 2, seed=6))

    def fn(x, y):
        return ask(x, y, fa, ft, ca, ct, detach_plan=False, epsilon=0.3, sinkhorn_iters=10,
                   temperature=0.2)  # fmt: skip

    assert torch.autograd.gradcheck(fn, (a, t))


def test_detached_plan_gradient_equals_passing_the_plans():
    a, t, fa, ft, ca, ct = _batch(5, 4, 2, 2, seed=7)
    a.requires_grad_(True)
    (g1,) = torch.autograd.grad(ask(a, t, fa, ft, ca, ct), a)
    # recompute each granularity's plan from its own injected similarities
    u, v = F.normalize(a.detach(), dim=-1), F.normalize(t, dim=-1)
    plans = torch.stack([
        sinkhorn(inject(u, ka[:, :, 0], 0.2) @ inject(v, kt[:, :, 1], 0.2).T, 0.05, max_iter=50)
        for ka, kt in ((fa, ft), (ca, ct))
    ])  # fmt: skip
    (g2,) = torch.autograd.grad(ask(a, t, fa, ft, ca, ct, plan=plans), a)
    torch.testing.assert_close(g1, g2)
    (g3,) = torch.autograd.grad(ask(a, t, fa, ft, ca, ct, plan=plans[0]), a)
    assert (g3 - g1).abs().max() > 1e-6  # one plan for both granularities is another loss
    (g4,) = torch.autograd.grad(ask(a, t, fa, ft, ca, ct, detach_plan=False), a)
    assert (g4 - g1).abs().max() > 1e-6  # the flag changes the gradient


@pytest.mark.parametrize("seed", range(5))
def test_low_temperature_float32_is_finite(seed):
    """temperature = 0.01 on unit-norm bank-like knowledge: finite loss and gradients."""
    a, t, fa, ft, ca, ct = (F.normalize(x.float(), dim=-1) for x in _batch(32, 16, 10, 10, seed))
    a, t = (3 * a).requires_grad_(), t.requires_grad_()
    loss, terms = ask(a, t, fa, ft, ca, ct, temperature=0.01, return_terms=True)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(a.grad).all() and torch.isfinite(t.grad).all()
    assert all(torch.isfinite(v) for v in terms.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [0.07, 0.01])
def test_low_precision_is_finite_and_close_to_float32(dtype, temperature):
    a, t, fa, ft, ca, ct = (F.normalize(x.float(), dim=-1) for x in _batch(16, 8, 4, 3, seed=11))
    ref32 = ask(a, t, fa, ft, ca, ct, temperature=temperature)
    low = [x.to(dtype) for x in (a, t, fa, ft, ca, ct)]
    low[0].requires_grad_(True)
    loss = ask(*low, temperature=temperature)
    assert loss.dtype == dtype and torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(low[0].grad).all() and low[0].grad.abs().sum() > 0
    torch.testing.assert_close(loss.float(), ref32, rtol=3e-2, atol=0)


def test_float16_rows_whose_squared_norm_overflows():
    a = torch.full((3, 8), 300.0, dtype=torch.float16)
    a[1, 0] = -300.0
    _, t, fa, ft, _, _ = (x.to(torch.float16) for x in _batch(3, 8, 2, 1, seed=12))
    assert torch.isfinite(ask(a, t, fa, ft))


def _bank(n=40, d=8, seed=0, backend="torch", protos=4, dup=1, gather=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    audio = torch.randn(n, d, generator=g, dtype=dtype)
    text = torch.randn(n, d, generator=g, dtype=dtype)
    ids = torch.arange(n) // dup
    bank = KnowledgeBank(d, backend=backend, num_prototypes=protos, dtype=dtype)
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

    def pairs(ta, tb, rows):
        return torch.stack([ta[rows], tb[rows]], dim=2)

    fine = pairs(kb.audio, kb.text, ia), pairs(kb.audio, kb.text, it)
    coarse = (
        pairs(kb.prototype_audio, kb.prototype_text, pa),
        pairs(kb.prototype_audio, kb.prototype_text, pt),
    )
    torch.testing.assert_close(loss, ask(a, t, *fine, *coarse))
    assert torch.isfinite(terms["potential_fine_t2a"]) and torch.isfinite(terms["modulation_a2t"])
    knowledge = loss_fn.retrieve(a, t, ids)
    assert torch.equal(knowledge["fine_audio"], fine[0])
    assert torch.equal(knowledge["fine_text"], fine[1])
    assert torch.equal(knowledge["coarse_text"], coarse[1])


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
    loss = ASKLoss(kb, k=3, k_coarse=3)(a, t, torch.arange(100, 105))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert a.grad is not None and torch.isfinite(a.grad).all() and a.grad.abs().sum() > 0


def test_k_coarse_defaults_to_ten_and_is_clamped_to_the_built_prototypes():
    kb, _ = _bank(protos=4)
    a, t, ids = torch.randn(4, 8), torch.randn(4, 8), torch.arange(4)
    loss_fn = ASKLoss(kb, k=3)
    assert loss_fn.k_coarse == 10
    with pytest.warns(UserWarning, match="k_coarse: 10 exceeds the bank's 4 prototypes"):
        got = loss_fn(a, t, ids)
    torch.testing.assert_close(got, ASKLoss(kb, k=3, k_coarse=4)(a, t, ids))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"k": 0}, ValueError, "k: must be >= 1"),
        ({"k": 2.5}, TypeError, "k: expected an int"),
        ({"k_coarse": 0}, ValueError, "k_coarse"),
        ({"injection_ratio": 1.5}, ValueError, "injection_ratio"),
        ({"injection_ratio": -0.1}, ValueError, "injection_ratio"),
        ({"injection_ratio": "0.2"}, TypeError, "injection_ratio"),
        ({"ot_weight": 1.01}, ValueError, "ot_weight"),
        ({"ot_weight": float("nan")}, ValueError, "ot_weight"),
        ({"lambda_fine": -0.2}, ValueError, "lambda_fine"),
        ({"lambda_coarse": float("inf")}, ValueError, "lambda_coarse"),
        ({"lambda_coarse": None}, TypeError, "lambda_coarse"),
        ({"epsilon": 0.0}, ValueError, "epsilon"),
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"temperature": -1.0}, ValueError, "temperature"),
        ({"sinkhorn_iters": 0}, ValueError, "sinkhorn_iters"),
        ({"sinkhorn_iters": 10.0}, TypeError, "sinkhorn_iters"),
        ({"detach_plan": "yes"}, TypeError, "detach_plan"),
        ({"normalize": 1}, TypeError, "normalize"),
        ({"use_coarse": None}, TypeError, "use_coarse"),
        ({"reduction": "max"}, ValueError, "reduction"),
        ({"gather": "auto"}, TypeError, "gather"),
    ],
)
def test_module_validates_hyperparameters_at_construction(kwargs, error, match):
    kb, _ = _bank()
    with pytest.raises(error, match=match):
        ASKLoss(kb, **kwargs)


@pytest.mark.filterwarnings("ignore:k_coarse")  # default 10 > 4 prototypes, clamped
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
    with pytest.raises(ValueError, match="prototypes"):
        ASKLoss(_bank(protos=0)[0])(a, t, ids)
    assert torch.isfinite(ASKLoss(_bank(protos=0)[0], use_coarse=False)(a, t, ids))
    with pytest.raises(ValueError, match="text"):
        ASKLoss(kb)(a, torch.randn(5, 8), ids)
    with pytest.raises(ValueError, match="audio"):
        ASKLoss(kb)(a * float("nan"), t, ids)


def test_module_reads_each_input_once(monkeypatch):
    """An ASKLoss call reads the values of audio and text (NaN/Inf, zero rows: a host
    sync each) once: the Module checks them, and ask, which it calls, does not again
    (issue 49: audio went through the checks more than once a call)."""
    from contrastive_losses import _checks

    kb, _ = _bank()
    a, t, ids = torch.randn(4, 8), torch.randn(4, 8), torch.arange(4)
    read, check_row_norms = [], _checks.check_row_norms

    def counted(x, name, *args, **kwargs):
        read.append(name)
        return check_row_norms(x, name, *args, **kwargs)

    monkeypatch.setattr(_checks, "check_row_norms", counted)
    loss = ASKLoss(kb, k=4)(a, t, ids)
    assert torch.isfinite(loss)
    assert (read.count("audio"), read.count("text")) == (1, 1), read
    read.clear()  # the functional form checks its own inputs, once
    knowledge = ASKLoss(kb, k=4).retrieve(a, t, ids)
    ask(a, t, *(knowledge[f"{g}_{m}"] for g in ("fine", "coarse") for m in ("audio", "text")))
    assert (read.count("audio"), read.count("text")) == (1, 1), read
    with pytest.raises(TypeError, match="dtype"):  # the pair's dtypes: checked by the Module
        ASKLoss(kb, k=4)(a, t.double(), ids)


def test_function_bad_input():
    a, t, fa, ft, ca, ct = _batch(4, 3, 2, 1, seed=8)
    with pytest.raises(ValueError, match="fine_audio, fine_text"):
        ask(a, t, fa, None)
    with pytest.raises(ValueError, match="coarse_audio, coarse_text"):
        ask(a, t, fa, ft, ca, None)
    with pytest.raises(ValueError, match="fine_text"):
        ask(a, t, fa, ft[..., :2])
    with pytest.raises(ValueError, match="coarse_audio"):
        ask(a, t, fa, ft, ca[:3], ct)
    with pytest.raises(ValueError, match=r"fine_audio: expected shape \(B, K, 2, D\)"):
        ask(a, t, fa[:, :, 0], ft)
    with pytest.raises(ValueError, match="pairs on dim 2"):
        ask(a, t, fa.repeat(1, 1, 2, 1), ft)
    with pytest.raises(ValueError, match="injection_ratio"):
        ask(a, t, fa, ft, injection_ratio=1.5)
    with pytest.raises(ValueError, match="ot_weight"):
        ask(a, t, fa, ft, ot_weight=-0.1)
    with pytest.raises(ValueError, match="lambda_fine"):
        ask(a, t, fa, ft, lambda_fine=-1.0)
    with pytest.raises(ValueError, match=r"lambda_fine \+ lambda_coarse: must be below 1"):
        ask(a, t, fa, ft, lambda_fine=0.6, lambda_coarse=0.4)
    with pytest.raises(ValueError, match="epsilon"):
        ask(a, t, fa, ft, epsilon=0.0)
    with pytest.raises(ValueError, match="plan"):
        ask(a, t, fa, ft, plan=torch.ones(3, 3, dtype=DT))
    with pytest.raises(ValueError, match="plan"):
        ask(a, t, fa, ft, plan=torch.ones(2, 4, 4, dtype=DT))  # two plans, one granularity
    with pytest.raises(ValueError, match="reduction"):
        ask(a, t, fa, ft, reduction="max")
    with pytest.raises(ValueError, match="audio"):
        ask(a[:1], t[:1], fa[:1], ft[:1])
    with pytest.raises(ValueError, match="fine_audio"):
        ask(a, t, fa * float("nan"), ft)
    with pytest.raises(TypeError, match="text"):
        ask(a, t.float(), fa, ft)


# ------------------------------------------------------------------ two ranks, gloo


def _ask_rank_worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    from pathlib import Path

    import torch.distributed as dist
    from helpers import init_gloo, rank_rows

    init_gloo(rank, world, init_method)
    try:
        a, t, ids = _ask_global_batch()
        rows = rank_rows(rank)
        results = {}
        for reduction in ("mean", "none"):
            # Every rank holds the whole bank (not a distributed build of rank shards).
            loss_fn = ASKLoss(_bank(gather=False)[0], k=3, k_coarse=2, reduction=reduction)
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
        loss = ASKLoss(_bank()[0], k=3, k_coarse=2, reduction=reduction)(a1, t1, ids)
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


# ------------------------------------------------------------------ temperature floor, dtypes


@pytest.mark.parametrize("temperature", [1e-45, 1e-30, 1e-5, 9.99e-5])
def test_temperature_below_the_library_floor_is_rejected(temperature):
    """1e-45 gave NaN and 1e-30 a loss of 6e29: the 1e-4 floor of the other losses."""
    a, t, fa, ft, _, _ = _batch(4, 8, 3, 1, seed=1)
    with pytest.raises(ValueError, match=r"temperature: .* below the smallest supported 0\.0001"):
        ask(a, t, fa, ft, temperature=temperature)
    kb, _ = _bank()
    with pytest.raises(ValueError, match=r"temperature: .* below the smallest supported 0\.0001"):
        ASKLoss(kb, temperature=temperature)
    assert torch.isfinite(ask(a, t, fa, ft, temperature=1e-4))


@pytest.mark.parametrize("name", ["fine_audio", "fine_text", "coarse_audio", "coarse_text"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_knowledge_in_another_dtype_than_the_queries_is_rejected(name, dtype):
    args = dict(
        zip(
            ["audio", "text", "fine_audio", "fine_text", "coarse_audio", "coarse_text"],
            _batch(4, 8, 3, 2, seed=2),
            strict=True,
        )
    )
    args[name] = args[name].to(dtype)
    with pytest.raises(
        TypeError, match=rf"^{name}: dtype {dtype} differs from audio's torch.float64"
    ):
        ask(**args)


@pytest.mark.filterwarnings("ignore:k_coarse")
@pytest.mark.parametrize("query_dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_module_casts_the_bank_rows_to_the_queries_dtype(query_dtype):
    """ASKLoss hands ask() the retrieved rows in the queries' dtype (the bank's dtype is
    a storage choice): the same loss as passing the retrieval cast by hand."""
    kb, ids = _bank(dtype=torch.float32)
    g = torch.Generator().manual_seed(6)
    a = torch.randn(5, 8, generator=g).to(query_dtype)
    t = torch.randn(5, 8, generator=g).to(query_dtype)
    loss_fn = ASKLoss(kb, k=3, k_coarse=2)
    knowledge = loss_fn.retrieve(a, t, ids[:5])
    assert all(v.dtype == query_dtype for v in knowledge.values() if v is not None)
    loss = loss_fn(a, t, ids[:5])
    assert loss.dtype == query_dtype and torch.isfinite(loss)
    torch.testing.assert_close(loss, ask(a, t, **knowledge))
