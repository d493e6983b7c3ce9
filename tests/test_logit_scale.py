"""The model's own scale per call (issue 21 item 2): ``logit_scale=`` (and SigLIP's
``logit_bias=``) on every loss Module's ``forward`` and every functional form.

``loss(logit_scale=s)`` is ``loss(temperature=1/s)`` forward and backward, its gradient
reaches the model's parameter (gradcheck in float64), the regulariser uses the same scale
detached, and the misuses (a learnable temperature of the Module's own, both given, a
float or a vector, a bad value, a trainable tensor temperature that would be frozen, the
``temperature=100`` habit) are refused or warned about.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from contrastive_losses import (
    CACLLoss,
    InfoNCELoss,
    KCLLoss,
    SigLIPLoss,
    SupportVectorRegularizer,
)
from contrastive_losses.functional import ask, cacl, info_nce, kcl, siglip, support_vector_term

B, K, D = 6, 3, 5


@pytest.fixture
def data() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "audio": torch.randn(B, D, generator=g, dtype=torch.float64),
        "text": torch.randn(B, D, generator=g, dtype=torch.float64),
        "texts": torch.randn(B, K, D, generator=g, dtype=torch.float64),
        "other": torch.randn(B, D, generator=g, dtype=torch.float64),
        "knowledge": torch.randn(2, B, 2, 2, D, generator=g, dtype=torch.float64),
    }


def _functional_cases(d: dict[str, torch.Tensor]):
    a, t, tt, o, kn = d["audio"], d["text"], d["texts"], d["other"], d["knowledge"]
    return {
        "info_nce": lambda **kw: info_nce(a, t, **kw),
        "info_nce_tiled": lambda **kw: info_nce(a, t, chunk_size=4, **kw),
        "kcl": lambda **kw: kcl(a, tt, **kw),
        "kcl_all_languages": lambda **kw: kcl(a, tt, negatives="all_languages", **kw),
        "cacl": lambda **kw: cacl(a, t, o, **kw),
        "support_vector_term": lambda **kw: support_vector_term(t, a, 0.2, **kw),
        "ask": lambda **kw: ask(a, t, kn[0], kn[1], **kw),
    }


@pytest.mark.parametrize(
    "name",
    [
        "info_nce",
        "info_nce_tiled",
        "kcl",
        "kcl_all_languages",
        "cacl",
        "support_vector_term",
        "ask",
    ],
)
def test_functional_logit_scale_is_inverse_temperature(data, name: str) -> None:
    """f(logit_scale=s) == f(temperature=1/s), forward and backward (inputs and s)."""
    fn = _functional_cases(data)[name]
    s = torch.tensor(12.5, dtype=torch.float64, requires_grad=True)
    tau = torch.tensor(1 / 12.5, dtype=torch.float64, requires_grad=True)
    for x in data.values():
        x.requires_grad_()
    by_scale = fn(logit_scale=s)
    inputs = [x for x in data.values()]
    g_scale = torch.autograd.grad(by_scale, [s, *inputs], allow_unused=True)
    by_tau = fn(temperature=tau)
    g_tau = torch.autograd.grad(by_tau, [tau, *inputs], allow_unused=True)
    torch.testing.assert_close(by_scale, by_tau, rtol=1e-12, atol=1e-12)
    # d/ds = d/dtau * dtau/ds = -g_tau / s^2
    torch.testing.assert_close(g_scale[0], -g_tau[0] / 12.5**2, rtol=1e-10, atol=1e-12)
    for gs, gt in zip(g_scale[1:], g_tau[1:], strict=True):
        if gs is None or gt is None:
            assert gs is None and gt is None
        else:
            torch.testing.assert_close(gs, gt, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_siglip_logit_scale_and_bias_are_scale_and_bias(data, chunk_size) -> None:
    a, t = data["audio"], data["text"]
    s = torch.tensor(8.0, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(-3.0, dtype=torch.float64, requires_grad=True)
    by_model = siglip(a, t, logit_scale=s, logit_bias=b, chunk_size=chunk_size)
    g_model = torch.autograd.grad(by_model, [s, b])
    s2, b2 = s.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    plain = siglip(a, t, s2, b2, chunk_size=chunk_size)
    g_plain = torch.autograd.grad(plain, [s2, b2])
    torch.testing.assert_close(by_model, plain, rtol=0, atol=0)
    torch.testing.assert_close(g_model, g_plain, rtol=0, atol=0)


def test_functional_gradcheck_wrt_logit_scale(data) -> None:
    a, t, tt = data["audio"], data["text"], data["texts"]
    s = torch.tensor(7.0, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(-2.0, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s: info_nce(a, t, logit_scale=s), (s,))
    assert torch.autograd.gradcheck(lambda s: info_nce(a, t, logit_scale=s, chunk_size=4), (s,))
    assert torch.autograd.gradcheck(lambda s: kcl(a, tt, logit_scale=s), (s,))
    assert torch.autograd.gradcheck(
        lambda s, b: siglip(a, t, logit_scale=s, logit_bias=b, chunk_size=4), (s, b)
    )


def _module_pairs(d: dict[str, torch.Tensor], s: float):
    """(Module taking logit_scale, the same Module at temperature 1/s, its args)."""
    a, t, tt, o = d["audio"], d["text"], d["texts"], d["other"]
    return {
        "InfoNCELoss": (InfoNCELoss(), InfoNCELoss(1 / s), (a, t)),
        "InfoNCELoss_tiled": (InfoNCELoss(chunk_size=4), InfoNCELoss(1 / s, chunk_size=4), (a, t)),
        "KCLLoss": (KCLLoss(), KCLLoss(1 / s), (a, tt)),
        "CACLLoss": (CACLLoss(), CACLLoss(1 / s), (a, t, o)),
        "SigLIPLoss": (
            SigLIPLoss(learnable=False),
            SigLIPLoss(s, -10.0, learnable=False),
            (a, t),
        ),
        "SVR_dynamic_InfoNCE": (
            SupportVectorRegularizer(InfoNCELoss()),
            SupportVectorRegularizer(InfoNCELoss(1 / s)),
            (a, t),
        ),
        "SVR_static_KCL_tiled": (
            SupportVectorRegularizer(KCLLoss(chunk_size=4), radius="static"),
            SupportVectorRegularizer(KCLLoss(1 / s, chunk_size=4), radius="static"),
            (a, tt),
        ),
        "SVR_fixed_SigLIP": (
            SupportVectorRegularizer(SigLIPLoss(learnable=False), radius=0.1),
            SupportVectorRegularizer(SigLIPLoss(s, learnable=False), radius=0.1),
            (a, t),
        ),
        "SVR_dynamic_CACL": (
            SupportVectorRegularizer(CACLLoss()),
            SupportVectorRegularizer(CACLLoss(1 / s)),
            (a, t, o),
        ),
    }


@pytest.mark.parametrize(
    "name",
    [
        "InfoNCELoss",
        "InfoNCELoss_tiled",
        "KCLLoss",
        "CACLLoss",
        "SigLIPLoss",
        "SVR_dynamic_InfoNCE",
        "SVR_static_KCL_tiled",
        "SVR_fixed_SigLIP",
        "SVR_dynamic_CACL",
    ],
)
def test_module_logit_scale_is_inverse_temperature(data, name: str) -> None:
    """Module(logit_scale=s) == Module(temperature=1/s): loss, terms, and the gradients
    of the inputs and of the Module's own parameters (the radius)."""
    s = 12.5
    by_scale, by_tau, args = _module_pairs(data, s)[name]
    by_scale, by_tau = by_scale.double(), by_tau.double()
    by_tau.load_state_dict(  # the same radius or predictor
        {k: v for k, v in by_scale.state_dict().items() if "scale" not in k}, strict=False
    )
    for key, buffer in by_tau.named_buffers():  # float32 at construction: log(s) exactly
        if key.endswith(("log_logit_scale", "log_scale")):
            buffer.fill_(math.log(s))
    args = tuple(x.detach().clone().requires_grad_() for x in args)
    scale = torch.tensor(s, dtype=torch.float64, requires_grad=True)
    loss, terms = by_scale(*args, logit_scale=scale, return_terms=True)
    grads = torch.autograd.grad(loss, [*args, *by_scale.parameters()])
    ref, ref_terms = by_tau(*args, return_terms=True)
    ref_grads = torch.autograd.grad(ref, [*args, *by_tau.parameters()])
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads, ref_grads, rtol=1e-8, atol=1e-10)
    for key in ref_terms:
        torch.testing.assert_close(terms[key], ref_terms[key], rtol=1e-8, atol=1e-10)
    assert scale.grad is None  # autograd.grad above did not accumulate; now check it flows
    loss = by_scale(*args, logit_scale=scale)
    loss.backward()
    assert scale.grad is not None and scale.grad != 0


