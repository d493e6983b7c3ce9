"""GradCache (Gao et al. 2021) equals the plain step: the loss and every gradient (both
encoders and the loss's own parameters), for every loss, dense and tiled, float64 and float32,
with dropout in both encoders; K captions with a mask; token mappings; RNG left as the plain
step leaves it; no encoder call with autograd over more than ``chunk_size`` rows; a GradScaler
under CPU bfloat16 autocast; two gloo ranks under DDP with one all-reduce per step.

The plain step that the cached step must equal runs each encoder with autograd on the same
chunks in the same order (``_plain_step``): dropout then draws the same masks from the same
generator, which is what "replayed exactly" means. Without dropout the chunked plain step is
the literal ``loss_fn(audio_encoder(a), text_encoder(t)).backward()``; a test checks that
too."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import close_gloo, init_gloo, spawn_ranks
from torch import Tensor, nn

from contrastive_losses import (
    ASKLoss,
    CACLLoss,
    GradCache,
    InfoNCELoss,
    KCLLoss,
    KnowledgeBank,
    SigLIPLoss,
    SupportVectorRegularizer,
)

B, K, D, A_IN, T_IN, CHUNK = 7, 3, 6, 5, 4, 3


class Encoder(nn.Module):
    """Two layers with dropout; works on ``(b, F)`` and on ``(b, K, F)`` rows."""

    def __init__(self, features: int, dropout: float) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, 8), nn.Tanh(), nn.Dropout(dropout), nn.Linear(8, D)
        )
        self.calls: list[tuple[int, bool]] = []  # (rows, grad enabled) of every call

    def forward(self, x: Tensor) -> Tensor:
        self.calls.append((x.shape[0], torch.is_grad_enabled()))
        return self.net(x)


class TokenEncoder(nn.Module):
    """Masked mean of token embeddings, dropout, projection: takes a tokenizer's mapping."""

    def __init__(self, vocab: int = 11, dropout: float = 0.2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 8)
        self.drop = nn.Dropout(dropout)
        self.proj = nn.Linear(8, D)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        m = attention_mask.unsqueeze(-1).to(self.embed.weight.dtype)
        pooled = (self.embed(input_ids) * m).sum(1) / m.sum(1).clamp_min(1)
        return self.proj(self.drop(pooled))


def _bank(dtype: torch.dtype) -> KnowledgeBank:
    g = torch.Generator().manual_seed(5)
    kb = KnowledgeBank(D, backend="torch", num_prototypes=3, dtype=dtype)
    kb.build(torch.randn(20, D, generator=g), torch.randn(20, D, generator=g), torch.arange(20))
    return kb


def _loss(name: str, tiled: bool, dtype: torch.dtype) -> tuple[nn.Module, bool, dict[str, Any]]:
    """(loss, text has K captions, loss kwargs)."""
    chunk = {"chunk_size": 2} if tiled else {}
    g = torch.Generator().manual_seed(9)
    mask = torch.rand(B, K, generator=g) > 0.3
    mask[:, 0] = True
    kwargs: dict[str, Any] = {}
    if name == "infonce":
        loss: nn.Module = InfoNCELoss(0.1, learnable_temperature=True, **chunk)
    elif name == "siglip":
        loss = SigLIPLoss(**chunk)
    elif name == "kcl":
        loss, kwargs = KCLLoss(0.1, learnable_temperature=True, **chunk), {"mask": mask}
    elif name == "cacl":
        langs = torch.randint(1, K, (B,), generator=g)
        mask[torch.arange(B), langs] = True
        loss = CACLLoss(0.1, learnable_temperature=True, **chunk)
        kwargs = {"other": langs, "mask": mask}
    elif name in ("svr-static", "svr-dynamic"):
        base = InfoNCELoss(0.1, learnable_temperature=True, **chunk)
        loss = SupportVectorRegularizer(base=base, radius=name.split("-")[1], num_features=4)
    elif name == "ask":
        loss, kwargs = (
            ASKLoss(_bank(dtype), k=3, k_coarse=2, temperature=0.1),
            {"ids": torch.arange(100, 100 + B)},
        )
    else:  # pragma: no cover - the parametrisation lists every name
        raise AssertionError(name)
    return loss.to(dtype), name in ("kcl", "cacl"), kwargs


