"""SupportVectorRegularizer, RadiusPredictor and functional.support_vector_term against the
SupCLAP loop references, gradcheck, the App. D gradient property, bad inputs, and a
two-process gather run."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import pytest
import reference as ref
import reference_svr as ref_svr
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import (
    F64,
    RANK_SIZES,
    assert_ddp_average_matches,
    init_gloo,
    randn,
    random_mask,
    rank_data,
    rank_rows,
    spawn_ranks,
)
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

from contrastive_losses import (
    CACLLoss,
    InfoNCELoss,
    KCLLoss,
    RadiusPredictor,
    SigLIPLoss,
    SupportVectorRegularizer,
    sample_languages,
)
from contrastive_losses import functional as CF


def randomise(module: nn.Module, seed: int = 0, std: float = 0.3) -> nn.Module:
    """Random weights everywhere (the predictor's last layer starts at zero weight, which
    would make it a constant and every invariance test vacuous)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std + 0.2)
    return module


# ------------------------------------------------------------------ functional vs reference


@pytest.mark.parametrize("temperature", [0.07, 0.5])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_support_vector_term_matches_reference(gen, temperature, per_row, masked):
    t, a = randn(gen, 6, 5), randn(gen, 6, 5)
    radius = torch.rand(6, generator=gen, dtype=F64) if per_row else 0.4
    radii = list(radius) if per_row else [radius] * 6
    mask = torch.tensor([True, False, True, True, False, True]) if masked else None
    out = CF.support_vector_term(t, a, radius, temperature, mask=mask)
    expected = ref_svr.support_vector_term(
        t, a, radii, temperature, None if mask is None else mask.tolist()
    )
    torch.testing.assert_close(out, expected)


def test_support_vector_term_reductions(gen):
    t, a = randn(gen, 5, 4), randn(gen, 5, 4)
    mask = torch.tensor([True, True, False, True, True])
    per_row = CF.support_vector_term(t, a, 0.3, mask=mask, reduction="none")
    assert per_row.shape == (5,) and per_row[2] == 0
    torch.testing.assert_close(CF.support_vector_term(t, a, 0.3, mask=mask), per_row.sum() / 4)
    torch.testing.assert_close(
        CF.support_vector_term(t, a, 0.3, mask=mask, reduction="sum"), per_row.sum()
    )


def test_zero_radius_is_the_info_nce_row_loss_and_gradient(gen):
    """R = 0: the support vector is the anchor, the term is text->audio InfoNCE."""
    t1, a1 = randn(gen, 7, 6).requires_grad_(), randn(gen, 7, 6).requires_grad_()
    t2, a2 = t1.detach().clone().requires_grad_(), a1.detach().clone().requires_grad_()
    svr = CF.support_vector_term(t1, a1, 0.0, 0.2)
    _, terms = CF.info_nce(a2, t2, 0.2, return_terms=True)
    plain = F.cross_entropy(F.normalize(t2) @ F.normalize(a2).T / 0.2, torch.arange(7))
    torch.testing.assert_close(svr, plain)
    torch.testing.assert_close(svr, terms["loss_t2a"])
    svr.backward()
    plain.backward()
    torch.testing.assert_close(t1.grad, t2.grad)
    torch.testing.assert_close(a1.grad, a2.grad)


def test_positive_equal_to_anchor_is_finite(gen):
    """||a_pos - t|| = 0: no direction; the row falls back to InfoNCE, no NaN/Inf."""
    x = randn(gen, 4, 3).requires_grad_()
    y = x.detach().clone()
    y[1:] = randn(gen, 3, 3)  # row 0 coincides, the others do not
    y.requires_grad_()
    loss = CF.support_vector_term(x, y, 0.5, 0.1, reduction="none")
    plain = F.cross_entropy(
        F.normalize(x) @ F.normalize(y).T / 0.1, torch.arange(4), reduction="none"
    )
    torch.testing.assert_close(loss[0], plain[0])
    assert not torch.isclose(loss[1], plain[1])
    loss.sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(y.grad).all()
    svr = SupportVectorRegularizer(InfoNCELoss(0.1), radius="dynamic").double()
    same = randn(gen, 4, 3).requires_grad_()
    svr(same, same).backward()
    assert torch.isfinite(same.grad).all()


# ------------------------------------------------------------------ the App. D property


def _unit(gen, b, d):
    return F.normalize(randn(gen, b, d), dim=-1)


@given(
    st.integers(2, 6),
    st.integers(2, 7),
    st.integers(0, 2**31 - 1),
    st.floats(0.0, 1.5),
    st.floats(0.05, 2.0),
)
def test_gradient_keeps_parallel_and_scales_perpendicular(b, d, seed, radius, temperature):
    """SupCLAP Eq. 16: with R fixed, d L_svr / d t_i is the sum over candidates j of the
    plain force P_ij a_j / tau (P at the support vector; minus a_i for the positive), with
    the component along u_i = (a_i - t_i)/||a_i - t_i|| kept and the perpendicular one
    scaled by 1 - R/||a_i - t_i||."""
    g = torch.Generator().manual_seed(seed)
    t, a = _unit(g, b, d).requires_grad_(), _unit(g, b, d)
    CF.support_vector_term(t, a, radius, temperature, normalize=False, reduction="sum").backward()
    expected = torch.zeros(b, d, dtype=F64)
    for i in range(b):
        u = a[i] - t[i].detach()
        dist = float(u.norm())
        u_hat = u / dist
        t_sup = t[i].detach() + radius * u_hat
        prob = torch.softmax(a @ t_sup / temperature, dim=0)
        for j in range(b):
            force = (prob[j] - (1.0 if j == i else 0.0)) * a[j] / temperature
            parallel = (force @ u_hat) * u_hat
            expected[i] += parallel + (1 - radius / dist) * (force - parallel)
    torch.testing.assert_close(t.grad, expected)


# ------------------------------------------------------------------ gradcheck (float64)