def test_gradient_reaches_the_models_parameter(data) -> None:
    """open_clip's form: a log-scale Parameter in the model, exp'd at use."""
    a, t = data["audio"].float(), data["text"].float()
    log_scale = nn.Parameter(torch.tensor(2.6593))  # log(1/0.07)
    loss_fn = SupportVectorRegularizer(InfoNCELoss(chunk_size=4))
    loss_fn(a, t, logit_scale=log_scale.exp()).backward()
    assert log_scale.grad is not None and torch.isfinite(log_scale.grad)
    assert log_scale.grad != 0


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_svr_term_reads_the_scale_detached(data, chunk_size) -> None:
    """The regulariser's own terms do not train the model's scale: its gradient is the
    base's alone (as with a learnable temperature of the base)."""
    a, t = data["audio"], data["text"]
    s = torch.tensor(9.0, dtype=torch.float64, requires_grad=True)
    svr = SupportVectorRegularizer(InfoNCELoss(chunk_size=chunk_size), radius="dynamic")
    svr = svr.double()
    (g_svr,) = torch.autograd.grad(svr(a, t, logit_scale=s), [s])
    (g_base,) = torch.autograd.grad(svr.base(a, t, logit_scale=s), [s])
    torch.testing.assert_close(g_svr, g_base, rtol=1e-12, atol=1e-14)


