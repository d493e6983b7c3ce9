"""GradCache refuses, with an error naming the cause, every encoder whose replay would not
recompute its first pass (issue 48: each case below gave a silently wrong gradient before):
randomness outside torch's generators (Python ``random``, numpy, a private
``torch.Generator``), a forward that reads grad mode, buffers updated in forward (a
counter, a running normaliser, spectral norm's power iteration), an in-place op on the
input, batch-norm reached through a ``lambda`` or ``functools.partial``; under DDP, towers
that bypass the DDP's forward and ranks whose gradients differ after the step.
``DDP(static_graph=True)`` works and equals the plain step.

Controls: the same encoders drawing from torch's generator, or without the state update,
are accepted and equal the plain step, so a refusal is not a refusal of everything."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import close_gloo, init_gloo, spawn_ranks
from test_grad_cache import A_IN, CHUNK, T_IN, D, Encoder, _grads, _inputs, _plain_step
from torch import Tensor, nn

from contrastive_losses import GradCache, InfoNCELoss

F64 = torch.float64


class Masked(nn.Module):
    """A linear layer whose output features are masked by ``draw(shape)`` (SpecAugment-like
    masks, drawn from whatever source ``draw`` uses)."""

    def __init__(self, draw: Callable[[tuple[int, ...]], Tensor]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(A_IN, D).double()
        self.draw = draw

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x)
        return h * self.draw(tuple(h.shape)).to(h.dtype)


_PRIVATE = torch.Generator().manual_seed(0)


def _python_random(shape: tuple[int, ...]) -> Tensor:
    return torch.tensor([random.random() > 0.3 for _ in range(shape[0] * shape[1])]).view(shape)


DRAWS: dict[str, Callable[[tuple[int, ...]], Tensor]] = {
    "python-random": _python_random,
    "numpy": lambda s: torch.from_numpy(np.random.rand(*s) > 0.3),  # noqa: NPY002 (the case)
    "private-generator": lambda s: torch.rand(s, generator=_PRIVATE) > 0.3,
    "grad-mode": lambda s: torch.full(s, 1.0 + 0.5 * torch.is_grad_enabled()),
}


def _step(audio_enc: Callable[..., Tensor], **kwargs: Any) -> Tensor:
    a, t = (x[:6] for x in _inputs(F64, k_captions=False))  # chunks of 3 and 3 (batch-norm)
    torch.manual_seed(0)
    text_enc = Encoder(T_IN, 0.0).double()
    return GradCache(InfoNCELoss(0.1).double(), CHUNK, **kwargs)(audio_enc, a, text_enc, t)


@pytest.mark.parametrize("source", list(DRAWS))
def test_randomness_outside_torch_is_refused(source: str) -> None:
    with pytest.raises(RuntimeError, match=r"replay of audio_encoder \(Masked\), chunk 0") as err:
        _step(Masked(DRAWS[source]))
    assert "randomness outside torch's global generators" in str(err.value)
    assert "partial" in str(err.value)


def test_torch_generator_masks_are_replayed() -> None:
    """Control: the same masks drawn from torch's global generator are replayed and the
    step equals the plain step on the same chunks."""
    loss_fn = InfoNCELoss(0.1).double()
    a, t = _inputs(F64, k_captions=False)
    results = []
    for cached in (False, True):
        audio_enc = Masked(lambda s: torch.rand(s) > 0.3)
        torch.manual_seed(0)
        text_enc = Encoder(T_IN, 0.0).double()
        torch.manual_seed(7)
        if cached:
            GradCache(loss_fn, CHUNK)(audio_enc, a, text_enc, t)
        else:
            _plain_step(loss_fn, audio_enc, a, text_enc, t, CHUNK)
        results.append(_grads(audio_enc))
    for key, value in results[0].items():
        torch.testing.assert_close(results[1][key], value, rtol=1e-10, atol=1e-12)


class Stateful(nn.Module):
    """A linear layer with state updated in forward: a counter (in place or reassigned)
    or a running normaliser of its output."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(A_IN, D).double()
        self.kind = kind
        self.register_buffer("count", torch.zeros((), dtype=F64))
        self.register_buffer("mean", torch.zeros(D, dtype=F64))

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x)
        if self.kind == "counter":
            self.count += 1
        elif self.kind == "reassigned":
            self.count = self.count + 1
        elif self.kind == "normaliser":
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * h.mean(0))
            return h - self.mean
        return h * (1 + 0.1 * self.count)