def test_gradcheck_support_vector_term(gen):
    t, a = randn(gen, 4, 3).requires_grad_(), randn(gen, 4, 3).requires_grad_()
    fixed = lambda x, y: CF.support_vector_term(x, y, 0.3, 0.5)  # noqa: E731
    assert torch.autograd.gradcheck(fixed, (t, a))
    radius = torch.tensor([0.1, 0.5, 0.2, 0.8], dtype=F64, requires_grad=True)
    tau = torch.tensor(0.4, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(CF.support_vector_term, (t, a, radius, tau))
    mask = torch.tensor([True, False, True, True])
    masked = lambda x, y, r: CF.support_vector_term(x, y, r, 0.5, mask=mask)  # noqa: E731
    assert torch.autograd.gradcheck(masked, (t, a, radius))


def _gradcheck_module(svr: nn.Module, inputs: tuple[torch.Tensor, ...], wrt_inputs: bool) -> bool:
    """gradcheck over the regulariser's own parameters (and the embeddings if
    ``wrt_inputs``). The base's temperature is left out: the SVR term reads it detached
    (tested in test_base_temperature_learns_from_the_base_only), so the numerical
    derivative sees a dependence that the analytical one drops on purpose."""
    own = [(n, p) for n, p in svr.named_parameters() if not n.startswith("base.")]
    names = [n for n, _ in own]
    params = tuple(p.detach().clone().requires_grad_() for _, p in own)
    emb = tuple(
        x.detach().clone().requires_grad_(wrt_inputs and x.is_floating_point()) for x in inputs
    )

    def fn(*flat):
        x, p = flat[: len(emb)], flat[len(emb) :]
        return functional_call(svr, dict(zip(names, p, strict=True)), x)

    return torch.autograd.gradcheck(fn, emb + params)


@pytest.mark.parametrize("direction", ["bi", "uni"])
def test_gradcheck_static_and_fixed(gen, direction):
    a, t = randn(gen, 4, 3), randn(gen, 4, 2, 3)
    mask = torch.tensor([[True, True], [True, False], [True, True], [True, True]])
    for radius in ("static", 0.3):
        svr = SupportVectorRegularizer(
            KCLLoss(0.5, learnable_temperature=True),
            radius=radius,
            direction=direction,
            constraint=True,
        ).double()
        assert _gradcheck_module(svr, (a, t, mask), wrt_inputs=True)


@pytest.mark.parametrize("base", ["info_nce", "cacl"])
def test_gradcheck_dynamic(gen, base):
    """Dynamic: the predictor reads a detached similarity row, so the embeddings'
    gradient is the fixed-R one at the predicted R (checked below); gradcheck covers the
    predictor's parameters and the base's temperature."""
    a, e, o = randn(gen, 4, 3), randn(gen, 4, 3), randn(gen, 4, 3)
    loss = InfoNCELoss(0.5, learnable_temperature=True) if base == "info_nce" else CACLLoss(0.5)
    svr = randomise(SupportVectorRegularizer(loss, radius="dynamic", num_features=3, hidden=4))
    svr = svr.double()
    inputs = (a, e) if base == "info_nce" else (a, e, o)
    assert _gradcheck_module(svr, inputs, wrt_inputs=False)


def test_dynamic_embedding_gradient_is_the_fixed_radius_gradient(gen):
    a1, t1 = randn(gen, 5, 4).requires_grad_(), randn(gen, 5, 4).requires_grad_()
    svr = randomise(SupportVectorRegularizer(InfoNCELoss(0.3), radius="dynamic", num_features=4))
    svr = svr.double()
    svr(a1, t1).backward()
    a2, t2 = a1.detach().clone().requires_grad_(), t1.detach().clone().requires_grad_()
    with torch.no_grad():  # the predictor reads s = cos / tau
        an, tn = F.normalize(a2), F.normalize(t2)
        r_t = svr.predictor(tn @ an.T / 0.3)
        r_a = svr.predictor(an @ tn.T / 0.3)
    svr_terms = (
        CF.support_vector_term(t2, a2, r_t, 0.3) + CF.support_vector_term(a2, t2, r_a, 0.3)
    ) / 2
    con = ((r_t - (an - tn).norm(dim=-1)).relu() + (-r_t).relu()).mean()  # constant here
    (CF.info_nce(a2, t2, 0.3) + svr_terms + 0.01 * con).backward()
    torch.testing.assert_close(a1.grad, a2.grad)
    torch.testing.assert_close(t1.grad, t2.grad)


# ------------------------------------------------------------------ Module vs reference


def _radius_of(svr: SupportVectorRegularizer):
    if svr.predictor is None:
        return lambda d, p, i, sims, pos: svr.radius
    n_feat = svr.predictor.num_features

    def predict(d, p, i, sims, pos):
        feats = torch.tensor(ref_svr.radius_features(sims, pos, n_feat), dtype=F64)
        return svr.predictor.mlp(feats)[0]

    return predict


def _base_and_pairs(name, gen):
    """A base loss, its forward args, its reference value and its pairs as loops see them."""
    b = 6
    a, t = randn(gen, b, 5), randn(gen, b, 3, 5)
    if name == "info_nce":
        base = InfoNCELoss(0.2)
        return base, (a, t[:, 0]), ref.info_nce(a, t[:, 0], 0.2), [(a, t[:, 0], None)], 0.2
    if name == "siglip":
        base = SigLIPLoss(4.0, -2.0)
        value = ref.siglip(a, t[:, 0], 4.0, -2.0)
        return base, (a, t[:, 0]), value, [(a, t[:, 0], None)], 1 / 4.0
    if name == "kcl":
        mask = random_mask(gen, b, 3)
        pairs = [(a, t[:, k], mask[:, k].tolist()) for k in range(3)]
        return KCLLoss(0.2), (a, t, mask), ref.kcl(a, t, 0.2, mask.tolist()), pairs, 0.2
    idx = torch.tensor([1, 2, 2, 1, 1, 2])
    o = t[torch.arange(b), idx]
    pairs = [(a, t[:, 0], None), (a, o, None), (t[:, 0], o, None)]
    return CACLLoss(0.2), (a, t, idx), ref.cacl(a, t[:, 0], o, 0.2), pairs, 0.2


@pytest.mark.parametrize("base_name", ["info_nce", "siglip", "kcl", "cacl"])
@pytest.mark.parametrize("radius", ["static", "dynamic", 0.25])
@pytest.mark.parametrize("direction", ["bi", "uni"])
def test_module_matches_reference(gen, base_name, radius, direction):
    base, args, base_value, pairs, tau = _base_and_pairs(base_name, gen)
    svr = SupportVectorRegularizer(
        base,
        radius=radius,
        direction=direction,
        alpha=0.7,
        beta=0.3,
        constraint=True,
        radius_init=0.4,
        num_features=4,
    )
    if svr.predictor is not None:
        randomise(svr.predictor, std=0.2)
    svr = svr.double()
    if radius == "static":
        with torch.no_grad():
            svr.radius.fill_(0.3)
    loss, terms = svr(*args, return_terms=True)
    with torch.no_grad():
        svr_ref, con_ref = ref_svr.regularizer(pairs, _radius_of(svr), tau, direction)
    torch.testing.assert_close(terms["base"], base_value.detach())
    torch.testing.assert_close(terms["svr"], svr_ref.detach())
    torch.testing.assert_close(terms["constraint"], con_ref.detach())
    torch.testing.assert_close(loss, base_value + 0.7 * svr_ref + 0.3 * con_ref)


def test_constraint_defaults_and_weights(gen):
    a, t = randn(gen, 6, 4), randn(gen, 6, 4)
    dynamic = SupportVectorRegularizer(InfoNCELoss(), radius="dynamic")
    static = SupportVectorRegularizer(InfoNCELoss(), radius="static", radius_init=3.0)
    assert dynamic.constraint and not static.constraint
    assert (dynamic.alpha, dynamic.beta) == (1.0, 1.0)  # beta: tests/test_svr_defaults.py
    for svr in (dynamic, static):
        loss, terms = svr.double()(a, t, return_terms=True)
        on = terms["base"] + svr.alpha * terms["svr"]
        if svr.constraint:
            on = on + svr.beta * terms["constraint"]
        torch.testing.assert_close(loss, on)
    # R = 3 exceeds every ||a - t|| <= 2: the constraint is R - ||a - t|| on average
    _, terms = static(a, t, return_terms=True)
    dist = (F.normalize(a) - F.normalize(t)).norm(dim=-1)
    torch.testing.assert_close(terms["constraint"], (3.0 - dist).mean())
    assert terms["radius_over_distance"] == 1


def test_uni_and_bi_weigh_each_direction_as_the_paper(gen):
    """SupCLAP Eq. 5-6: L_t2a + L_a2t + alpha (sum of the SVR terms used). The base here
    is the mean of its directions, so the whole objective is the paper's halved: each SVR
    direction (and its constraint) weighs alpha/2, for uni as for bi."""
    a, t = randn(gen, 6, 4), randn(gen, 6, 4)
    alpha, beta = 0.7, 0.3
    base = InfoNCELoss(0.2)
    kwargs = {"radius": 2.5, "alpha": alpha, "beta": beta, "constraint": True}
    bi = SupportVectorRegularizer(base, **kwargs).double()
    uni = SupportVectorRegularizer(base, direction="uni", **kwargs).double()
    t2a = CF.support_vector_term(t, a, 2.5, 0.2)
    a2t = CF.support_vector_term(a, t, 2.5, 0.2)
    con = (2.5 - (F.normalize(a) - F.normalize(t)).norm(dim=-1)).relu().mean()  # R > ||a - t||
    assert con > 0
    _, base_terms = base(a, t, return_terms=True)
    paper_bi = base_terms["loss_t2a"] + base_terms["loss_a2t"] + alpha * (t2a + a2t)
    paper_uni = base_terms["loss_t2a"] + base_terms["loss_a2t"] + alpha * t2a
    torch.testing.assert_close(bi(a, t), (paper_bi + beta * 2 * con) / 2)
    torch.testing.assert_close(uni(a, t), (paper_uni + beta * con) / 2)
    torch.testing.assert_close(uni(a, t, return_terms=True)[1]["svr"], t2a / 2)
    torch.testing.assert_close(bi(a, t, return_terms=True)[1]["svr"], (t2a + a2t) / 2)


def test_kcl_absent_captions_get_no_svr_gradient(gen):
    a, t = randn(gen, 5, 4).requires_grad_(), randn(gen, 5, 3, 4).requires_grad_()
    mask = torch.ones(5, 3, dtype=torch.bool)
    mask[1, 2] = mask[3, 1] = False
    svr = SupportVectorRegularizer(KCLLoss(0.2), radius="dynamic").double()
    _, terms = svr(a, t, mask, return_terms=True)
    terms_svr = svr._regularise(KCLLoss().contrastive_pairs(a, t, mask))[0]
    terms_svr.backward()
    assert torch.isfinite(t.grad).all() and torch.isfinite(a.grad).all()
    assert t.grad[1, 2].abs().max() == 0 and t.grad[3, 1].abs().max() == 0
    assert t.grad[1, 1].abs().max() > 0
    torch.testing.assert_close(terms["svr"], terms_svr.detach())


def test_cacl_base_and_pairs_use_one_language_draw(gen):
    """Without an explicit ``other`` CACL draws a language; the base loss and the SVR
    pairs must see the same draw (a second draw would give a different triplet)."""
    a, t = randn(gen, 8, 4), randn(gen, 8, 5, 4)
    svr = SupportVectorRegularizer(CACLLoss(0.2), radius=0.3).double()
    rows = torch.arange(8)

    def expected(idx):
        o = t[rows, idx]
        svr_ref, _ = ref_svr.regularizer(
            [(a, t[:, 0], None), (a, o, None), (t[:, 0], o, None)],
            lambda *_: 0.3,
            0.2,
            "bi",
        )
        return CF.cacl(a, t[:, 0], o, 0.2) + svr_ref

    out = svr(a, t, generator=torch.Generator().manual_seed(5))
    idx = sample_languages(5, batch_size=8, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(out, expected(idx))
    torch.manual_seed(11)  # the global RNG too
    out = svr(a, t)
    torch.manual_seed(11)
    torch.testing.assert_close(out, expected(sample_languages(5, batch_size=8)))


def test_temperature_follows_base_unless_given(gen):
    a, t = randn(gen, 6, 4), randn(gen, 6, 4)
    base = InfoNCELoss(0.1, learnable_temperature=True).double()
    svr = SupportVectorRegularizer(base, radius=0.2, direction="uni")
    with torch.no_grad():
        base.log_logit_scale.fill_(torch.log(torch.tensor(1 / 0.3)).item())
    expected = CF.support_vector_term(t, a, 0.2, 0.3) / 2  # uni: half the t2a term
    torch.testing.assert_close(svr(a, t, return_terms=True)[1]["svr"], expected)
    fixed = SupportVectorRegularizer(base, radius=0.2, direction="uni", temperature=0.05)
    got = fixed(a, t, return_terms=True)[1]["svr"]
    torch.testing.assert_close(got, CF.support_vector_term(t, a, 0.2, 0.05) / 2)
    siglip = SupportVectorRegularizer(SigLIPLoss(8.0), radius=0.2, direction="uni").double()
    got = siglip(a, t, return_terms=True)[1]["svr"]
    torch.testing.assert_close(got, CF.support_vector_term(t, a, 0.2, 1 / 8.0) / 2)


@pytest.mark.parametrize("radius", ["dynamic", "static", 0.3])
@pytest.mark.parametrize("base_name", ["info_nce", "siglip"])
def test_base_temperature_learns_from_the_base_only(gen, radius, base_name):
    """The SVR term reads the base's temperature (SigLIP: 1/scale) detached: a learnable
    temperature, scale or bias gets exactly the base loss's gradient, while the
    embeddings and the radius get the SVR's gradient too."""
    a, t = randn(gen, 6, 4).requires_grad_(), randn(gen, 6, 4)
    if base_name == "info_nce":
        base = InfoNCELoss(0.1, learnable_temperature=True).double()
    else:
        base = SigLIPLoss(5.0, -1.0).double()
    svr = SupportVectorRegularizer(base, radius=radius).double()
    svr(a, t).backward()
    with_svr = {n: p.grad.clone() for n, p in base.named_parameters()}
    a_grad = a.grad.clone()
    base.zero_grad()
    a.grad = None
    base(a, t).backward()
    assert with_svr and set(with_svr) == {n for n, _ in base.named_parameters()}
    for name, p in base.named_parameters():
        assert p.grad.abs() > 0, name  # the check below compares real gradients
        torch.testing.assert_close(with_svr[name], p.grad, rtol=0, atol=0)
    assert not torch.allclose(a_grad, a.grad)  # the SVR term does act on the embeddings


def test_return_terms_are_detached_and_describe_the_radius(gen):
    a, t = randn(gen, 6, 4).requires_grad_(), randn(gen, 6, 3, 4)
    svr = randomise(SupportVectorRegularizer(KCLLoss(), radius="dynamic")).double()
    an, tn = F.normalize(a.detach(), dim=-1), F.normalize(t, dim=-1)
    dist = (an[:, None] - tn).norm(dim=-1).T.reshape(-1)  # (K*B,) language-major

    def predicted():
        return torch.cat(
            [svr.predictor(tn[:, k] @ an.T / 0.07) for k in range(3)]
            + [svr.predictor(an @ tn[:, k].T / 0.07) for k in range(3)]
        ).detach()

    with torch.no_grad():  # centre the radii on the distances so both sides occur
        # (off the median by 1e-7: a radius equal to its distance would compare on the
        # last bit of two norms computed differently)
        svr.predictor.mlp[-1].bias -= predicted().median() - dist.median() - 1e-7
    radii = predicted()
    loss, terms = svr(a, t, return_terms=True)
    assert loss.requires_grad and not any(v.requires_grad for v in terms.values())
    assert {"loss_a2t", "loss_t2a", "temperature", "base", "svr", "constraint"} <= set(terms)
    torch.testing.assert_close(terms["radius_mean"], radii.mean())
    torch.testing.assert_close(terms["radius_std"], radii.std(unbiased=False))
    torch.testing.assert_close(terms["radius_min"], radii.min())
    torch.testing.assert_close(terms["radius_max"], radii.max())
    assert terms["radius_std"] > 0
    over = (radii > torch.cat([dist, dist])).to(F64).mean()
    torch.testing.assert_close(terms["radius_over_distance"], over)
    assert 0 < over < 1  # the check above sees both cases
    torch.testing.assert_close(svr(a, t), loss)  # return_terms does not change the loss


# ------------------------------------------------------------------ the radius' gradient


def test_radius_derivative_matches_the_closed_form(gen):
    """d(row i)/dR_i = -(1/(tau d_i)) sum_{j != i} P_ij <a_i - t_i, a_i - a_j> (P at the
    support vector): the loop reference of tau dL/dR against autograd, per anchor."""
    t, a = randn(gen, 7, 5), randn(gen, 7, 5)
    radius = torch.tensor([0.0, 0.2, 0.5, 0.9, 1.3, 0.1, 2.0], dtype=F64, requires_grad=True)
    rows = CF.support_vector_term(t, a, radius, 0.3, reduction="none")
    (grad,) = torch.autograd.grad(rows.sum(), radius)  # row i depends on R_i only
    for i in range(7):
        slope = ref_svr.radius_slope(t, a, i, radius[i].item(), 0.3)
        torch.testing.assert_close(0.3 * grad[i], slope)
        tn, an = F.normalize(t, dim=-1), F.normalize(a, dim=-1)
        d = (an[i] - tn[i]).norm()
        t_sup = tn[i] + radius[i] * (an[i] - tn[i]) / d
        probs = torch.softmax(an @ t_sup / 0.3, dim=0)
        closed = -sum(
            probs[j] * ((an[i] - tn[i]) @ (an[i] - an[j])) for j in range(7) if j != i
        ) / (0.3 * d)
        torch.testing.assert_close(grad[i], closed)


@given(st.integers(2, 8), st.integers(2, 6), st.integers(0, 2**31 - 1))
def test_svr_term_is_convex_in_the_radius(b, d, seed):
    g = torch.Generator().manual_seed(seed)
    t, a = torch.randn(b, d, generator=g, dtype=F64), torch.randn(b, d, generator=g, dtype=F64)
    radii = torch.linspace(-1.0, 3.0, 9, dtype=F64)
    values = torch.stack([CF.support_vector_term(t, a, float(r), 0.2) for r in radii])
    second = values[:-2] - 2 * values[1:-1] + values[2:]  # second differences
    assert (second >= -1e-9).all()


@pytest.mark.parametrize("direction", ["bi", "uni"])
@pytest.mark.parametrize("base_name", ["info_nce", "kcl"])
def test_radius_slope_term_is_the_autograd_derivative(gen, direction, base_name):
    """terms["svr_radius_slope"], the mean over anchors of sum_j P_j <u_hat, a_j - a+>,
    is tau dL_svr/dR (per direction; the SVR term halves uni) for a shared radius."""
    a, t = randn(gen, 6, 4), randn(gen, 6, 3, 4)
    mask = random_mask(gen, 6, 3)
    base = InfoNCELoss(0.2) if base_name == "info_nce" else KCLLoss(0.2)
    args = (a, t[:, 0]) if base_name == "info_nce" else (a, t, mask)
    for radius in (0.0, 0.4, 1.5):
        svr = SupportVectorRegularizer(base, radius="static", direction=direction)
        svr = svr.double()
        with torch.no_grad():
            svr.radius.fill_(radius)
        loss, terms = svr(*args, return_terms=True)  # no constraint: the SVR term alone
        (grad,) = torch.autograd.grad(loss, svr.radius)
        share = 1.0 if direction == "bi" else 0.5
        torch.testing.assert_close(terms["svr_radius_slope"] * share, 0.2 * grad)


def test_radius_slope_sign_follows_the_margins(gen):
    """The slope is positive (R is pushed down) when the text separates its clip from a
    hard negative better than the audio does, negative in the opposite case."""
    e = torch.eye(3, dtype=F64)
    a = torch.stack([e[0], F.normalize(e[0] + 0.4 * e[1], dim=0)])  # audio: close clips
    t_good = torch.stack([F.normalize(e[0] - 0.5 * e[1], dim=0), e[1]])  # far from a_1
    t_bad = torch.stack([F.normalize(e[0] + 0.6 * e[1], dim=0), e[1]])  # closer to a_1
    svr = SupportVectorRegularizer(InfoNCELoss(0.1), radius=0.1, direction="uni")
    good = svr(a, t_good, return_terms=True)[1]["svr_radius_slope"]
    bad = svr(a, t_bad, return_terms=True)[1]["svr_radius_slope"]
    assert good > 0 > bad


# ------------------------------------------------------------------ parameters and state


@pytest.mark.parametrize("radius", ["static", "dynamic"])
def test_parameters_train_and_state_dict_round_trips(gen, radius):
    a, t = randn(gen, 8, 4).float(), randn(gen, 8, 4).float()
    svr = SupportVectorRegularizer(InfoNCELoss(), radius=radius)
    params = dict(svr.named_parameters())
    assert set(params) == (
        {"radius"}
        if radius == "static"
        else {f"predictor.mlp.{i}.{w}" for i in (0, 2, 4) for w in ("weight", "bias")}
    )
    before = {k: v.detach().clone() for k, v in params.items()}
    opt = torch.optim.SGD(svr.parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        svr(a, t).backward()
        opt.step()
    assert any(not torch.equal(before[k], v) for k, v in svr.named_parameters())
    buffer = io.BytesIO()
    torch.save(svr.state_dict(), buffer)
    buffer.seek(0)
    fresh = SupportVectorRegularizer(InfoNCELoss(), radius=radius)
    fresh.load_state_dict(torch.load(buffer))
    torch.testing.assert_close(fresh(a, t), svr(a, t))


def test_fixed_radius_is_a_buffer_not_a_parameter():
    svr = SupportVectorRegularizer(InfoNCELoss(), radius=0.2)
    assert list(svr.parameters()) == [] and float(svr.state_dict()["radius"]) == pytest.approx(0.2)


# ------------------------------------------------------------------ RadiusPredictor


def test_predictor_starts_at_radius_init():
    predictor = RadiusPredictor(num_features=6, radius_init=0.25)
    out = predictor(torch.rand(9, 9) * 2 - 1)
    torch.testing.assert_close(out, torch.full((9,), 0.25))


@given(st.integers(2, 40), st.integers(2, 12), st.integers(0, 2**31 - 1))
def test_predictor_features_match_reference(n, num_features, seed):
    g = torch.Generator().manual_seed(seed)
    b = max(1, n // 2)
    offset = n - b
    sims = torch.rand(b, n, generator=g, dtype=F64) * 2 - 1
    feats = RadiusPredictor(num_features).features(sims, offset)
    for r in range(b):
        row = sims[r].tolist()
        expected = ref_svr.radius_features(row, offset + r, num_features)
        torch.testing.assert_close(feats[r], torch.tensor(expected, dtype=F64))


@given(st.integers(2, 40), st.integers(0, 2**31 - 1))
def test_predictor_any_batch_size_and_permutation_invariant(n, seed):
    """Any N >= 2 gives one finite radius per anchor; permuting the negatives of a row
    (every column but the positive) leaves its radius unchanged."""
    g = torch.Generator().manual_seed(seed)
    predictor = randomise(RadiusPredictor(num_features=8, hidden=16), seed=seed % 1000).double()
    sims = torch.rand(n, n, generator=g, dtype=F64) * 2 - 1
    out = predictor(sims)
    assert out.shape == (n,) and torch.isfinite(out).all()
    assert n < 3 or out.unique().numel() > 1  # random weights: radii differ between rows
    perm = torch.randperm(n, generator=g)
    permuted = sims[:, perm]  # the positive of row r moves to column where perm == r
    moved = torch.argsort(perm)
    # Put each row's positive back on the diagonal by swapping two columns in that row.
    fixed = permuted.clone()
    for r in range(n):
        c = int(moved[r])
        fixed[r, [r, c]] = permuted[r, [c, r]]
    torch.testing.assert_close(predictor(fixed), out)


def test_predictor_masked_candidates_are_ignored(gen):
    """An absent candidate is neither a negative nor the row minimum."""
    predictor = randomise(RadiusPredictor(num_features=5)).double()
    sims = torch.rand(4, 6, generator=gen, dtype=F64)
    sims[:, 2] = -5.0  # absent column: were it used, it would be the top of the padding
    mask = torch.tensor([True, True, False, True, True, True])
    keep = [0, 1, 3, 4, 5]
    feats = predictor.features(sims, 0, mask)
    out = predictor(sims, 0, mask)
    for r in (0, 1, 3):  # present rows; the positive of row r is column r
        row = sims[r, keep].tolist()
        expected = torch.tensor(ref_svr.radius_features(row, keep.index(r), 5), dtype=F64)
        torch.testing.assert_close(feats[r], expected)
        torch.testing.assert_close(out[r], predictor.mlp(expected)[0])


@pytest.mark.parametrize("direction", ["bi", "uni"])
def test_kcl_zero_padded_captions_equal_random_padding(gen, direction):
    """Absent captions padded with zeros (the usual padding; KCL accepts it) give the same
    SVR(KCL) loss and gradients as any other padding: the absent rows are never used."""
    audio, text = randn(gen, 6, 8), randn(gen, 6, 3, 8)
    mask = random_mask(gen, 6, 3, p=0.5)
    assert not mask.all()
    loss_fn = randomise(
        SupportVectorRegularizer(KCLLoss(0.1), radius="dynamic", direction=direction)
    ).double()
    results = []
    for pad in ("zeros", "random"):
        a = audio.clone().requires_grad_()
        padded = text.masked_fill(~mask[..., None], 0.0) if pad == "zeros" else text
        t = padded.clone().requires_grad_()
        loss_fn.zero_grad()
        loss = loss_fn(a, t, mask)
        loss.backward()
        params = [p.grad.clone() for p in loss_fn.parameters() if p.grad is not None]
        results.append((loss.detach(), a.grad, t.grad, params))
    (l0, a0, t0, p0), (l1, a1, t1, p1) = results
    torch.testing.assert_close(l0, l1, rtol=1e-12, atol=0)
    torch.testing.assert_close(a0, a1, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(t0, t1, rtol=1e-10, atol=1e-14)
    assert len(p0) == len(p1) > 0
    for g0, g1 in zip(p0, p1, strict=True):
        torch.testing.assert_close(g0, g1, rtol=1e-10, atol=1e-14)
    assert not t0[~mask].any()  # absent captions get no gradient


# ------------------------------------------------------------------ bad inputs


class _NotALoss(nn.Module):
    def forward(self, a, t):
        return (a - t).pow(2).mean()


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: SupportVectorRegularizer(InfoNCELoss(), radius="adaptive"), ValueError, "radius"),
        (lambda: SupportVectorRegularizer(InfoNCELoss(), radius=-0.1), ValueError, "radius"),
        (
            lambda: SupportVectorRegularizer(InfoNCELoss(), radius=float("nan")),
            ValueError,
            "radius",
        ),
        (lambda: SupportVectorRegularizer(InfoNCELoss(), radius=True), TypeError, "radius"),
        (
            lambda: SupportVectorRegularizer(InfoNCELoss(), direction="both"),
            ValueError,
            "direction",
        ),
        (lambda: SupportVectorRegularizer(InfoNCELoss(), alpha=-1.0), ValueError, "alpha"),
        (lambda: SupportVectorRegularizer(InfoNCELoss(), beta=-0.01), ValueError, "beta"),
        (lambda: SupportVectorRegularizer(InfoNCELoss(), beta=float("nan")), ValueError, "beta"),
        (lambda: SupportVectorRegularizer(InfoNCELoss(), alpha="1"), TypeError, "alpha"),
        (lambda: SupportVectorRegularizer(_NotALoss()), TypeError, "base: expected a loss Module"),
        (lambda: SupportVectorRegularizer(nn.Linear(2, 2)), TypeError, "base"),
        (lambda: SupportVectorRegularizer(CF.info_nce), TypeError, "base"),
        (
            lambda: SupportVectorRegularizer(InfoNCELoss(reduction="none")),
            ValueError,
            "base: .*reduction='mean'",
        ),
        (lambda: SupportVectorRegularizer(InfoNCELoss(), constraint=1), TypeError, "constraint"),
        (
            lambda: SupportVectorRegularizer(InfoNCELoss(), num_features=1),
            ValueError,
            "num_features",
        ),
        (
            lambda: SupportVectorRegularizer(InfoNCELoss(), num_features=2.5),
            TypeError,
            "num_features",
        ),
        (
            lambda: SupportVectorRegularizer(InfoNCELoss(), temperature=0.0),
            ValueError,
            "temperature",
        ),
        (
            lambda: SupportVectorRegularizer(InfoNCELoss(), radius_init=-1.0),
            ValueError,
            "radius_init",
        ),
        (lambda: SupportVectorRegularizer(InfoNCELoss(), radius=1e4 * 1.01), ValueError, "radius"),
        (lambda: SupportVectorRegularizer(InfoNCELoss(), alpha=1e4 * 1.01), ValueError, "alpha"),
        (lambda: SupportVectorRegularizer(InfoNCELoss(), beta=1e4 * 1.01), ValueError, "beta"),
        (
            lambda: SupportVectorRegularizer(InfoNCELoss(), temperature=0.5e-4),
            ValueError,
            "temperature: .* below the smallest",
        ),
        (lambda: RadiusPredictor(num_features=1), ValueError, "num_features"),
        (lambda: RadiusPredictor(hidden=0), ValueError, "hidden"),
    ],
)
def test_bad_construction_names_the_argument(make, error, match):
    with pytest.raises(error, match=match):
        make()


def _good(gen):
    return randn(gen, 4, 3), randn(gen, 4, 3)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda t, a: CF.support_vector_term(t, a, torch.ones(3)), ValueError, r"radius: .*\(4,\)"),
        (lambda t, a: CF.support_vector_term(t, a, torch.ones(4, 1)), ValueError, "radius"),
        (
            lambda t, a: CF.support_vector_term(t, a, torch.tensor(float("nan"))),
            ValueError,
            "radius",
        ),
        (lambda t, a: CF.support_vector_term(t, a, float("inf")), ValueError, "radius"),
        (lambda t, a: CF.support_vector_term(t, a, "0.1"), TypeError, "radius"),
        (lambda t, a: CF.support_vector_term(t, a, torch.ones(4).long()), TypeError, "radius"),
        (lambda t, a: CF.support_vector_term(t, a[:3], 0.1), ValueError, "candidates: batch size"),
        (lambda t, a: CF.support_vector_term(t[0], a, 0.1), ValueError, "anchor: expected shape"),
        (lambda t, a: CF.support_vector_term(t, a, 0.1, 0.0), ValueError, "temperature"),
        (lambda t, a: CF.support_vector_term(t, a, 0.1, reduction="avg"), ValueError, "reduction"),
        (
            lambda t, a: CF.support_vector_term(t, a, 0.1, mask=torch.ones(3).bool()),
            ValueError,
            "mask",
        ),
        (lambda t, a: CF.support_vector_term(t, a, 0.1, mask=torch.ones(4)), TypeError, "mask"),
        (
            lambda t, a: RadiusPredictor(4)(torch.rand(3, 1)),
            ValueError,
            "similarities: need N >= 2",
        ),
        (lambda t, a: RadiusPredictor(4)(torch.rand(3)), ValueError, "similarities"),
        (
            lambda t, a: RadiusPredictor(4)(
                torch.rand(3, 5).index_fill(1, torch.tensor([2]), torch.nan)
            ),
            ValueError,
            "similarities: contains 3 NaN",
        ),
        (
            lambda t, a: RadiusPredictor(4)(torch.full((3, 5), float("inf"))),
            ValueError,
            "similarities: contains 15 NaN/Inf",
        ),
        (lambda t, a: CF.support_vector_term(t, a, -1e4 * 1.01), ValueError, r"radius: .*<= 10000"),
        (
            lambda t, a: CF.support_vector_term(t, a, torch.full((4,), 1e5)),
            ValueError,
            r"radius: .*<= 10000",
        ),
        (
            lambda t, a: RadiusPredictor(4)(torch.full((3, 5), 1e6 * 1.01)),
            ValueError,
            r"similarities: .* exceeds 1e\+06",
        ),
        (lambda t, a: RadiusPredictor(4)(torch.rand(3, 5), None), TypeError, "offset"),
        (lambda t, a: RadiusPredictor(4)(torch.rand(3, 5), "1"), TypeError, "offset"),
    ],
)
def test_bad_call_names_the_argument(gen, call, error, match):
    t, a = _good(gen)
    with pytest.raises(error, match=match):
        call(t, a)