def test_support_vector_term_gradcheck_wrt_logit_scale(data) -> None:
    """The functional SVR term is differentiable in the scale (the regulariser detaches it)."""
    a, t = data["audio"], data["text"]
    s = torch.tensor(6.0, dtype=torch.float64, requires_grad=True)
    r = torch.full((B,), 0.3, dtype=torch.float64)
    for chunk_size in (None, 4):
        assert torch.autograd.gradcheck(
            lambda s, c=chunk_size: support_vector_term(t, a, r, logit_scale=s, chunk_size=c),
            (s,),
        )


def test_svr_passes_logit_bias_to_siglip(data) -> None:
    a, t = data["audio"], data["text"]
    svr = SupportVectorRegularizer(SigLIPLoss(learnable=False), radius=0.1).double()
    s = torch.tensor(8.0, dtype=torch.float64)
    b = torch.tensor(-4.0, dtype=torch.float64, requires_grad=True)
    loss, terms = svr(a, t, logit_scale=s, logit_bias=b, return_terms=True)
    torch.testing.assert_close(terms["base"], siglip(a, t, logit_scale=s, logit_bias=b))
    (g,) = torch.autograd.grad(loss, [b])
    assert g != 0


def test_explicit_svr_temperature_wins_over_logit_scale(data) -> None:
    """``SupportVectorRegularizer(temperature=...)`` fixes the SVR temperature; the model's
    scale then reaches the base only."""
    a, t = data["audio"], data["text"]
    s = torch.tensor(5.0, dtype=torch.float64)
    fixed = SupportVectorRegularizer(InfoNCELoss(), radius=0.1, temperature=0.1).double()
    ref = SupportVectorRegularizer(InfoNCELoss(0.2), radius=0.1, temperature=0.1).double()
    torch.testing.assert_close(fixed(a, t, logit_scale=s), ref(a, t))