@pytest.mark.parametrize("kind", ["counter", "reassigned", "normaliser"])
def test_buffers_updated_in_forward_are_refused(kind: str) -> None:
    enc = Stateful(kind)
    with pytest.raises(
        ValueError, match=r"audio_encoder: its forward changed buffers \(Stateful\.(count|mean)\)"
    ):
        _step(enc)
    assert float(enc.count) == (2 if kind != "normaliser" else 0)  # 2 chunks, once each


@pytest.mark.parametrize("style", ["utils", "parametrizations"])
def test_spectral_norm_in_training_mode_is_refused(style: str) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(A_IN, D).double()
    norm = nn.utils.spectral_norm if style == "utils" else nn.utils.parametrizations.spectral_norm
    enc = norm(lin)
    with pytest.raises(ValueError, match=r"changed buffers \(.*_u.*spectral norm"):
        _step(enc)
    enc.eval()  # the fix the message gives: no power iteration in the step
    _step(enc)


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(A_IN, D).double()

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x.clamp_(min=0))


def test_in_place_op_on_the_input_is_refused() -> None:
    with pytest.raises(ValueError, match=r"audio_inputs was modified in place by the encoder"):
        _step(InPlace())


def _bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(A_IN, D), nn.BatchNorm1d(D)).double()


def _apply(model: nn.Module, x: Tensor) -> Tensor:
    return model(x)


WRAPPERS: dict[str, Callable[[nn.Module], Callable[..., Tensor]]] = {
    "lambda": lambda m: lambda x: m(x),
    "partial": lambda m: functools.partial(_apply, m),
}


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_batch_norm_behind_a_wrapper(wrapper: str) -> None:
    """Found by the modules called, not by the encoder's type: refused by default;
    ``per_chunk`` equals the plain step on chunks and updates the running statistics once
    per chunk (as that step does), not twice."""
    model = _bn_model()
    with pytest.raises(ValueError, match=r"audio_encoder: batch-norm layers in training mode"):
        _step(WRAPPERS[wrapper](model))
    assert int(model[1].num_batches_tracked) == 0  # refused before the layer ran

    loss_fn = InfoNCELoss(0.1).double()
    a, t = (x[:6] for x in _inputs(F64, k_captions=False))
    torch.manual_seed(0)
    text_enc = Encoder(T_IN, 0.0).double()
    plain = _bn_model()
    _plain_step(loss_fn, plain, a, text_enc, t, CHUNK)
    expected = _grads(plain)
    cached = _bn_model()
    GradCache(loss_fn, CHUNK, batch_norm="per_chunk")(WRAPPERS[wrapper](cached), a, text_enc, t)
    got = _grads(cached)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-10, atol=1e-12, msg=key)
    for name, buffer in plain[1].named_buffers():
        torch.testing.assert_close(dict(cached[1].named_buffers())[name], buffer, msg=name)


def test_check_replay_argument() -> None:
    with pytest.raises(TypeError, match="check_replay: expected True or False"):
        GradCache(InfoNCELoss(0.1), 2, check_replay=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="validate_args"):
        GradCache(InfoNCELoss(0.1), 2, validate_args="yes")  # type: ignore[arg-type]


# --- two gloo ranks ------------------------------------------------------------------------


class TwoTowers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.audio = Encoder(A_IN, 0.0).double()
        self.text = Encoder(T_IN, 0.0).double()

    def encode_audio(self, x: Tensor) -> Tensor:
        return self.audio(x)

    def encode_text(self, x: Tensor) -> Tensor:
        return self.text(x)