def _models(dtype: torch.dtype, dropout: float = 0.3) -> tuple[Encoder, Encoder]:
    torch.manual_seed(0)
    return Encoder(A_IN, dropout).to(dtype), Encoder(T_IN, dropout).to(dtype)


def _inputs(dtype: torch.dtype, k_captions: bool) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    text_shape = (B, K, T_IN) if k_captions else (B, T_IN)
    return (
        torch.randn(B, A_IN, generator=g, dtype=dtype),
        torch.randn(*text_shape, generator=g, dtype=dtype),
    )


def _grads(*modules: nn.Module) -> dict[str, Tensor]:
    return {
        f"{i}.{name}": p.grad.detach().clone()
        for i, module in enumerate(modules)
        for name, p in module.named_parameters()
        if p.grad is not None
    }


def _zero(*modules: nn.Module) -> None:
    for module in modules:
        module.zero_grad(set_to_none=True)


def _plain_step(loss_fn: Callable[..., Any], audio_enc, a, text_enc, t, chunk, **kwargs):
    """The ordinary step, each encoder run with autograd chunk by chunk (same RNG draws)."""
    u = torch.cat([audio_enc(c) for c in a.split(chunk)])
    v = torch.cat([text_enc(c) for c in t.split(chunk)])
    loss = loss_fn(u, v, **kwargs)
    loss.backward()
    return loss.detach()


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return (
        {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 2e-5, "atol": 1e-6}
    )


LOSSES = ["infonce", "siglip", "kcl", "cacl", "svr-static", "svr-dynamic", "ask"]
# ASKLoss has no chunk_size (its Sinkhorn plan needs the whole B x B): dense only
CASES = [
    (name, tiled) for name in LOSSES for tiled in (False, True) if not (name == "ask" and tiled)
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize(
    ("name", "tiled"), CASES, ids=[f"{n}-{'tiled' if t else 'dense'}" for n, t in CASES]
)
def test_equals_the_plain_step(name: str, tiled: bool, dtype: torch.dtype) -> None:
    loss_fn, k_captions, kwargs = _loss(name, tiled, dtype)
    audio_enc, text_enc = _models(dtype)
    a, t = _inputs(dtype, k_captions)

    torch.manual_seed(42)
    expected_loss = _plain_step(loss_fn, audio_enc, a, text_enc, t, CHUNK, **kwargs)
    expected = _grads(audio_enc, text_enc, loss_fn)
    rng_after_plain = torch.get_rng_state()
    _zero(audio_enc, text_enc, loss_fn)
    audio_enc.calls.clear()
    text_enc.calls.clear()

    torch.manual_seed(42)
    got_loss = GradCache(loss_fn, chunk_size=CHUNK)(audio_enc, a, text_enc, t, **kwargs)
    got = _grads(audio_enc, text_enc, loss_fn)

    assert not got_loss.requires_grad
    torch.testing.assert_close(got_loss, expected_loss, **_tolerance(dtype))
    assert sorted(got) == sorted(expected)
    loss_params = {f"2.{n}" for n, p in loss_fn.named_parameters() if p.requires_grad}
    assert loss_params <= set(got)  # the loss's own parameters got their gradient
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], **_tolerance(dtype), msg=key)
    assert torch.equal(torch.get_rng_state(), rng_after_plain)
    for enc in (audio_enc, text_enc):  # no grad-enabled call over chunk_size rows
        assert max(rows for rows, grad in enc.calls if grad) <= CHUNK
        assert sum(rows for rows, grad in enc.calls if grad) == B


