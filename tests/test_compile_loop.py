"""Compiled losses survive a real training loop (issue 21 item 1).

``torch.compile(loss, fullgraph=True)`` must compile once and then serve every step of a
loop whose embeddings are fresh, non-leaf outputs of an encoder and whose parameters an
optimizer updates, with no recompile. Before the fix the regulariser keyed its tensors
by ``id(x)``, so dynamo guarded on the identity of the input object ("Cache line
invalidated because L['args'][1] got deallocated"): one recompile a step until
``FailOnRecompileLimitHit`` at step 9.

Each case compiles, with a backend that counts its calls (a call is a compile), the sum
of one base loss and the regulariser over it with each radius mode (static, dynamic,
fixed), dense and tiled, value checks on and off, and runs ``STEPS`` optimizer steps; after
``WARMUP`` steps recompiling is an error (``error_on_recompile``) and the count must stay
at one graph. The same for ``ask`` on given knowledge and for the model's own
``logit_scale``/``logit_bias``. Dynamo's caches are reset between cases. The inductor
loop is the Performance page's snippet, run by ``tests/test_docs.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from helpers import CountingBackend
from torch import nn

from contrastive_losses import (
    CACLLoss,
    InfoNCELoss,
    KCLLoss,
    SigLIPLoss,
    SupportVectorRegularizer,
)
from contrastive_losses.functional import ask

pytestmark = pytest.mark.filterwarnings(
    # torch's own inductor lowering calls a deprecated torch._prims_common.check
    "ignore:`torch._prims_common.check` is deprecated:FutureWarning"
)

B, K, D_IN, D = 8, 2, 6, 8
STEPS, WARMUP = 20, 2
CHUNK = 5  # two tiles over a batch of 8, the last one ragged


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Encoders(nn.Module):
    """Tiny audio and text encoders: every step's embeddings are new non-leaf tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.audio = nn.Linear(D_IN, D)
        self.text = nn.Linear(D_IN, D)


def _batch(kind: str, enc: Encoders, g: torch.Generator) -> tuple[tuple, dict]:
    """One step's loss arguments from fresh raw inputs through the encoders."""
    audio = enc.audio(torch.randn(B, D_IN, generator=g))
    if kind == "pair":
        return (audio, enc.text(torch.randn(B, D_IN, generator=g))), {}
    text = enc.text(torch.randn(B, K, D_IN, generator=g))  # (B, K, D)
    if kind == "kcl":
        mask = torch.rand(B, K, generator=g) < 0.7
        mask[:, 0] = True
        return (audio, text, mask), {}
    other = torch.randint(1, K, (B,), generator=g)  # cacl: English at 0, one other each
    return (audio, text, other), {}


BASES: dict[str, tuple[Callable[..., nn.Module], str]] = {
    "info_nce": (InfoNCELoss, "pair"),
    "siglip": (SigLIPLoss, "pair"),
    "kcl": (KCLLoss, "kcl"),
    "cacl": (CACLLoss, "cacl"),
}


def _run_loop(
    objective: Callable[..., torch.Tensor],
    modules: list[nn.Module],
    make_batch: Callable[[torch.Generator], tuple[tuple, dict]],
    backend: str = "aot_eager",
    steps: int = STEPS,
) -> CountingBackend:
    """``steps`` optimizer steps of ``objective`` compiled with ``fullgraph=True``; after
    ``WARMUP`` steps a recompile raises. Returns the counting backend."""
    counter = CountingBackend(backend)
    compiled = torch.compile(objective, fullgraph=True, backend=counter)
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.05)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        args, kwargs = make_batch(g)
        if step < WARMUP:
            loss = compiled(*args, **kwargs)
        else:
            with torch._dynamo.config.patch(error_on_recompile=True):
                loss = compiled(*args, **kwargs)
        assert loss.dim() == 0 and bool(torch.isfinite(loss)), f"step {step}: {loss}"
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    assert counter.calls == 1, f"{counter.calls} graphs compiled for one loop"
    return counter


