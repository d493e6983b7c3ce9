"""The scale applied at the features' precision, as open_clip does (issue 28 item 3).

open_clip computes ``logit_scale * image_features @ text_features.T``: the scale
multiplies the features in their dtype. The losses did ``x / (1 / s)``, whose reciprocal
rounded a float16 scale and whose gradient ``-g / s**2`` overflowed. Here: the drop-ins
against open_clip's own ``loss.py`` with half-precision scales (to 1e-6) and features (to
open_clip's own precision), finite scale gradients where open_clip's are, the dense and
tiled paths equal in half precision, ``ClipLoss`` checking ``logit_bias``, and a fixed
temperature that the Module applies exactly as the functional form does, and the
regulariser's SVR term as exact as its base in float64 (issue 33).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from open_clip_reference import load_open_clip_loss

from contrastive_losses import CACLLoss, InfoNCELoss, KCLLoss, SupportVectorRegularizer
from contrastive_losses import functional as CF
from contrastive_losses.integrations.open_clip import ClipLoss, SigLipLoss

pytestmark = pytest.mark.filterwarnings("ignore:logit_scale=.* is below 1:UserWarning")

B, D = 32, 16
HALF = (torch.float16, torch.bfloat16)


def _features(seed: int = 0, norm: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit image features and text features near them (a trained model's), times
    ``norm``, float32."""
    g = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(B, D, generator=g), dim=-1)
    text = F.normalize(torch.randn(B, D, generator=g) + image, dim=-1)
    return image * norm, text * norm


def _run(loss_fn, image, text, scale, bias=None) -> tuple[torch.Tensor, ...]:
    """``(loss, image grad, text grad, scale grad)`` of one forward and backward, each as
    the dtype it came in (the scale's gradient in the scale's dtype)."""
    image, text = image.clone().requires_grad_(), text.clone().requires_grad_()
    scale = scale.clone().requires_grad_()
    loss = loss_fn(image, text, scale) if bias is None else loss_fn(image, text, scale, bias)
    loss.backward()
    return loss.detach(), image.grad, text.grad, scale.grad


def _ulp(x: torch.Tensor) -> float:
    """The spacing of ``x``'s dtype at ``x`` (one unit in the last place)."""
    return float(torch.finfo(x.dtype).eps) * 2.0 ** math.floor(math.log2(abs(float(x))))


@pytest.mark.parametrize("scale_dtype", HALF)
@pytest.mark.parametrize("name", ["ClipLoss", "SigLipLoss"])
def test_half_precision_scale_with_float32_features_equals_open_clip(name, scale_dtype):
    """A float16/bfloat16 ``logit_scale`` (a model trained in half precision) with float32
    features: open_clip upcasts it exactly; the loss and feature gradients agree to 1e-6
    (they were 2e-4 / 1e-3 off through the rounded reciprocal), the scale's gradient to
    one unit of its own dtype (both round a float32 sum to it)."""
    oc = load_open_clip_loss()
    image, text = _features()
    scale = torch.tensor(1 / 0.07).to(scale_dtype)
    bias = None if name == "ClipLoss" else torch.tensor(-10.0)
    theirs = _run(getattr(oc, name)(), image, text, scale, bias)
    ours = _run({"ClipLoss": ClipLoss, "SigLipLoss": SigLipLoss}[name](), image, text, scale, bias)
    for i in range(3):
        torch.testing.assert_close(ours[i], theirs[i], rtol=1e-6, atol=1e-7)
    assert ours[3].dtype == scale_dtype
    assert abs(float(ours[3]) - float(theirs[3])) <= _ulp(theirs[3])


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("chunk_size", [None, 8])
def test_half_precision_features_equal_open_clip_to_its_own_precision(dtype, chunk_size):
    """float16/bfloat16 features and scale: our loss is open_clip's to its own precision,
    a few units in the last place of the loss in that dtype, and no further from the
    float64 loss than open_clip's own rounding takes it (plus one unit); the scale's
    gradient is finite and as close."""
    oc = load_open_clip_loss()
    for seed in range(4):
        image, text = _features(seed)
        scale = torch.tensor(1 / 0.07)
        exact = _run(oc.ClipLoss(), image.double(), text.double(), scale.double())
        half = (image.to(dtype), text.to(dtype), scale.to(dtype))
        theirs = _run(oc.ClipLoss(), *half)
        ours = _run(ClipLoss(chunk_size=chunk_size), *half)
        ulp = _ulp(theirs[0])
        assert abs(float(ours[0]) - float(theirs[0])) <= 2 * ulp, seed
        assert (
            abs(float(ours[0]) - float(exact[0])) <= abs(float(theirs[0]) - float(exact[0])) + ulp
        )
        assert torch.isfinite(ours[3])
        assert abs(float(ours[3]) - float(theirs[3])) <= 4 * _ulp(theirs[3]), seed