def test_without_dropout_equals_the_literal_plain_step() -> None:
    loss_fn = KCLLoss(0.1, learnable_temperature=True).double()
    audio_enc, text_enc = _models(torch.float64, dropout=0.0)
    a, t = _inputs(torch.float64, k_captions=True)
    mask = torch.ones(B, K, dtype=torch.bool)
    mask[2, 1:] = False
    loss = loss_fn(audio_enc(a), text_enc(t), mask=mask)
    loss.backward()
    expected = _grads(audio_enc, text_enc, loss_fn)
    _zero(audio_enc, text_enc, loss_fn)
    got_loss = GradCache(loss_fn, chunk_size=2)(audio_enc, a, text_enc, t, mask=mask)
    torch.testing.assert_close(got_loss, loss.detach(), rtol=1e-12, atol=0)
    got = _grads(audio_enc, text_enc, loss_fn)
    assert sorted(got) == sorted(expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-10, atol=1e-13, msg=key)


def test_dropout_is_replayed_not_redrawn() -> None:
    """With the RNG not restored the replay would draw new masks: the cached gradients would
    belong to another forward. A control (the same step with the replay's RNG restore
    disabled) is refused by the replay check, and with the check off it differs, so the
    equality above is not trivial."""
    loss_fn = InfoNCELoss(0.1).double()
    audio_enc, text_enc = _models(torch.float64, dropout=0.5)
    a, t = _inputs(torch.float64, k_captions=False)
    torch.manual_seed(3)
    _plain_step(loss_fn, audio_enc, a, text_enc, t, CHUNK)
    expected = _grads(audio_enc, text_enc)
    _zero(audio_enc, text_enc)
    torch.manual_seed(3)
    from contrastive_losses import grad_cache

    original = grad_cache._RngState.replay
    grad_cache._RngState.replay = lambda self: torch.random.fork_rng()  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match=r"replay of audio_encoder \(Encoder\), chunk 0"):
            GradCache(loss_fn, CHUNK)(audio_enc, a, text_enc, t)
        _zero(audio_enc, text_enc)
        torch.manual_seed(3)
        GradCache(loss_fn, CHUNK, check_replay=False)(audio_enc, a, text_enc, t)
    finally:
        grad_cache._RngState.replay = original  # type: ignore[method-assign]
    got = _grads(audio_enc, text_enc)
    assert any(not torch.allclose(got[k], expected[k]) for k in expected)


def test_token_mappings_and_return_terms() -> None:
    """A tokenizer's mapping is split row-wise and passed as keywords; ``return_terms``
    passes through and the loss comes back detached."""
    torch.manual_seed(0)
    audio_enc, text_enc = Encoder(A_IN, 0.2).double(), TokenEncoder().double()
    loss_fn = SigLIPLoss().double()
    g = torch.Generator().manual_seed(2)
    a = torch.randn(B, A_IN, generator=g, dtype=torch.float64)
    tokens = {
        "input_ids": torch.randint(0, 11, (B, 5), generator=g),
        "attention_mask": (torch.rand(B, 5, generator=g) > 0.3).long(),
    }
    torch.manual_seed(4)
    u = torch.cat([audio_enc(c) for c in a.split(2)])
    v = torch.cat(
        [text_enc(i, m) for i, m in zip(tokens["input_ids"].split(2),
                                        tokens["attention_mask"].split(2), strict=True)]
    )  # fmt: skip
    loss, terms = loss_fn(u, v, return_terms=True)
    loss.backward()
    expected = _grads(audio_enc, text_enc, loss_fn)
    _zero(audio_enc, text_enc, loss_fn)
    torch.manual_seed(4)
    got_loss, got_terms = GradCache(loss_fn, 2)(audio_enc, a, text_enc, tokens, return_terms=True)
    assert not got_loss.requires_grad
    torch.testing.assert_close(got_loss, loss.detach())
    assert sorted(got_terms) == sorted(terms)
    got = _grads(audio_enc, text_enc, loss_fn)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-10, atol=1e-12, msg=key)