def _sum_of(losses: nn.ModuleDict, **call_kwargs: Any) -> Callable[..., torch.Tensor]:
    def objective(*args: Any, **kwargs: Any) -> torch.Tensor:
        total = torch.zeros(())
        for loss_fn in losses.values():
            total = total + loss_fn(*args, **kwargs, **call_kwargs)
        return total

    return objective


# Every base dense and tiled, each with the value checks on in one and off in the other
# (under compile the checks step aside whatever validate_args says, so the graph is the
# same; both settings still run, for every base): 8 compiled loops, not 16, for CI time.
CASES = [
    (base, chunk_size, (i + j) % 2 == 0)
    for i, base in enumerate(BASES)
    for j, chunk_size in enumerate((None, CHUNK))
]


@pytest.mark.parametrize(
    "base, chunk_size, validate_args",
    CASES,
    ids=[
        f"{b}-{'dense' if c is None else 'tiled'}-checks_{'on' if v else 'off'}"
        for b, c, v in CASES
    ],
)
def test_base_and_every_regulariser_compile_once_for_a_loop(base, chunk_size, validate_args):
    """The base alone and the regulariser with a static, a dynamic and a fixed radius,
    one graph, ``STEPS`` steps, no recompile."""
    torch.manual_seed(0)
    make, kind = BASES[base]

    def build() -> nn.Module:
        return make(chunk_size=chunk_size, validate_args=validate_args)

    losses = nn.ModuleDict(
        {
            "base": build(),
            **{
                f"svr_{radius}": SupportVectorRegularizer(
                    build(), radius=radius, validate_args=validate_args
                )
                for radius in ("static", "dynamic")
            },
            "svr_fixed": SupportVectorRegularizer(
                build(), radius=0.1, direction="uni", validate_args=validate_args
            ),
        }
    )
    enc = Encoders()
    _run_loop(_sum_of(losses), [enc, losses], lambda g: _batch(kind, enc, g))


@pytest.mark.parametrize("validate_args", [True, False], ids=["checks_on", "checks_off"])
def test_ask_on_given_knowledge_compiles_once_for_a_loop(validate_args):
    torch.manual_seed(0)
    enc = Encoders()

    def make_batch(g: torch.Generator) -> tuple[tuple, dict]:
        (audio, text), _ = _batch("pair", enc, g)
        knowledge = [F.normalize(torch.randn(B, 3, 2, D, generator=g), dim=-1) for _ in range(4)]
        return (audio, text, *knowledge), {}

    def objective(*args: torch.Tensor) -> torch.Tensor:
        return ask(*args, validate_args=validate_args)  # type: ignore[return-value]

    _run_loop(objective, [enc], make_batch)


class ClipLikeModel(Encoders):
    """The open_clip layout: the learnable scale (and SigLIP bias) live in the model."""

    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.logit_bias = nn.Parameter(torch.tensor(-10.0))


@pytest.mark.parametrize("chunk_size", [None, CHUNK], ids=["dense", "tiled"])
def test_model_logit_scale_compiles_once_for_a_loop(chunk_size):
    """``logit_scale=model.logit_scale.exp()`` (and ``logit_bias``) per call, compiled."""
    torch.manual_seed(0)
    model = ClipLikeModel()
    siglip = SigLIPLoss(learnable=False, chunk_size=chunk_size)
    scale_only = nn.ModuleDict(
        {
            "info_nce": InfoNCELoss(chunk_size=chunk_size),
            "svr_dynamic": SupportVectorRegularizer(InfoNCELoss(chunk_size=chunk_size)),
        }
    )
    with_bias = nn.ModuleDict(
        {"siglip": siglip, "svr_static": SupportVectorRegularizer(siglip, radius="static")}
    )

    def objective(audio: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        scale = model.logit_scale.exp()
        total = _sum_of(scale_only, logit_scale=scale)(audio, text)
        return total + _sum_of(with_bias, logit_scale=scale, logit_bias=model.logit_bias)(
            audio, text
        )

    start = model.logit_scale.detach().clone()
    _run_loop(objective, [model, scale_only, with_bias], lambda g: _batch("pair", model, g))
    assert not torch.equal(model.logit_scale.detach(), start)  # the model's scale trained