# ---------------------------------------------------------------------- refusals


def test_module_with_learnable_temperature_refuses_logit_scale(data) -> None:
    a, t = data["audio"], data["text"]
    s = torch.tensor(10.0, dtype=torch.float64)
    for loss_fn in (InfoNCELoss(learnable_temperature=True), KCLLoss(learnable_temperature=True)):
        x = t if isinstance(loss_fn, InfoNCELoss) else data["texts"]
        with pytest.raises(ValueError, match=r"logit_scale: .*learnable_temperature=True"):
            loss_fn(a, x, logit_scale=s)
    with pytest.raises(ValueError, match="logit_scale: SigLIPLoss\\(learnable=True\\)"):
        SigLIPLoss()(a, t, logit_scale=s)
    with pytest.raises(ValueError, match="logit_bias: SigLIPLoss\\(learnable=True\\)"):
        SigLIPLoss()(a, t, logit_bias=s)
    svr = SupportVectorRegularizer(CACLLoss(learnable_temperature=True))
    with pytest.raises(ValueError, match="learnable_temperature"):
        svr(a, t, data["other"], logit_scale=s)


def test_functional_refuses_temperature_and_logit_scale(data) -> None:
    a, t = data["audio"], data["text"]
    s = torch.tensor(10.0, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"logit_scale: given together with temperature=0.1"):
        info_nce(a, t, 0.1, logit_scale=s)
    with pytest.raises(ValueError, match="logit_scale: given together with temperature"):
        kcl(a, data["texts"], temperature=torch.tensor(0.1), logit_scale=s)
    with pytest.raises(ValueError, match=r"logit_scale: given together with scale=5.0"):
        siglip(a, t, 5.0, logit_scale=s)
    with pytest.raises(ValueError, match=r"logit_bias: given together with bias=-1.0"):
        siglip(a, t, bias=-1.0, logit_bias=s)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (10.0, TypeError, "logit_scale: expected a 0-d tensor .* got float"),
        (torch.tensor([10.0], dtype=torch.float64), ValueError, "expected a 0-d tensor, got shape"),
        (torch.tensor(10), TypeError, "logit_scale"),
        (torch.tensor(-1.0, dtype=torch.float64), ValueError, "must be finite and in"),
        (torch.tensor(0.0, dtype=torch.float64), ValueError, "must be finite and in"),
        (torch.tensor(float("nan"), dtype=torch.float64), ValueError, "must be finite and in"),
        (torch.tensor(float("inf"), dtype=torch.float64), ValueError, "must be finite and in"),
        (torch.tensor(2e4, dtype=torch.float64), ValueError, "10000"),
        (torch.tensor(10.0, dtype=torch.float64, device="meta"), ValueError, "on device meta"),
    ],
)
def test_bad_logit_scale(data, bad, error, match) -> None:
    a, t = data["audio"], data["text"]
    for fn in (
        lambda: info_nce(a, t, logit_scale=bad),
        lambda: siglip(a, t, logit_scale=bad),
        lambda: InfoNCELoss()(a, t, logit_scale=bad),
        lambda: SupportVectorRegularizer(InfoNCELoss())(a, t, logit_scale=bad),
    ):
        with pytest.raises(error, match=match):
            fn()


