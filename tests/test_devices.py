"""Devices and mixed precision.

* Every loss on a CUDA device equals the same loss on the CPU, forward and backward, on
  the dense and the tiled path (skipped without CUDA: CI has no GPU; the project's GPU
  runs execute it and the closing notes record them).
* Every loss takes features produced under ``torch.autocast`` (bf16 and fp16, on the CPU
  and, where there is one, on CUDA): finite loss and gradients, within half precision of
  the float32 run. Autocast is off in backward, so a custom ``autograd.Function`` that
  mixes the half features with float32 tensors there fails ("expected m1 and m2 to have
  the same dtype") unless it casts: this caught KCL's and the regulariser's.
"""

from __future__ import annotations

from collections.abc import Callable

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
)

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (compares CUDA to CPU)"
)
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]

B, K, D = 48, 3, 16


def _inputs(dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "audio": torch.randn(B, D, generator=g, dtype=dtype),
        "text": torch.randn(B, D, generator=g, dtype=dtype),
        "texts": torch.randn(B, K, D, generator=g, dtype=dtype),
        "other": torch.randn(B, D, generator=g, dtype=dtype),
        "mask": (torch.rand(B, K, generator=g) > 0.3) | (torch.arange(K) == 0),  # English kept
    }


def _bank(device: torch.device, dtype: torch.dtype) -> KnowledgeBank:
    g = torch.Generator().manual_seed(1)
    bank = KnowledgeBank(D, backend="torch", num_prototypes=8, dtype=dtype)
    a, t = torch.randn(64, D, generator=g), torch.randn(64, D, generator=g)
    return bank.build(
        a.to(device, dtype), t.to(device, dtype), torch.arange(1000, 1064, device=device)
    )


# name -> (build(chunk_size, device, dtype) -> module, which inputs it takes)
CASES: dict[str, tuple[Callable[..., torch.nn.Module], tuple[str, ...]]] = {
    "infonce": (lambda c, dev, dt: InfoNCELoss(chunk_size=c), ("audio", "text")),
    "siglip": (lambda c, dev, dt: SigLIPLoss(chunk_size=c), ("audio", "text")),
    "kcl": (lambda c, dev, dt: KCLLoss(chunk_size=c), ("audio", "texts", "mask")),
    "cacl": (lambda c, dev, dt: CACLLoss(chunk_size=c), ("audio", "text", "other")),
    "svr_kcl": (
        lambda c, dev, dt: SupportVectorRegularizer(KCLLoss(chunk_size=c), radius=0.2),
        ("audio", "texts", "mask"),
    ),
    "svr_dynamic_infonce": (
        lambda c, dev, dt: SupportVectorRegularizer(InfoNCELoss(chunk_size=c)),
        ("audio", "text"),
    ),
    "svr_static_siglip": (
        lambda c, dev, dt: SupportVectorRegularizer(SigLIPLoss(chunk_size=c), radius="static"),
        ("audio", "text"),
    ),
    "svr_dynamic_cacl": (
        lambda c, dev, dt: SupportVectorRegularizer(CACLLoss(chunk_size=c)),
        ("audio", "text", "other"),
    ),
    "ask": (lambda c, dev, dt: ASKLoss(_bank(dev, dt), k=4, k_coarse=4), ("audio", "text")),
}


def _run(name: str, chunk: int | None, device: torch.device, dtype: torch.dtype):
    build, keys = CASES[name]
    torch.manual_seed(0)  # the same module parameters on both devices
    module = build(chunk, device, dtype).to(device, dtype)
    raw = _inputs(dtype)
    args = []
    for key in keys:
        x = raw[key].to(device)
        if x.is_floating_point():
            x.requires_grad_()
        args.append(x)
    if name == "ask":
        args.append(torch.arange(B, device=device))  # ids
    loss = module(*args)
    grads = torch.autograd.grad(loss, [a for a in args if a.requires_grad])
    return loss.detach().cpu(), [g.cpu() for g in grads]


@needs_cuda
@pytest.mark.parametrize("chunk", [None, 16])
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_equals_cpu(name: str, chunk: int | None) -> None:
    if name == "ask" and chunk is not None:
        pytest.skip("ASKLoss has no chunk_size (its Sinkhorn plan is B x B by definition)")
    cpu = _run(name, chunk, torch.device("cpu"), torch.float64)
    gpu = _run(name, chunk, torch.device("cuda"), torch.float64)
    # ASK's 50 Sinkhorn iterations (epsilon 0.05: exp(s / 0.05)) amplify the other
    # summation order of the GPU: on an H200 the loss differed by 1.2e-10 relative and
    # the gradients by 6.3e-10 absolute (1.4e-6 relative on their smallest entries).
    rtol, atol = (1e-9, 1e-12) if name != "ask" else (1e-5, 1e-8)
    torch.testing.assert_close(gpu[0], cpu[0], rtol=rtol, atol=atol)
    for g_gpu, g_cpu in zip(gpu[1], cpu[1], strict=True):
        torch.testing.assert_close(g_gpu, g_cpu, rtol=rtol, atol=atol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk", [None, 16])
@pytest.mark.parametrize("name", [n for n in CASES if n != "ask"])
def test_autocast_is_finite_and_close(
    name: str, chunk: int | None, amp: torch.dtype, device: str
) -> None:
    """Features produced under autocast (half-precision matmul outputs) give a finite loss
    and gradients within half precision of the float32 result."""
    build, keys = CASES[name]
    device = torch.device(device)
    raw = _inputs(torch.float32)
    proj = torch.nn.Linear(D, D).to(device)
    torch.manual_seed(0)
    module = build(chunk, device, torch.float32).to(device)

    def loss_and_grad(autocast: bool):
        proj.zero_grad()
        with torch.autocast(device.type, dtype=amp, enabled=autocast):
            args = [proj(raw[k].to(device)) if raw[k].is_floating_point() else raw[k].to(device)
                    for k in keys]  # fmt: skip
            loss = module(*args)
        loss.backward()
        return loss.detach().float(), proj.weight.grad.detach().clone()

    ref_loss, ref_grad = loss_and_grad(False)
    loss, grad = loss_and_grad(True)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    tol = 5e-2 if amp == torch.bfloat16 else 1e-2
    torch.testing.assert_close(loss, ref_loss, rtol=tol, atol=tol)
    torch.testing.assert_close(grad, ref_grad, rtol=10 * tol, atol=tol * ref_grad.abs().max())