def test_the_bounds_themselves_are_accepted(gen):
    """Radius, weights and similarities at their bounds give finite losses and gradients."""
    t, a = _good(gen)
    t.requires_grad_()
    for radius in (1e4, torch.full((4,), -1e4)):
        loss = CF.support_vector_term(t, a, radius, 1e-4)
        (g,) = torch.autograd.grad(loss, t)
        assert torch.isfinite(loss) and torch.isfinite(g).all()
    svr = SupportVectorRegularizer(InfoNCELoss(), radius=1e4, alpha=1e4, beta=1e4).double()
    assert torch.isfinite(svr(a, t))
    assert torch.isfinite(RadiusPredictor(4)(torch.full((3, 5), 1e6))).all()


@pytest.mark.parametrize("which", ["anchor", "candidates"])
def test_nan_embeddings_are_rejected(gen, which):
    t, a = _good(gen)
    (t if which == "anchor" else a)[1, 2] = float("nan")
    with pytest.raises(ValueError, match=f"{which}: contains 1 NaN"):
        CF.support_vector_term(t, a, 0.1)
    with pytest.raises(ValueError, match="contains 1 NaN"):
        SupportVectorRegularizer(InfoNCELoss()).double()(a, t)


# ------------------------------------------------------------------ half precision


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("where", ["functional", "module"])
def test_half_precision_nearly_aligned_pairs_have_finite_gradients(gen, dtype, where):
    """Nearly aligned pairs (d ~ 1e-3, float16's epsilon): R/d and its gradient (~R/d^2)
    overflow float16. The SVR runs in float32 inside, so the gradients are finite and
    those of the SVR term equal a float32 run on the same rounded inputs; the module's
    base loss runs in half, so its total is compared at half precision."""
    shared = randn(gen, 1, 32)
    a = shared + 0.5 * randn(gen, 8, 32)  # negatives at cos ~ 0.8: real gradients
    t = a + 2e-3 * randn(gen, 8, 32)
    a16, t16 = a.to(dtype), t.to(dtype)

    def grads(x_dtype):
        x_a = a16.detach().to(x_dtype).requires_grad_()
        x_t = t16.detach().to(x_dtype).requires_grad_()
        if where == "functional":
            loss = CF.support_vector_term(x_t, x_a, 0.1, 0.07)
        else:
            svr = SupportVectorRegularizer(InfoNCELoss(0.07), radius="static")
            loss = svr(x_a, x_t)
        loss.backward()
        assert loss.dtype == x_dtype
        return loss.detach().float(), x_a.grad.float(), x_t.grad.float()

    half, full = grads(dtype), grads(torch.float32)
    for h, f in zip(half, full, strict=True):
        assert torch.isfinite(h).all()
        if where == "functional":
            precision = torch.finfo(dtype).eps  # rounding the float32 result to dtype
            torch.testing.assert_close(h, f, rtol=precision, atol=precision * float(f.abs().max()))
        else:
            torch.testing.assert_close(h, f, rtol=0.05, atol=0.05 * float(f.abs().max()))
    assert full[1].abs().max() > 1e-3  # the comparison sees real gradients


