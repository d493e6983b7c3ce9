"""The cheaper forms of the checks and of the one-process paths (issue 40, item 6) give
what the exact forms give: the logits' bound judged at a glance never passes what the
exact check refuses, the t->a mean down the columns equals the transposed
cross-entropy to rounding, and the labels and signs kept between calls serve every later call
(inference first, fake tensors, another shape)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import contrastive_losses._common as C
import contrastive_losses._nce_rows as R
from contrastive_losses import functional as CF
from contrastive_losses.integrations import open_clip as oc

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _outcome(pairs, **kwargs) -> str:
    try:
        C._logit_range(pairs, False, True, **kwargs)
    except ValueError as err:
        return str(err)
    return "passes"


def _rows(peak: float, b: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``b`` rows of ``d``: row 0 of norm ``peak``, the others 1e-3 of it (the total
    norm is then within 0.2% of the largest row's, where a loose glance would show)."""
    g = torch.Generator().manual_seed(seed)
    x = F.normalize(torch.randn(b, d, generator=g, dtype=torch.float64), dim=-1)
    x = x * peak
    x[1:] *= 1e-3
    return x.to(dtype)


@settings(max_examples=150, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    b=st.integers(2, 9),
    d=st.integers(1, 7),
    margin=st.floats(-0.1, 0.02),
    shift=st.floats(-3.0, 3.0),
    radius=st.sampled_from([0.0, 0.5]),
    seed=st.integers(0, 2**16),
)
def test_the_bound_at_a_glance_agrees_with_the_exact_check(
    dtype, b, d, margin, shift, radius, seed
):
    """Inputs whose exact bound lies from 10% below the limit to 2% above it: the check
    with its glance raises exactly where (and what) the exact check alone raises."""
    limit = torch.finfo(dtype).max / 4
    x, y = _rows(8.0, b, d, dtype, seed), _rows(2.0, b, d, dtype, seed + 1)
    peak = (x.double().norm(dim=-1).max() + radius) * y.double().norm(dim=-1).max()
    scale = (limit - abs(shift)) * (1 + margin) / float(peak)
    pairs = [(x, "audio", y, "text")]
    kwargs = {"scale": scale, "shift": shift, "radius": radius}
    with_glance = _outcome(pairs, **kwargs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(C, "_bounded_at_a_glance", lambda *args: False)
        assert with_glance == _outcome(pairs, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_glance_passes_ordinary_inputs_and_never_a_non_finite_one(dtype):
    """Unit rows at CLIP's scale pass at a glance (the exact check is skipped); a NaN or
    Inf anywhere, or squares beyond float32, never do (the exact check names them)."""
    x, y = _rows(1.0, 8, 4, dtype, 0), _rows(1.0, 8, 4, dtype, 1)
    assert C._bounded_at_a_glance(x, y, 1.0, torch.tensor(100.0), 0.0, 0.0)
    for bad in (math.nan, math.inf, -math.inf):
        z = x.clone()
        z[3, 1] = bad
        assert not C._bounded_at_a_glance(z, y, 1.0, 100.0, 0.0, 0.0)
        assert not C._bounded_at_a_glance(y, z, 1.0, 100.0, 0.0, 0.0)
    if dtype in (torch.float32, torch.float64):
        huge = torch.full((4, 4), torch.finfo(dtype).max / 2, dtype=dtype)
        assert not C._bounded_at_a_glance(huge, y[:4], 1.0, 1e-30, 0.0, 0.0)
    meta = torch.empty(8, 4, device="meta", dtype=dtype)
    assert not C._bounded_at_a_glance(meta, y, 1.0, 1.0, 0.0, 0.0)


@pytest.mark.parametrize("b", [3, 130])
def test_info_nce_column_log_softmax_equals_the_transposed_cross_entropy(monkeypatch, b):
    """From _COLUMN_SOFTMAX_MIN rows the one-process mean takes t->a down the columns:
    the value and gradients of the transposed cross-entropy to rounding (float64), both
    sides of the threshold, and the per-sample path's mean."""
    g = torch.Generator().manual_seed(b)
    a = torch.randn(b, 6, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(b, 6, generator=g, dtype=torch.float64, requires_grad=True)
    s = torch.tensor(9.0, dtype=torch.float64, requires_grad=True)

    def value_and_grads():
        out, terms = CF.info_nce(a, t, logit_scale=s, normalize=False, return_terms=True)
        return out.detach(), terms, torch.autograd.grad(out, (a, t, s))

    monkeypatch.setattr(R, "_COLUMN_SOFTMAX_MIN", 0)
    columns = value_and_grads()
    monkeypatch.setattr(R, "_COLUMN_SOFTMAX_MIN", 10**9)
    transposed = value_and_grads()
    torch.testing.assert_close(columns[:2], transposed[:2], rtol=1e-14, atol=0)
    torch.testing.assert_close(columns[2], transposed[2], rtol=1e-13, atol=1e-15)
    rows = CF.info_nce(a, t, logit_scale=s, normalize=False, reduction="none")
    torch.testing.assert_close(columns[0], rows.mean().detach(), rtol=1e-13, atol=0)


@pytest.mark.parametrize("learnable", [False, True])
def test_info_nce_fused_means_equal_the_cross_entropies(monkeypatch, learnable):
    """From _FUSED_MEANS_MIN rows the one-process mean comes from _SymmetricMeanCE: the
    value, terms and gradients (the scale's too, when it is a tensor) of the two
    cross-entropies to rounding (float64), and the per-sample path's mean. A float
    temperature rides into the Function as its constant scale; a tensor scale is taken
    on the (B, D) side."""
    g = torch.Generator().manual_seed(7)
    a = torch.randn(9, 6, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(9, 6, generator=g, dtype=torch.float64, requires_grad=True)
    s = torch.tensor(9.0, dtype=torch.float64, requires_grad=True)
    scale = {"logit_scale": s} if learnable else {"temperature": 0.2}
    inputs = (a, t, s) if learnable else (a, t)

    def value_and_grads():
        out, terms = CF.info_nce(a, t, return_terms=True, **scale)
        return out.detach(), terms, torch.autograd.grad(out, inputs)

    monkeypatch.setattr(R, "_FUSED_MEANS_MIN", 0)
    fused = value_and_grads()
    monkeypatch.setattr(R, "_FUSED_MEANS_MIN", 10**9)
    plain = value_and_grads()
    torch.testing.assert_close(fused[:2], plain[:2], rtol=1e-14, atol=0)
    torch.testing.assert_close(fused[2], plain[2], rtol=1e-12, atol=1e-15)
    rows = CF.info_nce(a, t, reduction="none", **scale)
    torch.testing.assert_close(fused[0], rows.mean().detach(), rtol=1e-13, atol=0)


def _drop_ins_step(b: int) -> list[torch.Tensor]:
    """Both drop-ins' losses and gradients on one fresh batch of ``b`` (float32)."""
    g = torch.Generator().manual_seed(b)
    out = []
    for loss_fn, extra in ((oc.ClipLoss(), ()), (oc.SigLipLoss(), (torch.tensor(-10.0),))):
        a = F.normalize(torch.randn(b, 8, generator=g), dim=-1).requires_grad_()
        t = F.normalize(torch.randn(b, 8, generator=g), dim=-1).requires_grad_()
        loss = loss_fn(a, t, torch.tensor(10.0), *extra)
        loss.backward()
        out += [loss.detach(), a.grad, t.grad]
    return out


@pytest.mark.parametrize("b", [5, 130])
def test_kept_labels_and_signs_serve_inference_then_training(monkeypatch, b):
    """The labels and SigLIP's signs kept from a call under torch.inference_mode (or made
    for fake tensors) serve a later training call, whose backward saves them: the same
    values and gradients as with nothing kept."""
    monkeypatch.setattr(C, "_CONSTANTS", {})
    fresh = _drop_ins_step(b)
    C._CONSTANTS.clear()
    with torch.inference_mode():  # kept here first
        x = F.normalize(torch.randn(b, 8), dim=-1)
        oc.ClipLoss()(x, x, torch.tensor(10.0))
        oc.SigLipLoss()(x, x, torch.tensor(10.0), torch.tensor(-10.0))
    assert C._CONSTANTS and all(not v.is_inference() for v in C._CONSTANTS.values())
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:  # neither kept nor taken from what is kept
        fake, scale = mode.from_tensor(torch.randn(b, 8)), mode.from_tensor(torch.tensor(10.0))
        oc.ClipLoss(validate_args=False)(fake, fake, scale)  # (no value to read)
        oc.SigLipLoss(validate_args=False)(fake, fake, scale, scale)
    assert all(type(v) is torch.Tensor for v in C._CONSTANTS.values())
    kept = _drop_ins_step(b)
    for x, y in zip(kept, fresh, strict=True):
        assert torch.equal(x, y)


def test_at_most_a_few_constants_are_kept(monkeypatch):
    """One entry per batch shape, cleared when full: a run of ever new batch sizes keeps
    no more than _MAX_CONSTANTS tensors alive."""
    monkeypatch.setattr(C, "_CONSTANTS", {})
    for b in range(2, 2 + 3 * C._MAX_CONSTANTS):
        x = F.normalize(torch.randn(b, 4), dim=-1)
        CF.info_nce(x, x, logit_scale=torch.tensor(10.0), normalize=False)
        assert len(C._CONSTANTS) <= C._MAX_CONSTANTS