def test_value_checks_of_logit_scale_only_with_validate_args(data) -> None:
    """Off, the scale's value is not read (no host sync): a negative one goes through."""
    a, t = data["audio"], data["text"]
    out = info_nce(a, t, logit_scale=torch.tensor(-1.0, dtype=torch.float64), validate_args=False)
    assert torch.isfinite(out)
    with pytest.raises(ValueError, match="shape"):  # static checks stay
        info_nce(a, t, logit_scale=torch.ones(2, dtype=torch.float64), validate_args=False)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda p: InfoNCELoss(temperature=p), "temperature: .*learnable_temperature=True"),
        (lambda p: KCLLoss(p), "temperature: .*logit_scale"),
        (lambda p: CACLLoss(p), "temperature: .*requires grad"),
        (lambda p: SigLIPLoss(scale_init=p), "scale_init: .*learnable=True"),
        (lambda p: SigLIPLoss(bias_init=p), "bias_init: .*requires grad"),
        (
            lambda p: SupportVectorRegularizer(InfoNCELoss(), temperature=p),
            "temperature: .*learnable_temperature=True on the base",
        ),
    ],
)
def test_trainable_tensor_temperature_is_refused_not_frozen(build, match) -> None:
    """A Parameter temperature used to be copied into a buffer: its .grad stayed None."""
    with pytest.raises(TypeError, match=match):
        build(nn.Parameter(torch.tensor(0.05)))


def test_a_tensor_temperature_without_grad_is_still_accepted() -> None:
    loss_fn = InfoNCELoss(temperature=torch.tensor(0.05))  # type: ignore[arg-type]
    torch.testing.assert_close(loss_fn.temperature, torch.tensor(0.05))


@pytest.mark.parametrize(
    "build",
    [
        lambda: InfoNCELoss(temperature=100.0),
        lambda: KCLLoss(14.3),
        lambda: CACLLoss(100.0),
        lambda: SupportVectorRegularizer(InfoNCELoss(), temperature=100.0),
        lambda: info_nce(torch.randn(4, 3), torch.randn(4, 3), 100.0),
    ],
)
def test_temperature_above_one_warns_about_the_logit_scale_habit(build) -> None:
    with pytest.warns(UserWarning, match=r"temperature=1\S* looks like a logit scale") as rec:
        build()
    message = str(rec[0].message)
    assert "logit_scale=" in message
    assert "temperature=0.0" in message  # the likely intended value, 1/x
    assert rec[0].filename == __file__  # points at the caller


def test_temperature_at_most_half_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        InfoNCELoss(temperature=0.5)
        info_nce(torch.randn(4, 3), torch.randn(4, 3), 0.5)
        info_nce(torch.randn(4, 3), torch.randn(4, 3), torch.tensor(5.0))  # tensors: no read


def test_terms_report_the_temperature_used(data) -> None:
    a, t = data["audio"], data["text"]
    s = torch.tensor(20.0, dtype=torch.float64)
    _, terms = InfoNCELoss()(a, t, logit_scale=s, return_terms=True)
    torch.testing.assert_close(terms["temperature"], torch.tensor(0.05, dtype=torch.float64))
    _, terms = SigLIPLoss(learnable=False)(a, t, logit_scale=s, return_terms=True)
    torch.testing.assert_close(terms["scale"], s)


@pytest.mark.parametrize("call", ["info_nce", "siglip"])
def test_a_trainable_scale_with_normalize_false_reads_its_value_quietly(data, call) -> None:
    # The overflow check of normalize=False reads the scale's value; a scale that requires
    # grad (the model's, as open_clip's drop-ins pass it) must not warn about it.
    log_scale = nn.Parameter(torch.tensor(2.0, dtype=torch.float64))
    extra = {"logit_bias": torch.tensor(-1.0, dtype=torch.float64)} if call == "siglip" else {}
    fn = info_nce if call == "info_nce" else siglip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = fn(
            data["audio"], data["text"], normalize=False, logit_scale=log_scale.exp(), **extra
        )
    loss.backward()
    assert log_scale.grad is not None and bool(torch.isfinite(log_scale.grad))