AMP_CASES = [
    pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),
    pytest.param(
        "cuda",
        torch.float16,
        id="cuda-f16",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]


def _rng_states(device: str) -> list[Tensor]:
    states = [torch.get_rng_state()]
    return states + ([torch.cuda.get_rng_state()] if device == "cuda" else [])


@pytest.mark.parametrize(("device", "amp_dtype"), AMP_CASES)
def test_grad_scaler_under_autocast(device: str, amp_dtype: torch.dtype) -> None:
    """The cached gradients are scaled once: the encoders' gradients are the scaled plain
    gradients (autocast, float32 weights, a scale of 2**10, dropout replayed from the
    device's generator); every generator ends where the plain step leaves it."""
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10)
    loss_fn = InfoNCELoss(0.1, learnable_temperature=True).to(device)
    audio_enc, text_enc = (m.to(device) for m in _models(torch.float32, dropout=0.2))
    a, t = (x.to(device) for x in _inputs(torch.float32, k_captions=False))

    torch.manual_seed(8)
    with torch.autocast(device, dtype=amp_dtype):
        u = torch.cat([audio_enc(c) for c in a.split(CHUNK)])
        v = torch.cat([text_enc(c) for c in t.split(CHUNK)])
        loss = loss_fn(u.float(), v.float())
    scaler.scale(loss).backward()
    expected = _grads(audio_enc, text_enc, loss_fn)
    rng_after_plain = _rng_states(device)
    _zero(audio_enc, text_enc, loss_fn)

    torch.manual_seed(8)
    cache = GradCache(lambda u, v: loss_fn(u.float(), v.float()), CHUNK, scaler=scaler)
    with torch.autocast(device, dtype=amp_dtype):
        got_loss = cache(audio_enc, a, text_enc, t)
    torch.testing.assert_close(got_loss, loss.detach())
    for got_state, plain_state in zip(_rng_states(device), rng_after_plain, strict=True):
        assert torch.equal(got_state, plain_state)
    got = _grads(audio_enc, text_enc, loss_fn)
    assert sorted(got) == sorted(expected)
    for key in expected:  # half-precision matmuls per chunk vs over the batch: a few ulps
        bound = 2.0**-5 * float(expected[key].abs().max())
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=bound, msg=key)
    # and scaled once, not per chunk: the unscaled cached step is 2**10 times smaller
    # (exactly: a power of two commutes with rounding)
    _zero(audio_enc, text_enc, loss_fn)
    torch.manual_seed(8)
    with torch.autocast(device, dtype=amp_dtype):
        GradCache(lambda u, v: loss_fn(u.float(), v.float()), CHUNK)(audio_enc, a, text_enc, t)
    unscaled = _grads(audio_enc, text_enc, loss_fn)
    for key in expected:
        torch.testing.assert_close(got[key], unscaled[key] * 2.0**10, rtol=0, atol=0, msg=key)


def _bn_encoder() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(A_IN, D), nn.BatchNorm1d(D)).double()


