"""Inside a user's ``torch.autocast`` region every loss computes as outside it (issue 40
item 3): float32 inputs give a float32 loss and float32 terms, equal to the plain call,
gradients included; bfloat16 inputs give the loss in bfloat16, the inputs' dtype, as
they do outside a region (the docs: "Compute the loss in float32 under autocast").

CPU bfloat16 autocast here (a CUDA float16 region takes the same path: autocast is off
on the inputs' device inside every loss).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from contrastive_losses import (
    ASKLoss,
    CACLLoss,
    InfoNCELoss,
    KCLLoss,
    KnowledgeBank,
    SigLIPLoss,
    SupportVectorRegularizer,
    functional,
)
from contrastive_losses.integrations import open_clip as oc

B, K, D = 8, 3, 16


def _bank() -> KnowledgeBank:
    g = torch.Generator().manual_seed(1)
    bank = KnowledgeBank(D, backend="torch", num_prototypes=4)
    return bank.build(
        torch.randn(40, D, generator=g), torch.randn(40, D, generator=g), torch.arange(40)
    )


def _inputs(name: str, dtype: torch.dtype) -> tuple[list[torch.Tensor], dict[str, object]]:
    """Leaves in ``dtype`` (what the loss differentiates) and extra keyword arguments."""
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    if name == "KCL":
        return [r(B, D), r(B, K, D)], {}
    if name == "CACL":
        return [r(B, D), r(B, D), r(B, D)], {}
    if name == "ASK":
        return [r(B, D), r(B, D)], {"ids": torch.arange(100, 100 + B)}
    return [r(B, D), r(B, D)], {}


LOSSES = {
    "InfoNCE": lambda: InfoNCELoss(0.07),
    "InfoNCE learnable, tiled": lambda: InfoNCELoss(0.07, learnable_temperature=True, chunk_size=4),
    "SigLIP": SigLIPLoss,
    "SigLIP tiled": lambda: SigLIPLoss(chunk_size=4),
    "KCL": lambda: KCLLoss(0.07),
    "CACL": lambda: CACLLoss(0.07),
    "SVR static": lambda: SupportVectorRegularizer(InfoNCELoss(0.07), radius="static"),
    "SVR dynamic": lambda: SupportVectorRegularizer(SigLIPLoss(), radius="dynamic"),
    "ASK": lambda: ASKLoss(_bank(), k=3, k_coarse=2, temperature=0.1),
    "open_clip ClipLoss": oc.ClipLoss,
    "open_clip SigLipLoss": oc.SigLipLoss,
}


def _call(name: str, loss_fn, leaves, extra):
    if name == "open_clip ClipLoss":
        return loss_fn(*leaves, torch.tensor(1 / 0.07), output_dict=False)
    if name == "open_clip SigLipLoss":
        return loss_fn(*leaves, torch.tensor(10.0), torch.tensor(-10.0))
    if name.startswith("open_clip"):
        raise AssertionError(name)
    return loss_fn(*leaves, return_terms=True, **extra)


def _run(name: str, dtype: torch.dtype, autocast: bool):
    """(loss, terms, gradients of the leaves and of the loss's parameters)."""
    torch.manual_seed(0)
    loss_fn = LOSSES[name]()
    leaves, extra = _inputs(_kind(name), dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = _call(name, loss_fn, leaves, extra)
    loss, terms = out if isinstance(out, tuple) else (out, {})
    loss.backward()
    grads = [x.grad for x in [*leaves, *loss_fn.parameters()] if x.grad is not None]
    return loss, terms, grads


def _kind(name: str) -> str:
    return name.split()[0]


@pytest.mark.parametrize("name", list(LOSSES))
def test_float32_inputs_in_a_bfloat16_region_give_the_plain_float32_loss(name):
    plain, plain_terms, plain_grads = _run(name, torch.float32, autocast=False)
    loss, terms, grads = _run(name, torch.float32, autocast=True)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, plain, rtol=0, atol=0)
    assert terms.keys() == plain_terms.keys()
    for key, value in terms.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            assert value.dtype == torch.float32, key
            torch.testing.assert_close(value, plain_terms[key], rtol=0, atol=0)
    assert len(grads) == len(plain_grads) > 0
    for g, p in zip(grads, plain_grads, strict=True):
        assert g.dtype == p.dtype
        torch.testing.assert_close(g, p, rtol=0, atol=0)


@pytest.mark.parametrize("name", [n for n in LOSSES if n != "ASK"])
def test_bfloat16_inputs_give_a_bfloat16_loss_in_a_region_or_not(name):
    """The inputs' dtype, whether a region is on or not (before, InfoNCE and CACL
    returned float32 in a region and bfloat16 outside it)."""
    plain, _, _ = _run(name, torch.bfloat16, autocast=False)
    loss, _, _ = _run(name, torch.bfloat16, autocast=True)
    assert plain.dtype == loss.dtype == torch.bfloat16
    torch.testing.assert_close(loss, plain, rtol=0, atol=0)


def test_the_functional_forms_in_a_region():
    """The functional forms (what the Modules call) are guarded themselves."""
    g = torch.Generator().manual_seed(0)
    a, t = torch.randn(B, D, generator=g), torch.randn(B, D, generator=g)
    calls = {
        "info_nce": lambda: functional.info_nce(a, t, 0.07),
        "siglip": lambda: functional.siglip(a, t),
        "support_vector_term": lambda: functional.support_vector_term(
            functional.l2_normalize(a), functional.l2_normalize(t), 0.1, 0.07
        ),
    }
    for name, call in calls.items():
        plain = call()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inside = call()
        assert inside.dtype == torch.float32, name
        torch.testing.assert_close(inside, plain, rtol=0, atol=0)


def test_compiled_in_a_region_equals_eager_float32():
    """``torch.compile(fullgraph=True)`` traces the guard (no graph break)."""
    torch._dynamo.reset()
    loss_fn = SigLIPLoss(validate_args=False)
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(0)
    a, t = torch.randn(B, D, generator=g), torch.randn(B, D, generator=g)
    plain = loss_fn(a, t)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(a, t)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, plain, rtol=1e-6, atol=1e-6)