@pytest.mark.parametrize("radius", ["dynamic", "static", 0.1])
def test_under_autocast_the_svr_runs_in_float32(gen, radius):
    """open_clip's trainer calls its loss inside ``torch.autocast``: the SVR term (its
    matmuls and the predictor) still runs in float32, as documented, where autocast would
    have mixed a float16 similarity with a float32 radius (a RuntimeError in lerp)."""
    a = randn(gen, 16, 32).float().requires_grad_()
    t = randn(gen, 16, 32).float()
    svr = SupportVectorRegularizer(InfoNCELoss(0.07), radius=radius)
    _, plain = svr(a, t, return_terms=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss, terms = svr(a, t, return_terms=True)
    loss.backward()
    assert a.grad is not None and torch.isfinite(a.grad).all()
    assert terms["svr"].dtype == torch.float32
    torch.testing.assert_close(terms["svr"], plain["svr"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(terms["constraint"], plain["constraint"], rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ training checks


def _loop(svr, steps, *, in_optimizer=True, lr=1e-2, accumulate=1, warmup=0, seed=0):
    """A small training loop: two linear encoders on fixed random features."""
    g = torch.Generator().manual_seed(seed)
    x_a, x_t = torch.randn(64, 12, generator=g), torch.randn(64, 12, generator=g)
    enc_a, enc_t = nn.Linear(12, 8), nn.Linear(12, 8)
    params = [*enc_a.parameters(), *enc_t.parameters()]
    if in_optimizer:
        params += list(svr.parameters())
    opt = torch.optim.Adam(params, lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / warmup) if warmup else 1)
    terms = []
    for step in range(steps):
        idx = torch.randint(0, 64, (16,), generator=g)
        loss, out = svr(enc_a(x_a[idx]), enc_t(x_t[idx]), return_terms=True)
        (loss / accumulate).backward()
        terms.append(out)
        if (step + 1) % accumulate == 0:
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=step % 2 == 0)
    return terms


@pytest.mark.parametrize("radius", ["static", "dynamic"])
def test_warns_once_when_the_radius_never_reaches_an_optimizer(radius):
    svr = SupportVectorRegularizer(InfoNCELoss(0.1), radius=radius)
    svr.stuck_after = 10
    with pytest.warns(UserWarning, match="never changed .* in the optimizer") as record:
        _loop(svr, 40, in_optimizer=False)
    assert sum("never changed" in str(w.message) for w in record) == 1


@pytest.mark.parametrize(("radius", "beta"), [("static", 0.01), ("dynamic", 1.0)])
@pytest.mark.parametrize(("accumulate", "warmup"), [(1, 0), (4, 12)])
def test_no_warning_in_a_normal_training_loop(radius, beta, accumulate, warmup):
    """Radius in the optimizer, learning-rate warm-up from 0, gradient accumulation,
    zero_grad with and without set_to_none, the default thresholds: no warning, and the
    radius trains. (With beta = 0.01 the dynamic radius of this toy settles above the
    distance, a true report.)"""
    svr = SupportVectorRegularizer(InfoNCELoss(0.1), radius=radius, beta=beta, constraint=True)
    before = [p.detach().clone() for p in svr.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        terms = _loop(svr, 266, accumulate=accumulate, warmup=warmup)
    assert any(not torch.equal(p, q) for p, q in zip(svr.parameters(), before, strict=True))
    assert float(terms[-1]["radius_mean"]) != pytest.approx(0.1)


def test_no_stuck_warning_without_gradients_or_outside_training(gen):
    """Optimizer steps without the radius, but a frozen radius, a zero gradient
    (``alpha=0``, constraint off) or evaluation mode: nothing to report."""
    a, t = randn(gen, 8, 4).float().requires_grad_(), randn(gen, 8, 4).float()
    opt = torch.optim.SGD([a], lr=0.0)
    frozen = SupportVectorRegularizer(InfoNCELoss(), radius="static")
    frozen.radius.requires_grad_(False)
    silent = SupportVectorRegularizer(InfoNCELoss(), radius="static", alpha=0.0)  # zero grad
    evaluated = SupportVectorRegularizer(InfoNCELoss(), radius="static").eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for svr in (frozen, silent, evaluated):
            svr.stuck_after = 3
            for _ in range(10):
                svr(a, t).backward()
                opt.step()
        with torch.no_grad():
            for _ in range(10):
                SupportVectorRegularizer(InfoNCELoss(), radius="static")(a, t)
    assert silent.radius.grad is not None and silent.radius.grad == 0  # it did get a grad


def test_warns_once_when_the_radius_stays_above_the_distance(gen):
    """Counted in optimizer steps (8 batches of accumulation are one), at the user's
    ``opt.step()`` line."""
    a, t = randn(gen, 8, 4).float().requires_grad_(), randn(gen, 8, 4).float()
    opt = torch.optim.SGD([a], lr=0.0)  # only its steps matter here
    svr = SupportVectorRegularizer(InfoNCELoss(), radius=2.5)  # > every ||a - t|| <= 2
    svr.over_distance_steps, svr.over_distance_check_every = 12, 4

    def steps(n: int, batches: int = 8) -> None:
        for _ in range(n):
            for _ in range(batches):
                svr(a, t).backward()
            opt.step()  # the line the warning names

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        steps(11)
        assert not record  # 88 batches, 11 steps: below the threshold
        steps(30)
    messages = [str(w.message) for w in record]
    assert len(messages) == 1 and "radius_over_distance stayed above 0.5" in messages[0]
    assert "12 consecutive optimizer steps" in messages[0]
    assert record[0].filename == __file__
    line = open(__file__).read().splitlines()[record[0].lineno - 1]
    assert line.strip().startswith("opt.step()")
    # a streak broken by a step below the distance starts again
    svr = SupportVectorRegularizer(InfoNCELoss(), radius=2.5)
    svr.over_distance_steps, svr.over_distance_check_every = 12, 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(40):
            with torch.no_grad():
                svr.radius.fill_(0.0 if step % 10 == 9 else 2.5)
            svr(a, t)
            opt.step()


# ------------------------------------------------------------------ two ranks, gloo


def _dist_cases():
    """name -> (regulariser factory, call(loss_fn, audio, text, mask))."""

    def make(base_factory, radius, direction="bi"):
        def factory():
            torch.manual_seed(0)  # identical predictor weights on every rank
            svr = SupportVectorRegularizer(
                base_factory(),
                radius=radius,
                direction=direction,
                beta=0.5,
                constraint=True,
                radius_init=0.7,
                num_features=4,
            )
            return randomise(svr).double() if radius == "dynamic" else svr.double()

        return factory

    info = lambda f, a, t, m: f(a, t[:, 0])  # noqa: E731
    kcl = lambda f, a, t, m: f(a, t, m)  # noqa: E731
    return {
        "info_nce_static": (make(lambda: InfoNCELoss(0.2), "static"), info),
        "info_nce_dynamic_uni": (make(lambda: InfoNCELoss(0.2), "dynamic", "uni"), info),
        "kcl_dynamic": (make(lambda: KCLLoss(0.2), "dynamic"), kcl),
        "kcl_fixed": (make(lambda: KCLLoss(0.2), 0.3), kcl),
    }


def _worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    init_gloo(rank, world, init_method)
    try:
        torch.set_num_threads(1)
        data = rank_data()
        rows = rank_rows(rank)
        results = {}
        for name, (factory, call) in _dist_cases().items():
            loss_fn = factory()
            a = data["audio"][rows].clone().requires_grad_()
            t = data["text"][rows].clone().requires_grad_()
            loss = call(loss_fn, a, t, data["mask"][rows])
            loss.backward()
            params = {n: p.grad for n, p in loss_fn.named_parameters()}
            results[name] = (loss.detach(), a.grad, t.grad, params)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("svr_dist")
    return spawn_ranks(_worker, out)


@pytest.mark.parametrize("name", list(_dist_cases()))
def test_gathered_regulariser_matches_single_process(rank_results, name):
    factory, call = _dist_cases()[name]
    loss_fn = factory()
    data = rank_data()
    a = data["audio"].clone().requires_grad_()
    t = data["text"].clone().requires_grad_()
    loss = call(loss_fn, a, t, data["mask"])
    loss.backward()
    assert_ddp_average_matches(rank_results, name, loss, a, t)
    world = len(RANK_SIZES)
    for pname, p in loss_fn.named_parameters():  # DDP averages parameter gradients
        mean_grad = sum(r[name][3][pname] for r in rank_results) / world
        torch.testing.assert_close(mean_grad, p.grad, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize(
    ("mask", "error", "match"),
    [
        (
            torch.ones(6, dtype=torch.long),
            TypeError,
            r"^mask: expected a bool tensor, got dtype torch.int64",
        ),
        (torch.ones(6), TypeError, r"^mask: expected a bool tensor, got dtype torch.float32"),
        (np.ones(6, dtype=bool), TypeError, r"^mask: expected a torch.Tensor, got ndarray"),
        ([True] * 6, TypeError, r"^mask: expected a torch.Tensor, got list"),
        (torch.ones(5, dtype=torch.bool), ValueError, r"^mask: expected shape \(6,\)"),
        (torch.ones(6, dtype=torch.bool, device="meta"), ValueError, r"^mask: "),
    ],
    ids=["long", "float", "numpy", "list", "short", "meta"],
)
def test_predictor_mask_is_checked(mask, error, match):
    """A long mask used to fail inside masked_fill_, a float one with a bare TypeError,
    a numpy one inside torch: each names ``mask``."""
    predictor = RadiusPredictor(num_features=4)
    sims = torch.rand(4, 6) * 2 - 1
    with pytest.raises(error, match=match):
        predictor(sims, 2, mask)
    with pytest.raises(error, match=match):
        predictor.features(sims, 2, mask)