def _error(fn: Callable[[], object]) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _ddp_cases(rank: int, a: Tensor, t: Tensor) -> dict[str, Any]:
    ddp_cls = nn.parallel.DistributedDataParallel
    loss_fn = InfoNCELoss(0.1, gather=True).double()
    out: dict[str, Any] = {}
    ddp = ddp_cls(TwoTowers())
    m = ddp.module
    out["bound-methods"] = _error(
        lambda: GradCache(loss_fn, 2)(m.encode_audio, a, m.encode_text, t)
    )
    out["submodules"] = _error(lambda: GradCache(loss_fn, 2)(m.audio, a, m.text, t))
    out["lambda"] = _error(
        lambda: GradCache(loss_fn, 2)(lambda x: m.encode_audio(x), a, m.encode_text, t)
    )

    def local_only(state, bucket):  # type: ignore[no-untyped-def]
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(bucket.buffer())  # no all-reduce: each rank keeps its own gradient
        return fut

    for validate in (True, False):
        torch.manual_seed(0)
        audio, text = ddp_cls(Encoder(A_IN, 0.0).double()), ddp_cls(Encoder(T_IN, 0.0).double())
        audio.register_comm_hook(None, local_only)
        text.register_comm_hook(None, local_only)
        step = functools.partial(GradCache(loss_fn, 2, validate_args=validate), audio, a, text, t)
        out[f"local-grads-validate-{validate}"] = _error(step)

    for mode in ("plain", "cached"):  # static_graph: fresh DDPs, one step each
        torch.manual_seed(0)
        kw = {"static_graph": True}
        audio, text = (
            ddp_cls(Encoder(A_IN, 0.0).double(), **kw),
            ddp_cls(Encoder(T_IN, 0.0).double(), **kw),
        )
        if mode == "plain":
            loss_fn(audio(a), text(t)).backward()
        else:
            GradCache(loss_fn, 2)(audio, a, text, t)
        out[f"static-{mode}"] = _grads(audio.module, text.module)
    return out


def _rank_worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    init_gloo(rank, world, init_method, timeout_s=120)
    try:
        g = torch.Generator().manual_seed(20 + rank)
        a = torch.randn(5, A_IN, generator=g, dtype=F64)
        t = torch.randn(5, T_IN, generator=g, dtype=F64)
        torch.save(_ddp_cases(rank, a, t), Path(out_dir) / f"rank{rank}.pt")
    finally:
        close_gloo()


def test_ddp_cases_on_two_gloo_ranks(tmp_path: Path) -> None:
    """Towers reached around their DDP (bound methods of ``ddp.module``, its submodules, a
    lambda) are refused on every rank; ranks whose gradients differ after the step (a comm
    hook that keeps each rank's own) raise on every rank unless ``validate_args=False``;
    ``static_graph=True`` equals the plain step and the ranks agree."""
    results = spawn_ranks(_rank_worker, tmp_path, world=2, deadline_s=240)
    for r in results:
        for case in ("bound-methods", "submodules", "lambda"):
            assert r[case].startswith("ValueError: audio_encoder"), (case, r[case])
            assert "DistributedDataParallel(TwoTowers)" in r[case], r[case]
            assert "Wrap each tower in its own DDP" in r[case]
        assert "TwoTowers.encode_audio" in r["bound-methods"]
        assert r["local-grads-validate-True"].startswith(
            "RuntimeError: GradCache: after the step the gradients of audio_encoder"
        ), r["local-grads-validate-True"]
        assert r["local-grads-validate-False"] == "no error"
        assert sorted(r["static-cached"]) == sorted(r["static-plain"])
        for key, value in r["static-plain"].items():
            torch.testing.assert_close(r["static-cached"][key], value, rtol=1e-10, atol=1e-12)
    for key, value in results[0]["static-cached"].items():
        torch.testing.assert_close(results[1]["static-cached"][key], value, rtol=0, atol=0)
