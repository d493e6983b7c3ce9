"""MatryoshkaLoss: the base's loss summed over nested, re-normalised prefixes.

Every value is compared with an explicit loop over the dims of the plain loss on the
sliced and normalised embeddings (``_reference``), forward and backward, dense and tiled,
under GradCache, compiled with ``fullgraph=True`` and across 2 gloo ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import init_gloo, outlasting, rank_data, rank_rows, spawn_ranks
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from contrastive_losses import (
    ASKLoss,
    CACLLoss,
    GradCache,
    InfoNCELoss,
    KCLLoss,
    KnowledgeBank,
    MatryoshkaLoss,
    SigLIPLoss,
    SupportVectorRegularizer,
)
from contrastive_losses import _gather as gather_module
from contrastive_losses.metrics import audio_text_retrieval, retrieval_report

B, K, D = 6, 3, 8
DIMS = (8, 4, 2)
WEIGHTS = (1.0, 0.5, 2.0)
F64 = {"rtol": 1e-10, "atol": 1e-12}


def _base(name: str, chunk_size: int | None = None) -> nn.Module:
    return {
        "infonce": lambda: InfoNCELoss(learnable_temperature=True, chunk_size=chunk_size),
        "infonce_unnormalized": lambda: InfoNCELoss(normalize=False, chunk_size=chunk_size),
        "siglip": lambda: SigLIPLoss(chunk_size=chunk_size),
        "kcl": lambda: KCLLoss(learnable_temperature=True, chunk_size=chunk_size),
        "cacl": lambda: CACLLoss(chunk_size=chunk_size),
        "svr_infonce": lambda: SupportVectorRegularizer(
            InfoNCELoss(chunk_size=chunk_size), radius="static"
        ),
        "svr_kcl": lambda: SupportVectorRegularizer(KCLLoss(chunk_size=chunk_size)),
    }[name]()


def _inputs(name: str, seed: int = 0, dtype: torch.dtype = torch.float64) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(B, D, generator=g, dtype=dtype, requires_grad=True)
    if "kcl" in name:
        t = torch.randn(B, K, D, generator=g, dtype=dtype, requires_grad=True)
        mask = torch.rand(B, K, generator=g) < 0.7
        mask[:, 0] = True
        return (a, t, mask), {}
    t = torch.randn(B, D, generator=g, dtype=dtype, requires_grad=True)
    if name == "cacl":
        other = torch.randn(B, D, generator=g, dtype=dtype, requires_grad=True)
        return (a, t, other), {}
    return (a, t), {"ids": torch.tensor([0, 1, 2, 0, 3, 4])} if name == "siglip" else {}


def _reference(base: nn.Module, dims, weights, *args, **kwargs) -> torch.Tensor:
    """The plain loop: the base on each prefix, sliced and normalised here."""
    total = 0
    for d, w in zip(dims, weights, strict=True):
        cut = [
            F.normalize(x[..., :d], dim=-1) if x.is_floating_point() and x.dim() >= 2 else x
            for x in args
        ]
        total = total + w * base(*cut, **kwargs)
    return total


def _grads(loss: torch.Tensor, args: tuple, module: nn.Module) -> list[torch.Tensor]:
    leaves = [x for x in args if x.requires_grad] + [
        p for p in module.parameters() if p.requires_grad
    ]
    return list(torch.autograd.grad(loss, leaves))


BASES = ["infonce", "infonce_unnormalized", "siglip", "kcl", "cacl", "svr_infonce", "svr_kcl"]


@pytest.mark.parametrize("name", BASES)
@pytest.mark.parametrize("chunk_size", [None, 2], ids=["dense", "tiled"])
def test_equals_the_loop_over_dims(name: str, chunk_size: int | None) -> None:
    """Value and gradients (inputs and the base's parameters) of the plain loop; the
    unnormalised base checks that the wrapper re-normalises the prefixes itself."""
    base = _base(name, chunk_size)
    args, kwargs = _inputs(name)
    loss = MatryoshkaLoss(base, DIMS, WEIGHTS)(*args, **kwargs)
    expected = _reference(base, DIMS, WEIGHTS, *args, **kwargs)
    torch.testing.assert_close(loss, expected, **F64)
    for got, want in zip(_grads(loss, args, base), _grads(expected, args, base), strict=True):
        torch.testing.assert_close(got, want, **F64)


@pytest.mark.parametrize("name", ["infonce", "siglip", "kcl", "svr_infonce"])
def test_tiled_equals_dense(name: str) -> None:
    args, kwargs = _inputs(name, seed=1)
    dense = MatryoshkaLoss(_base(name), DIMS)(*args, **kwargs)
    tiled = MatryoshkaLoss(_base(name, chunk_size=2), DIMS)(*args, **kwargs)
    torch.testing.assert_close(tiled, dense, **F64)
    grads = torch.autograd.grad(dense, args[:2]), torch.autograd.grad(tiled, args[:2])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, **F64)


def test_return_terms() -> None:
    args, _ = _inputs("infonce")
    base = InfoNCELoss()
    loss, terms = MatryoshkaLoss(base, DIMS, WEIGHTS)(*args, return_terms=True)
    _, base_terms = base(args[0][:, :8], args[1][:, :8], return_terms=True)
    assert set(terms) == set(base_terms) | {"loss@8", "loss@4", "loss@2"}
    for d in DIMS:
        assert not terms[f"loss@{d}"].requires_grad
        torch.testing.assert_close(terms[f"loss@{d}"], base(args[0][:, :d], args[1][:, :d]))
    weighted = sum(w * terms[f"loss@{d}"] for d, w in zip(DIMS, WEIGHTS, strict=True))
    torch.testing.assert_close(loss.detach(), weighted)


def test_reduction_none_is_per_sample() -> None:
    args, _ = _inputs("infonce")
    base = InfoNCELoss(reduction="none")
    loss = MatryoshkaLoss(base, DIMS, WEIGHTS)(*args)
    assert loss.shape == (B,)
    torch.testing.assert_close(loss, _reference(base, DIMS, WEIGHTS, *args), **F64)


def test_gradcheck_float64() -> None:
    g = torch.Generator().manual_seed(3)
    a = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    tk = torch.randn(4, 2, 6, generator=g, dtype=torch.float64, requires_grad=True)
    for base in (InfoNCELoss(temperature=0.5), KCLLoss(temperature=0.5), SigLIPLoss()):
        loss_fn = MatryoshkaLoss(base, (6, 3, 1), (1.0, 0.5, 0.25))
        text = tk if isinstance(base, KCLLoss) else t
        assert torch.autograd.gradcheck(lambda x, y, f=loss_fn: f(x, y), (a, text))


@given(
    b=st.integers(2, 6),
    d=st.integers(1, 12),
    seed=st.integers(0, 2**16),
    scale=st.floats(0.1, 10.0),
)
def test_one_full_dim_is_the_base_and_weights_scale_linearly(
    b: int, d: int, seed: int, scale: float
) -> None:
    g = torch.Generator().manual_seed(seed)
    a, t = (torch.randn(b, d, generator=g, dtype=torch.float64) for _ in range(2))
    base = InfoNCELoss()
    torch.testing.assert_close(MatryoshkaLoss(base, (d,))(a, t), base(a, t), **F64)
    dims = tuple(range(d, 0, -max(1, d // 3)))
    weights = [1.0 + i for i in range(len(dims))]
    plain = MatryoshkaLoss(base, dims, weights)(a, t)
    scaled = MatryoshkaLoss(base, dims, [scale * w for w in weights])(a, t)
    torch.testing.assert_close(scaled, scale * plain, **F64)


class _Encoder(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, 8), nn.Tanh(), nn.Linear(8, D)).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_under_grad_cache_equals_the_plain_step() -> None:
    torch.manual_seed(0)
    encoders = _Encoder(5), _Encoder(4)
    loss_fn = MatryoshkaLoss(InfoNCELoss(learnable_temperature=True), DIMS, WEIGHTS)
    g = torch.Generator().manual_seed(1)
    a_in, t_in = (torch.randn(B, n, generator=g, dtype=torch.float64) for n in (5, 4))
    plain = loss_fn(encoders[0](a_in), encoders[1](t_in))
    plain.backward()
    modules = (*encoders, loss_fn)
    expected = [p.grad.clone() for m in modules for p in m.parameters()]
    for m in modules:
        m.zero_grad(set_to_none=True)
    cached = GradCache(loss_fn, chunk_size=2)(encoders[0], a_in, encoders[1], t_in)
    torch.testing.assert_close(cached, plain.detach(), **F64)
    got = [p.grad for m in modules for p in m.parameters()]
    for x, y in zip(got, expected, strict=True):
        torch.testing.assert_close(x, y, **F64)


@pytest.mark.parametrize("name", ["infonce", "kcl", "svr_infonce"])
def test_compiled_fullgraph_equals_eager(name: str) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    loss_fn = MatryoshkaLoss(_base(name), DIMS, WEIGHTS)
    args, kwargs = _inputs(name, dtype=torch.float32)
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    got = compiled(*args, **kwargs)
    want = loss_fn(*args, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for x, y in zip(_grads(got, args, loss_fn), _grads(want, args, loss_fn), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("dims", "weights", "error", "match"),
    [
        ((8, 8, 4), None, ValueError, "dims: must be strictly decreasing"),
        ((2, 4), None, ValueError, "dims: must be strictly decreasing"),
        ((4, 0), None, ValueError, "dims: every dim must be >= 1"),
        ((), None, ValueError, "dims: expected at least one"),
        ((4.0, 2), None, TypeError, "dims: expected ints"),
        (8, None, TypeError, "dims: expected a sequence"),
        ((8, 4), (1.0,), ValueError, "weights: expected one per dim"),
        ((8, 4), (1.0, 0.0), ValueError, "weights: each must be positive"),
        ((8, 4), (1.0, -2.0), ValueError, "weights: each must be positive"),
        ((8, 4), (1.0, float("nan")), ValueError, "weights: each must be positive"),
    ],
)
def test_bad_settings_name_the_argument(dims, weights, error, match) -> None:
    with pytest.raises(error, match=match):
        MatryoshkaLoss(InfoNCELoss(), dims, weights)


def test_bad_bases_are_refused_with_the_reason() -> None:
    with pytest.raises(TypeError, match="base: expected a loss Module"):
        MatryoshkaLoss(nn.Linear(2, 2), (2,))
    with pytest.raises(TypeError, match="base: ASKLoss retrieves its knowledge"):
        MatryoshkaLoss(ASKLoss(KnowledgeBank(dim=D, backend="torch")), (4,))
    with pytest.raises(TypeError, match="base: a MatryoshkaLoss inside"):
        MatryoshkaLoss(MatryoshkaLoss(InfoNCELoss(), (4,)), (2,))


def test_a_dim_beyond_the_embeddings_or_unequal_widths_raise() -> None:
    a, t = torch.randn(B, D), torch.randn(B, D)
    with pytest.raises(ValueError, match=r"dims: 16 exceeds the embeddings' dim D = 8"):
        MatryoshkaLoss(InfoNCELoss(), (16, 4))(a, t)
    # text of another width: cut to 4 both would look alike (a silent wrong loss)
    with pytest.raises(ValueError, match=r"inputs\[1\]: last dim 12 differs"):
        MatryoshkaLoss(InfoNCELoss(), (4,))(a, torch.randn(B, 12))


def test_metrics_dim_scores_the_renormalised_prefix() -> None:
    g = torch.Generator().manual_seed(2)
    audio, text = torch.randn(20, D, generator=g), torch.randn(20, 2, D, generator=g)
    # the prefix's scores differ from the full one's: a cut that was ignored would show
    assert audio_text_retrieval(audio, text, dim=2) != audio_text_retrieval(audio, text)
    assert audio_text_retrieval(audio, text, dim=2) == audio_text_retrieval(
        audio[:, :2], text[..., :2]
    )
    report = retrieval_report(audio, text, ["en", "fr"], dim=3)
    assert report == retrieval_report(audio[:, :3], text[..., :3], ["en", "fr"])
    assert audio_text_retrieval(audio, text, dim=D) == audio_text_retrieval(audio, text)
    for bad, error in ((0, ValueError), (D + 1, ValueError), (2.0, TypeError)):
        with pytest.raises(error, match="dim"):
            audio_text_retrieval(audio, text, dim=bad)
        with pytest.raises(error, match="dim"):
            retrieval_report(audio, text, ["en", "fr"], dim=bad)


# --------------------------------------------------------------------------- 2 gloo ranks

DIST_DIMS = (4, 2)
DIST_WEIGHTS = (1.0, 0.5)
DIST_BASES = ("infonce", "siglip", "kcl", "svr_infonce")


def _dist_args(name: str, rows: slice) -> tuple[tuple, dict]:
    """This rank's rows of the global batch of :func:`helpers.rank_data`, as leaves."""
    data = rank_data(k=K, d=4)
    a = data["audio"][rows].clone().requires_grad_(True)
    if "kcl" in name:
        t = data["text"][rows].clone().requires_grad_(True)
        return (a, t, data["mask"][rows]), {}
    t = data["text"][rows, 0].clone().requires_grad_(True)
    return (a, t), {"ids": data["ids"][rows]} if name == "siglip" else {}


def _dist_worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    init_gloo(rank, world, init_method)
    calls = []
    gather = gather_module._autograd_all_gather

    def counted(x: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return gather(x)

    gather_module._autograd_all_gather = counted
    out = {}
    for name in DIST_BASES:
        for how in ("matryoshka", "loop", "one_call"):
            torch.manual_seed(0)  # the same base (an SVR's radius) every time
            base = _base(name)
            args, kwargs = _dist_args(name, rank_rows(rank))
            calls.clear()
            if how == "matryoshka":
                loss = MatryoshkaLoss(base, DIST_DIMS, DIST_WEIGHTS)(*args, **kwargs)
            elif how == "loop":
                loss = _reference(base, DIST_DIMS, DIST_WEIGHTS, *args, **kwargs)
            else:  # the base once, on the whole width
                loss = base(*args, **kwargs)
            gathers = len(calls)
            grads = _grads(loss, args, base)
            out[name, how] = (loss.detach(), grads, gathers)
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@outlasting(300)
def test_two_gloo_ranks_equal_the_per_dim_gathered_loss(tmp_path: Path) -> None:
    """On each rank (uneven batches 5 + 3), for InfoNCE, SigLIP (ids), KCL (mask) and SVR:
    the loss and gradients (inputs and the base's parameters) of the per-dim loop, each
    prefix gathered by its base, ``len(dims)`` times one call's autograd gathers; averaged
    over ranks, the one-process loss on the whole batch and its input gradients."""
    results = spawn_ranks(_dist_worker, tmp_path)
    world = len(results)
    for name in DIST_BASES:
        for r in results:
            (loss, grads, gathers), (ref, ref_grads, ref_gathers) = (
                r[name, "matryoshka"],
                r[name, "loop"],
            )
            torch.testing.assert_close(loss, ref, **F64)
            for got, want in zip(grads, ref_grads, strict=True):
                torch.testing.assert_close(got, want, **F64)
            assert gathers == ref_gathers == len(DIST_DIMS) * r[name, "one_call"][2] > 0
        torch.manual_seed(0)
        base = _base(name)
        args, kwargs = _dist_args(name, slice(None))
        whole = MatryoshkaLoss(base, DIST_DIMS, DIST_WEIGHTS)(*args, **kwargs)
        whole_grads = torch.autograd.grad(whole, [x for x in args if x.requires_grad])
        mean = sum(r[name, "matryoshka"][0] for r in results) / world
        torch.testing.assert_close(mean, whole.detach(), **F64)
        for i, want in enumerate(whole_grads):
            got = torch.cat([r[name, "matryoshka"][1][i] for r in results]) / world
            torch.testing.assert_close(got, want, **F64, msg=f"{name}: input {i}")


def test_hard_negatives_are_cut_with_the_batch_and_a_guide_is_not() -> None:
    """The real InfoNCE with both sides' hard negatives (masked) and a guide: each dim's
    term equals the base on the re-normalised prefixes of the batch and the negatives,
    the mask and the guide (another space, width 5) passed whole; a negative of another
    width is refused by name."""
    g = torch.Generator().manual_seed(7)
    a, t = torch.randn(B, D, generator=g), torch.randn(B, D, generator=g)
    neg, aneg = torch.randn(B, 2, D, generator=g), torch.randn(B, 3, D, generator=g)
    mask = torch.rand(B, 2, generator=g) > 0.3
    guide = torch.randn(B, 5, generator=g)
    base = InfoNCELoss(guide_margin=0.1)
    got = MatryoshkaLoss(base, DIMS)(
        a, t, hard_negatives=neg, hard_negatives_mask=mask, audio_hard_negatives=aneg, guide=guide
    )
    want = sum(
        base(
            a[:, :d],
            t[:, :d],
            hard_negatives=neg[..., :d],
            hard_negatives_mask=mask,
            audio_hard_negatives=aneg[..., :d],
            guide=guide,
        )
        for d in DIMS
    )
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="hard_negatives: last dim 6 differs"):
        MatryoshkaLoss(base, DIMS)(a, t, hard_negatives=torch.randn(B, 2, 6))


# ------------------------------------------------ the one-pass path of a plain InfoNCE


@pytest.fixture
def nested_calls(monkeypatch):
    """Count the calls of the one-pass path (:func:`nested_info_nce`)."""
    from contrastive_losses import matryoshka

    calls = []
    real = matryoshka.nested_info_nce

    def spy(*args, **kwargs):
        calls.append(kwargs["dims"])
        return real(*args, **kwargs)

    monkeypatch.setattr(matryoshka, "nested_info_nce", spy)
    return calls


def _loop(base, a, t, dims, weights, **kw):
    return sum(w * base(a[:, :d], t[:, :d], **kw) for d, w in zip(dims, weights, strict=True))


@pytest.mark.parametrize("b", [6, 130], ids=["transposed", "column-softmax"])
@pytest.mark.parametrize("scale", ["fixed", "learnable", "logit_scale"])
def test_plain_infonce_takes_one_pass_and_equals_the_loop(nested_calls, b, scale) -> None:
    """Values and the gradients of both inputs and of the temperature (or the model's
    scale) equal the per-prefix loop, below and above the column-softmax batch size."""
    g = torch.Generator().manual_seed(b)
    a = torch.randn(b, D, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(b, D, generator=g, dtype=torch.float64, requires_grad=True)
    base = InfoNCELoss(0.1, learnable_temperature=scale == "learnable").double()
    kw = {}
    if scale == "logit_scale":
        kw["logit_scale"] = torch.tensor(12.0, dtype=torch.float64, requires_grad=True)
    leaves = [a, t, *base.parameters(), *kw.values()]
    got = MatryoshkaLoss(base, DIMS, WEIGHTS)(a, t, **kw)
    assert nested_calls == [DIMS]
    want = _loop(base, a, t, DIMS, WEIGHTS, **kw)
    torch.testing.assert_close(got, want, **F64)
    grads = torch.autograd.grad(got, leaves), torch.autograd.grad(want, leaves)
    for x, y in zip(*grads, strict=True):
        torch.testing.assert_close(x, y, **F64)


def test_one_pass_gradcheck_and_half_precision(nested_calls) -> None:
    g = torch.Generator().manual_seed(3)
    a = torch.randn(5, D, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(5, D, generator=g, dtype=torch.float64, requires_grad=True)
    loss_fn = MatryoshkaLoss(InfoNCELoss(0.2), DIMS, WEIGHTS)
    assert torch.autograd.gradcheck(lambda x, y: loss_fn(x, y), (a, t))
    half = loss_fn(a.detach().half(), t.detach().half())
    wide = loss_fn(a.detach().half().float(), t.detach().half().float())
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), wide, rtol=1e-3, atol=1e-3)
    assert nested_calls  # every call above took the one-pass path


def test_one_pass_refuses_a_zero_prefix(nested_calls) -> None:
    a, t = torch.randn(B, D), torch.randn(B, D)
    a[2, :2] = 0  # the row is nonzero, its 2-prefix is not
    with pytest.raises(ValueError, match=r"audio: row 2's first 2 features are zero"):
        MatryoshkaLoss(InfoNCELoss(), DIMS)(a, t)
    assert MatryoshkaLoss(InfoNCELoss(), (8, 4))(a, t).isfinite()  # no 2-prefix asked


class _Subclass(InfoNCELoss):
    pass


@pytest.mark.parametrize(
    ("base", "kwargs", "terms"),
    [
        (InfoNCELoss(), {"ids": torch.arange(B)}, False),
        (InfoNCELoss(chunk_size=2), {}, False),
        (InfoNCELoss(reduction="sum"), {}, False),
        (InfoNCELoss(), {"hard_negatives": torch.randn(B, 2, D)}, False),
        (InfoNCELoss(), {"guide": torch.randn(B, 3)}, False),
        (InfoNCELoss(), {}, True),
        (_Subclass(), {}, False),
    ],
    ids=["ids", "tiled", "sum", "hard_negatives", "guide", "terms", "subclass"],
)
def test_other_calls_take_the_per_prefix_path(nested_calls, base, kwargs, terms) -> None:
    a, t = torch.randn(B, D), torch.randn(B, D)
    MatryoshkaLoss(base, DIMS)(a, t, return_terms=terms, **kwargs)
    assert nested_calls == []