def test_batch_norm_in_training_mode() -> None:
    """Refused by default; ``per_chunk`` is the plain step on chunks (each chunk normalised by
    its own statistics), the running statistics updated once per chunk, not twice."""
    loss_fn = InfoNCELoss(0.1).double()
    text_enc = Encoder(T_IN, 0.0).double()
    a, t = (x[:6] for x in _inputs(torch.float64, k_captions=False))  # chunks of 3 and 3
    with pytest.raises(ValueError, match=r"audio_encoder: batch-norm layers in training mode"):
        GradCache(loss_fn, CHUNK)(_bn_encoder(), a, text_enc, t)

    plain = _bn_encoder()
    _plain_step(loss_fn, plain, a, text_enc, t, CHUNK)
    expected = _grads(plain, text_enc)
    _zero(text_enc)
    cached = _bn_encoder()
    GradCache(loss_fn, CHUNK, batch_norm="per_chunk")(cached, a, text_enc, t)
    got = _grads(cached, text_enc)
    assert sorted(got) == sorted(expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-10, atol=1e-12, msg=key)
    for name, buffer in plain[1].named_buffers():
        torch.testing.assert_close(dict(cached[1].named_buffers())[name], buffer, msg=name)
    assert int(cached[1].num_batches_tracked) == 2
    cached.eval()  # statistics frozen: allowed by default
    GradCache(loss_fn, CHUNK)(cached, a, text_enc, t)
    one_chunk = _bn_encoder()  # one chunk holds the batch: the plain step, allowed
    _zero(text_enc)
    GradCache(loss_fn, 6)(one_chunk, a, text_enc, t)
    plain = _bn_encoder()
    _plain_step(loss_fn, plain, a, text_enc, t, 6)
    torch.testing.assert_close(one_chunk[0].weight.grad, plain[0].weight.grad)
    assert int(one_chunk[1].num_batches_tracked) == 1


def test_frozen_tower_and_bound_methods() -> None:
    """A frozen text tower gets no replay; an encoder may be a bound method."""
    loss_fn = InfoNCELoss(0.1).double()
    audio_enc, text_enc = _models(torch.float64, dropout=0.0)
    text_enc.requires_grad_(False)
    a, t = _inputs(torch.float64, k_captions=False)
    loss = loss_fn(audio_enc(a), text_enc(t))
    loss.backward()
    expected = _grads(audio_enc)
    _zero(audio_enc)
    text_enc.calls.clear()
    GradCache(loss_fn, CHUNK)(audio_enc.forward, a, text_enc.forward, t)
    got = _grads(audio_enc, text_enc)
    assert sorted(got) == sorted(expected)
    assert [grad for _, grad in text_enc.calls] == [False, False, False, True]


@pytest.mark.parametrize(
    ("args", "call", "error", "match"),
    [
        ({"chunk_size": 0}, None, ValueError, "chunk_size: expected an int >= 1, got 0"),
        ({"chunk_size": True}, None, ValueError, "chunk_size"),
        ({"chunk_size": 2, "batch_norm": "x"}, None, ValueError, "batch_norm: expected one of"),
        ({"chunk_size": 2, "scaler": 3}, None, TypeError, "scaler: expected a torch.amp"),
        ({"chunk_size": 2}, {"t": "text"}, TypeError, "text_inputs: expected a Tensor"),
        ({"chunk_size": 2}, {"t": {"a": torch.ones(7, 2), "b": torch.ones(6, 2)}},
         ValueError, "text_inputs: every tensor must have the same size along dim 0"),
        ({"chunk_size": 2}, {"t": torch.ones(0, 4)}, ValueError, "text_inputs: empty batch"),
        ({"chunk_size": 2}, {"t": {"a": [1, 2]}}, TypeError, r"text_inputs\['a'\]: expected"),
        ({"chunk_size": 2}, {"loss": InfoNCELoss(0.1, reduction="none")}, ValueError,
         "loss_fn: GradCache needs a scalar loss"),
    ],
)  # fmt: skip
def test_bad_input_is_named(args, call, error, match) -> None:
    audio_enc, text_enc = _models(torch.float32, dropout=0.0)
    a, t = _inputs(torch.float32, k_captions=False)
    call = call or {}
    with pytest.raises(error, match=match):
        cache = GradCache(call.get("loss", InfoNCELoss(0.1)), **args)
        cache(audio_enc, a, text_enc, call.get("t", t))