def test_float16_features_of_norm_30_give_open_clips_finite_scale_gradient():
    """``normalize=False`` features of norm 30 in float16 (an unnormalised tower): the
    reciprocal's gradient overflowed to inf; the product's is open_clip's (268 here)."""
    oc = load_open_clip_loss()
    image, text = _features(norm=30.0)
    half = (image.half(), text.half(), torch.tensor(1 / 0.07 / 900).half())
    theirs, ours = _run(oc.ClipLoss(), *half), _run(ClipLoss(), *half)
    assert torch.isfinite(theirs[3]) and abs(float(theirs[3])) > 100  # a real gradient
    assert float(ours[3]) == float(theirs[3])
    torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=_ulp(theirs[0]))


@pytest.mark.parametrize("tiny", [5e-20, 1e-30, 1e-38])
def test_tiny_accepted_scales_have_open_clips_finite_gradient(tiny):
    """Scales down to 1e-38 are accepted (positive and finite); 1/s**2 overflowed float32
    at 5e-20 and gave an inf gradient, the product's gradient is open_clip's."""
    oc = load_open_clip_loss()
    image, text = _features()
    scale = torch.tensor(tiny)
    theirs, ours = _run(oc.ClipLoss(), image, text, scale), _run(ClipLoss(), image, text, scale)
    for i in range(4):
        assert torch.isfinite(ours[i]).all()
        torch.testing.assert_close(ours[i], theirs[i], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_dense_and_tiled_equal_with_a_half_scale(dtype):
    """The scale multiplies the rows before either path: dense and tiled agree, forward
    and backward, for a float16 scale over ``dtype`` features."""
    image, text = _features()
    image, text = image.to(dtype), text.to(dtype)
    scale = torch.tensor(1 / 0.07).half()
    dense = _run(ClipLoss(), image, text, scale)
    tiled = _run(ClipLoss(chunk_size=5), image, text, scale)
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 0.02, "atol": 0.01}
    for d, t in zip(dense, tiled, strict=True):
        torch.testing.assert_close(d.float(), t.float(), **tol)


def test_clip_loss_checks_logit_bias():
    """open_clip adds ``logit_bias`` to every logit; a ``(B,)`` one returned a ``(B,)``
    "loss". It must be a 0-d floating tensor, on the features' device."""
    image, text = _features()
    scale = torch.tensor(10.0)
    with pytest.raises(ValueError, match=r"logit_bias: expected a 0-d tensor, got shape \(32,\)"):
        ClipLoss()(image, text, scale, torch.zeros(B))
    with pytest.raises(TypeError, match="logit_bias: expected a floating-point tensor"):
        ClipLoss()(image, text, scale, torch.tensor(1))
    with pytest.raises(TypeError, match="logit_bias: expected a 0-d tensor"):
        ClipLoss()(image, text, scale, -10.0)  # type: ignore[arg-type]
    assert ClipLoss()(image, text, scale, torch.tensor(-10.0)).shape == ()


# ---------------------------------------------------------- a fixed temperature, exact


def _pair64(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(B, D, generator=g, dtype=torch.float64)
    return a, torch.randn(B, D, generator=g, dtype=torch.float64) + a


MODULES = {
    "InfoNCELoss": (InfoNCELoss, lambda a, t: (a, t), CF.info_nce),
    "KCLLoss": (KCLLoss, lambda a, t: (a, torch.stack([t, t.flip(0)], 1)), CF.kcl),
    "CACLLoss": (CACLLoss, lambda a, t: (a, t, t.flip(0)), CF.cacl),
}


@pytest.mark.parametrize("name", list(MODULES))
@pytest.mark.parametrize("temperature", [0.05, 0.07, 0.013])
def test_fixed_temperature_module_equals_functional_in_float64(name, temperature):
    """``InfoNCELoss(temperature=0.05)`` kept a float32 buffer: with float64 inputs it was
    1.4e-8 off the functional form (3e-8 after ``.double()``). The Python float is used
    now: equal to 1e-15, values and gradients, before and after ``.double()``."""
    make, args_of, functional = MODULES[name]
    a, t = _pair64()
    for module in (make(temperature=temperature), make(temperature=temperature).double()):
        args = tuple(x.clone().requires_grad_() for x in args_of(a, t))
        ref_args = tuple(x.clone().requires_grad_() for x in args_of(a, t))
        loss = module(*args)
        ref = functional(*ref_args, temperature=temperature)
        torch.testing.assert_close(loss, ref, rtol=1e-15, atol=0)
        grads = torch.autograd.grad(loss, args)
        ref_grads = torch.autograd.grad(ref, ref_args)
        torch.testing.assert_close(grads, ref_grads, rtol=1e-15, atol=1e-17)


def test_fixed_temperature_follows_a_loaded_or_written_buffer():
    """The buffer stays the checkpointed value: ``load_state_dict`` of another temperature
    and an in-place write are adopted (as they were), a checkpoint of the same value
    keeps the exact float."""
    a, t = _pair64()
    loss_fn = InfoNCELoss(temperature=0.05)
    loss_fn.load_state_dict(InfoNCELoss(temperature=0.05).state_dict())
    assert float(loss_fn(a, t)) == float(CF.info_nce(a, t, temperature=0.05))
    loss_fn.load_state_dict(InfoNCELoss(temperature=0.1).state_dict())
    torch.testing.assert_close(loss_fn(a, t), CF.info_nce(a, t, temperature=0.1), rtol=1e-7, atol=0)
    with torch.no_grad():
        loss_fn.log_logit_scale.fill_(math.log(1 / 0.2))
    torch.testing.assert_close(loss_fn.temperature, torch.tensor(0.2))
    torch.testing.assert_close(loss_fn(a, t), CF.info_nce(a, t, temperature=0.2), rtol=1e-7, atol=0)
    assert "temperature=0.2," in repr(loss_fn)


@pytest.mark.parametrize("radius", [0.2, "static"])
@pytest.mark.parametrize("double", [False, True], ids=["float32 module", "double()"])
def test_svr_uses_its_bases_fixed_temperature_exactly_in_float64(radius, double):
    """The SVR term read the base's fixed temperature at float32 precision (0.05 as
    0.0500000007): ``SVR(InfoNCELoss(temperature=0.05))`` was 1.3e-8 off the same loss
    given ``logit_scale=20`` with float64 inputs. Now equal to 1e-15, values and
    gradients."""
    a, t = _pair64()
    fixed = SupportVectorRegularizer(InfoNCELoss(temperature=0.05), radius=radius)
    scaled = SupportVectorRegularizer(InfoNCELoss(), radius=radius)
    if double:
        fixed, scaled = fixed.double(), scaled.double()
    args = [x.clone().requires_grad_() for x in (a, t)]
    ref_args = [x.clone().requires_grad_() for x in (a, t)]
    loss, terms = fixed(*args, return_terms=True)
    scale = torch.tensor(20.0, dtype=torch.float64)
    ref, ref_terms = scaled(*ref_args, logit_scale=scale, return_terms=True)
    torch.testing.assert_close(terms["svr"], ref_terms["svr"], rtol=1e-15, atol=0)
    torch.testing.assert_close(loss, ref, rtol=1e-15, atol=0)
    grads, ref_grads = torch.autograd.grad(loss, args), torch.autograd.grad(ref, ref_args)
    torch.testing.assert_close(grads, ref_grads, rtol=1e-14, atol=1e-17)


@pytest.mark.parametrize("double", [False, True], ids=["float32 module", "double()"])
def test_svr_fixed_radius_is_exact_in_float64(double):
    """A fixed radius of 0.2 was used as its float32 buffer (0.2000000030): now the
    Python float, as ``support_vector_term`` takes it (equal to 1e-15); a value loaded or
    written into the buffer is adopted, as a fixed temperature's."""
    a, t = _pair64()
    loss_fn = SupportVectorRegularizer(
        InfoNCELoss(temperature=0.05), radius=0.2, direction="uni", constraint=False
    )
    if double:
        loss_fn = loss_fn.double()
    _, terms = loss_fn(a, t, return_terms=True)
    ref = 0.5 * CF.support_vector_term(t, a, 0.2, 0.05)  # text anchors, one direction of 2
    torch.testing.assert_close(terms["svr"], ref, rtol=1e-15, atol=0)
    assert "radius='fixed' (0.2)" in repr(loss_fn)
    with torch.no_grad():
        loss_fn.radius.fill_(0.3)
    _, terms = loss_fn(a, t, return_terms=True)
    ref = 0.5 * CF.support_vector_term(t, a, float(loss_fn.radius), 0.05)
    torch.testing.assert_close(terms["svr"], ref, rtol=1e-15, atol=0)