def test_refuses_no_grad_and_non_tensor_outputs() -> None:
    audio_enc, text_enc = _models(torch.float32, dropout=0.0)
    a, t = _inputs(torch.float32, k_captions=False)
    cache = GradCache(InfoNCELoss(0.1), 2)
    with torch.no_grad(), pytest.raises(RuntimeError, match="gradients disabled"):
        cache(audio_enc, a, text_enc, t)
    with pytest.raises(TypeError, match="text_encoder: the encoder must return a Tensor"):
        cache(audio_enc, a, lambda x: {"emb": text_enc(x)}, t)


# --- two gloo ranks under DDP ---------------------------------------------------------------

SIZES = (5, 3)


def _rank_steps(rank: int, world: int) -> dict[str, Any]:
    """The plain and the cached DDP step on this rank (the DDPs die on return)."""
    g = torch.Generator().manual_seed(10 + rank)
    n = SIZES[rank]
    a = torch.randn(n, A_IN, generator=g, dtype=torch.float64)
    t = torch.randn(n, K, T_IN, generator=g, dtype=torch.float64)
    mask = torch.rand(n, K, generator=g) > 0.3
    mask[:, 0] = True
    out: dict[str, Any] = {}
    for mode in ("plain", "cached"):
        torch.manual_seed(0)  # same weights on both ranks
        audio_enc = nn.parallel.DistributedDataParallel(Encoder(A_IN, 0.0).double())
        text_enc = nn.parallel.DistributedDataParallel(Encoder(T_IN, 0.0).double())
        loss_fn = KCLLoss(0.1, learnable_temperature=True, gather=True).double()
        reductions = [0]

        def hook(state, bucket, reductions=reductions):  # type: ignore[no-untyped-def]
            reductions[0] += 1  # (no annotations: DDP checks them, and they are strings)
            fut = dist.all_reduce(bucket.buffer() / world, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])

        audio_enc.register_comm_hook(None, hook)
        text_enc.register_comm_hook(None, hook)
        torch.manual_seed(100 + rank)
        if mode == "plain":  # DDP wants one forward per backward: the whole batch
            loss = loss_fn(audio_enc(a), text_enc(t), mask=mask)
            loss.backward()
            loss = loss.detach()
        else:
            loss = GradCache(loss_fn, 2)(audio_enc, a, text_enc, t, mask=mask)
        out[mode] = {
            "loss": loss,
            "grads": _grads(audio_enc.module, text_enc.module, loss_fn),
            "reductions": reductions[0],
        }
    return out


def _rank_worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    init_gloo(rank, world, init_method, timeout_s=120)
    try:
        torch.save(_rank_steps(rank, world), Path(out_dir) / f"rank{rank}.pt")
    finally:
        close_gloo()


def test_two_gloo_ranks_under_ddp(tmp_path: Path) -> None:
    """KCL gathered across 2 ranks of uneven batches (5, 3), DDP encoders: the
    cached step equals the plain DDP step on each rank, and each encoder's gradients are
    all-reduced once (the comm hook fires as often as in the plain step: one bucket each)."""
    results = spawn_ranks(_rank_worker, tmp_path, world=2, deadline_s=240)
    for r in results:
        torch.testing.assert_close(r["cached"]["loss"], r["plain"]["loss"], rtol=1e-12, atol=0)
        assert sorted(r["cached"]["grads"]) == sorted(r["plain"]["grads"])
        for key, value in r["plain"]["grads"].items():
            torch.testing.assert_close(r["cached"]["grads"][key], value, rtol=1e-10, atol=1e-12)
        # plain: one backward, one all-reduce per encoder; cached: the same, not one per chunk
        assert r["plain"]["reductions"] == 2
        assert r["cached"]["reductions"] == 2
    # DDP averaged the encoders' gradients: both ranks hold the same
    for key in results[0]["cached"]["grads"]:
        if not key.startswith("2."):
            torch.testing.assert_close(
                results[0]["cached"]["grads"][key], results[1]["cached"]["grads"][key]
            )
