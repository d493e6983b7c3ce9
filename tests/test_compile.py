"""``torch.compile(loss, fullgraph=True)`` on every loss with its default arguments (the
value checks step aside while dynamo traces; the static ones are traced): the compiled
loss equals eager within 1e-5 in float32, values and gradients, those of the learnable
temperature, scale, bias and radius included.

Every loss is compiled on its own with ``backend="aot_eager"`` (dynamo's tracing and
AOTAutograd's joint graph, the part that fails on a graph break; no code generation, so
it is fast), a few at two batch sizes (the second recompiles with dynamic shapes). One
test compiles every loss class and functional form into one graph with inductor (C++
code generation on CPU, about a minute on one core) and compares the generated kernels'
numbers with eager.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from contrastive_losses import (
    CACLLoss,
    InfoNCELoss,
    KCLLoss,
    RadiusPredictor,
    SigLIPLoss,
    SupportVectorRegularizer,
    _compat,
)
from contrastive_losses import _nce_rows as R
from contrastive_losses import functional as CF
from contrastive_losses._kernels import (
    _Distance,
    _Gram,
    _L2Normalize,
    _NormalizedRowsMatmul,
    _SymmetricDiagonalCE,
    _SymmetricMeanCE,
    _TiledCrossEntropy,
    _TiledSigmoid,
    _UpperClamp,
)

pytestmark = pytest.mark.filterwarnings(
    # torch's own inductor lowering calls a deprecated torch._prims_common.check
    "ignore:`torch._prims_common.check` is deprecated:FutureWarning"
)

K, D = 3, 16
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _inputs(name: str, b: int, seed: int = 0) -> tuple[tuple, dict]:
    """float32 inputs of loss ``name`` for a batch of ``b``."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    a, t, tk = randn(b, D), randn(b, D), randn(b, K, D)
    mask = torch.rand(b, K, generator=g) < 0.7
    mask[:, 0] = True
    args, kwargs = _loss_inputs(name, a, t, tk, mask, g, randn, b)
    if name.endswith("_fn") or name.endswith("_fn_chunk"):  # the loss's own parameters
        extra = (
            (torch.tensor(5.0), torch.tensor(-2.0)) if "siglip" in name else (torch.tensor(0.1),)
        )
        args = (*args, *extra)
    return args, kwargs


def _loss_inputs(name: str, a, t, tk, mask, g, randn, b: int) -> tuple[tuple, dict]:
    if name.startswith("kcl") or name.startswith("svr_dynamic_kcl"):
        return (a, tk, mask), {}
    if name.startswith("cacl_index"):
        other = torch.randint(1, K, (b,), generator=g)
        return (a, tk, other), {"mask": torch.ones(b, K, dtype=torch.bool)}
    if name.startswith("cacl") or name.startswith("svr_fixed"):
        return (a, t, tk[:, 1]), {}
    if name == "radius_predictor":
        return (randn(b, b),), {}
    if name.startswith("support_vector_term"):
        return (t, a, torch.rand(b, generator=g) * 0.3, 0.1), {"mask": mask[:, 1]}
    if name == "ask":
        knowledge = [F.normalize(randn(b, 3, 2, D), dim=-1) for _ in range(4)]
        return (a, t, *knowledge), {}
    return (a, t), {}


_IDS8 = torch.tensor([0, 1, 0, 2, 1, 2, 3, 3])

# name -> a fresh loss (a Module with default arguments bar the learnable switches, or a
# functional form), built under one seed so eager and compiled copies start equal.
LOSSES: dict[str, Callable[[], Any]] = {
    "info_nce": lambda: InfoNCELoss(learnable_temperature=True),
    "siglip": SigLIPLoss,
    "kcl": lambda: KCLLoss(learnable_temperature=True),
    "kcl_all_languages": lambda: KCLLoss(negatives="all_languages"),
    "cacl": lambda: CACLLoss(learnable_temperature=True),
    "cacl_index": CACLLoss,
    "svr_static": lambda: SupportVectorRegularizer(
        InfoNCELoss(learnable_temperature=True), radius="static"
    ),
    "svr_dynamic_kcl": lambda: SupportVectorRegularizer(KCLLoss(learnable_temperature=True)),
    "svr_dynamic_siglip": lambda: SupportVectorRegularizer(SigLIPLoss(), direction="uni"),
    "svr_fixed_cacl": lambda: SupportVectorRegularizer(CACLLoss(), radius=0.2),
    "radius_predictor": lambda: RadiusPredictor(num_features=4),
    "support_vector_term": lambda: CF.support_vector_term,
    "ask": lambda: CF.ask,  # on given knowledge: the bank's search stays outside
    # the tiled path: autograd.Functions looping over column tiles
    "info_nce_chunk": lambda: InfoNCELoss(learnable_temperature=True, chunk_size=3),
    "siglip_chunk": lambda: SigLIPLoss(chunk_size=3),
    "kcl_chunk": lambda: KCLLoss(chunk_size=3),
    "svr_dynamic_kcl_chunk": lambda: SupportVectorRegularizer(KCLLoss(chunk_size=3)),
    "kcl_all_languages_chunk": lambda: KCLLoss(negatives="all_languages", chunk_size=3),
    "cacl_chunk": lambda: CACLLoss(learnable_temperature=True, chunk_size=3),
    "svr_static_chunk": lambda: SupportVectorRegularizer(
        InfoNCELoss(learnable_temperature=True, chunk_size=3), radius="static"
    ),
    "svr_fixed_cacl_chunk": lambda: SupportVectorRegularizer(CACLLoss(chunk_size=3), radius=0.2),
    "support_vector_term_chunk": lambda: _with(CF.support_vector_term, chunk_size=3),
    # several positives per row (ids), tiled: row and column ids are two kernel inputs
    "info_nce_ids_chunk": lambda: _with(CF.info_nce, ids=_IDS8, chunk_size=3),
    "siglip_ids_chunk": lambda: _with(CF.siglip, ids=_IDS8, chunk_size=3),
    # functional forms, dense and tiled: temperature (SigLIP: scale and bias) a leaf too
    **{
        f"{name}_fn{tag}": (lambda fn=fn, c=c: _functional(fn, c))
        for name, fn in (("info_nce", CF.info_nce), ("siglip", CF.siglip), ("cacl", CF.cacl))
        for tag, c in (("", None), ("_chunk", 3))
    },
    **{
        f"kcl{neg}_fn{tag}": (lambda n=n, c=c: _kcl_functional(n, c))
        for neg, n in (("", "per_language"), ("_all_languages", "all_languages"))
        for tag, c in (("", None), ("_chunk", 3))
    },
}


def _with(fn: Callable, **fixed: Any) -> Callable:
    """``fn`` with some keywords fixed, as a closure: dynamo before torch 2.3 cannot call a
    ``functools.partial`` object."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **fixed, **kwargs)

    return call


def _functional(fn: Callable, chunk: int | None) -> Callable:
    return _with(fn, chunk_size=chunk)


def _kcl_functional(negatives: str, chunk: int | None) -> Callable:
    def call(a: torch.Tensor, tk: torch.Tensor, mask: torch.Tensor, tau: torch.Tensor) -> Any:
        return CF.kcl(a, tk, tau, mask=mask, negatives=negatives, chunk_size=chunk)

    return call


# Compiled together with inductor: every loss class and functional form once (the
# variants above differ only in what dynamo traces, which aot_eager covers).
INDUCTOR = ["info_nce", "siglip", "kcl", "cacl", "svr_static", "svr_dynamic_kcl", "ask"]
# Also compiled at a second batch size (a recompile with dynamic shapes).
DYNAMIC = {"info_nce", "kcl_chunk", "svr_dynamic_kcl", "ask"}


def _build(name: str) -> Any:
    torch.manual_seed(0)
    return LOSSES[name]()


def _step(fn: Any, module: Any, args: tuple, kwargs: dict) -> tuple[torch.Tensor, list]:
    """Loss and the gradients of every float input and every learnable parameter."""
    args = tuple(
        x.detach().clone().requires_grad_(True) if torch.is_tensor(x) and x.is_floating_point()
        else x
        for x in args
    )  # fmt: skip
    params = [p for p in module.parameters()] if isinstance(module, torch.nn.Module) else []
    for p in params:
        p.grad = None
    loss = fn(*args, **kwargs)
    loss = loss.sum() if loss.dim() else loss
    loss.backward()
    leaves = [x for x in args if torch.is_tensor(x) and x.requires_grad] + params
    return loss.detach(), [x.grad for x in leaves]


def _assert_same(name: str, eager: tuple, compiled: tuple) -> None:
    torch.testing.assert_close(compiled[0], eager[0], **TOL, msg=lambda m: f"{name}: {m}")
    assert len(eager[1]) == len(compiled[1])
    assert any(g is not None for g in eager[1]), f"{name}: no gradient to compare"
    for i, (ge, gc) in enumerate(zip(eager[1], compiled[1], strict=True)):
        assert (ge is None) == (gc is None), f"{name}: gradient {i} only on one side"
        if ge is not None:
            torch.testing.assert_close(gc, ge, **TOL, msg=lambda m, i=i: f"{name}, grad {i}: {m}")


@pytest.mark.parametrize("name", list(LOSSES))
def test_fullgraph_compiles_and_matches_eager(name: str) -> None:
    """No graph break anywhere (fullgraph), default validate_args; a few at a second batch
    size too (dynamic shapes)."""
    torch._dynamo.reset()
    eager_loss, compiled_loss = _build(name), _build(name)
    compiled = torch.compile(compiled_loss, fullgraph=True, backend="aot_eager")
    svr = isinstance(compiled_loss, SupportVectorRegularizer)
    minimum = _compat.MIN_TORCH_COMPILE_SVR if svr else _compat.MIN_TORCH_COMPILE
    if _compat.TORCH[:2] < minimum:  # refused, naming the version
        args, kwargs = _inputs(name, 8)
        # a RuntimeError on every release: dynamo may wrap it (InternalTorchDynamoError)
        with pytest.raises(RuntimeError, match=r"needs torch>=2\.\d+; this is torch"):
            _step(compiled, compiled_loss, args, kwargs)
        return
    for b in (8, 6) if name in DYNAMIC else (8,):
        args, kwargs = _inputs(name, b, seed=b)
        eager = _step(eager_loss, eager_loss, args, kwargs)
        _assert_same(name, eager, _step(compiled, compiled_loss, args, kwargs))


def _inv_norm(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / torch.linalg.vector_norm(x.detach(), dim=-1)


def _weighted(*outputs: torch.Tensor) -> torch.Tensor:
    """A fixed non-uniform weighting of each output: a gradient routed to the wrong output
    (or dropped) changes every input's gradient."""
    return sum((o * torch.linspace(0.5, 1.5, o.numel()).view(o.shape) * (i + 1)).sum()
               for i, o in enumerate(outputs))  # fmt: skip


_IDS = torch.tensor([0, 1, 0, 2, 1, 2])


def _copy(x: torch.Tensor | None) -> torch.Tensor | None:
    """Row and column ids (validity) as two tensors: dynamo refuses one tensor passed as
    two inputs of an autograd.Function (the losses pass copies, _kernels.distinct_ids)."""
    return None if x is None else x.clone()


def _tiled_ce(x, y, ids: bool = False, masked: bool = False, symmetric: bool = True):
    valid = (torch.arange(y.shape[0] * 6).view(y.shape[0], 6) % 4 != 1) if masked else None
    rid = _IDS if ids else None
    columns = (0, 6) if symmetric else None
    return _weighted(
        *_TiledCrossEntropy.apply(x, y, 0, rid, _copy(rid), valid, _copy(valid), 2, columns, False)
    )


# name -> (each custom autograd.Function called on its own, its float inputs (leaves))
FUNCTIONS: dict[str, tuple[Callable, Callable[[torch.Generator], tuple]]] = {
    "l2_normalize": (lambda x: _weighted(_L2Normalize.apply(x, _inv_norm(x))), lambda g: (
        torch.randn(6, 5, generator=g),)),
    "normalized_rows_matmul": (
        lambda x, y: _weighted(_NormalizedRowsMatmul.apply(x, _inv_norm(x), y)),
        lambda g: (torch.randn(6, 5, generator=g), torch.randn(4, 5, generator=g))),
    "symmetric_diagonal_ce": (lambda s: _weighted(*_SymmetricDiagonalCE.apply(s)),
                              lambda g: (torch.randn(3, 5, 5, generator=g),)),
    "symmetric_mean_ce": (lambda x, y: _weighted(*_SymmetricMeanCE.apply(x, y, 2.5)), lambda g: (
        torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g))),
    "gram": (lambda y: _weighted(_Gram.apply(y)), lambda g: (torch.randn(6, 5, generator=g),)),
    "distance": (lambda x, y: _weighted(_Distance.apply(x, y)),
                 lambda g: (torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g))),
    "upper_clamp": (lambda x: _weighted(_UpperClamp.apply(x, 0.5)),
                    lambda g: (torch.randn(8, generator=g),)),
    "tiled_ce_rows": (_with(_tiled_ce, symmetric=False), lambda g: (
        torch.randn(6, D, generator=g), torch.randn(2, 6, D, generator=g))),
    "tiled_ce_symmetric": (_tiled_ce, lambda g: (
        torch.randn(6, D, generator=g), torch.randn(2, 6, D, generator=g))),
    "tiled_ce_ids_masked": (_with(_tiled_ce, ids=True, masked=True), lambda g: (
        torch.randn(6, D, generator=g), torch.randn(2, 6, D, generator=g))),
    "tiled_ce_per_problem_rows": (_tiled_ce, lambda g: (
        torch.randn(2, 6, D, generator=g), torch.randn(2, 6, D, generator=g))),
    "tiled_sigmoid": (
        lambda x, y, sc, bi: _weighted(_TiledSigmoid.apply(x, y, sc, bi, 0, None, None, 2)),
                      lambda g: (torch.randn(6, D, generator=g), torch.randn(6, D, generator=g),
                                 torch.tensor(3.0), torch.tensor(-1.0))),
    "tiled_sigmoid_ids": (
        lambda x, y, sc, bi: _weighted(_TiledSigmoid.apply(x, y, sc, bi, 0, _IDS, _IDS.clone(), 2)),
        lambda g: (torch.randn(6, D, generator=g), torch.randn(6, D, generator=g),
                   torch.tensor(3.0), torch.tensor(-1.0))),
}  # fmt: skip


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_each_function_compiled_matches_eager(name: str) -> None:
    """Every custom autograd.Function on its own, compiled (fullgraph, aot_eager) against
    eager: the value and the gradient of every input. torch 2.11 gave the tiled ones zero
    gradients when an output was an intermediate or mutated in place (pytorch#180642)."""
    fn, make = FUNCTIONS[name]
    args = make(torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    eager = _step(fn, None, args, {})
    if _compat.TORCH[:2] < _compat.MIN_TORCH_COMPILE:  # loud or right: never silent
        try:
            compiled = _step(torch.compile(fn, fullgraph=True, backend="aot_eager"), None, args, {})
        except Exception:  # dynamo cannot trace it there; the losses refuse compile
            return
        _assert_same(name, eager, compiled)
        return
    _assert_same(
        name, eager, _step(torch.compile(fn, fullgraph=True, backend="aot_eager"), None, args, {})
    )
    assert all(g.abs().sum() > 0 for g in eager[1]), f"{name}: a zero gradient in eager"


@pytest.mark.parametrize("learnable", [False, True])
def test_fused_dense_means_compile(monkeypatch, learnable: bool) -> None:
    """InfoNCE's one-process mean through _SymmetricMeanCE (its batch threshold lowered
    to this batch): fullgraph compiles, equal to eager, with a float temperature (the
    Function's constant scale) and a learnable one (a tensor scale)."""
    if _compat.TORCH[:2] < _compat.MIN_TORCH_COMPILE:
        pytest.skip("the losses refuse compile on this torch (test_fullgraph_compiles_... checks)")
    monkeypatch.setattr(R, "_FUSED_MEANS_MIN", 0)
    torch._dynamo.reset()
    make = (
        (lambda: InfoNCELoss(learnable_temperature=True))
        if learnable
        else (lambda: _with(CF.info_nce, temperature=0.2))
    )
    eager_loss, compiled_loss = make(), make()
    compiled = torch.compile(compiled_loss, fullgraph=True, backend="aot_eager")
    args, kwargs = _inputs("info_nce", 8)
    _assert_same("info_nce fused", _step(eager_loss, eager_loss, args, kwargs),
                 _step(compiled, compiled_loss, args, kwargs))  # fmt: skip


def test_inductor_matches_eager_for_every_loss() -> None:
    """Every loss in one inductor graph (one compilation: code generation dominates the
    cost); each loss's value and gradients against eager."""
    names = INDUCTOR
    torch._dynamo.reset()
    eager_losses = {n: _build(n) for n in names}
    compiled_losses = {n: _build(n) for n in names}
    inputs = {n: _inputs(n, 8) for n in names}

    def every_loss(losses: dict, leaves: dict) -> dict:
        return {n: losses[n](*leaves[n][0], **leaves[n][1]) for n in names}

    def run(fn: Callable) -> tuple[dict, dict, dict]:
        leaves = {
            n: (tuple(_leaf(x) for x in args), kwargs) for n, (args, kwargs) in inputs.items()
        }
        for m in compiled_losses.values():
            if isinstance(m, torch.nn.Module):
                m.zero_grad(set_to_none=True)
        out = fn(leaves)
        sum(v.sum() for v in out.values()).backward()
        return out, leaves, {}

    def _leaf(x: Any) -> Any:
        if torch.is_tensor(x) and x.is_floating_point():
            return x.detach().clone().requires_grad_(True)
        return x

    e_out, e_leaves, _ = run(lambda leaves: every_loss(eager_losses, leaves))
    compiled = torch.compile(
        lambda leaves: every_loss(compiled_losses, leaves), fullgraph=True, backend="inductor"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        c_out, c_leaves, _ = run(compiled)
    for n in names:
        grads_e = [x.grad for x in e_leaves[n][0] if torch.is_tensor(x) and x.requires_grad]
        grads_c = [x.grad for x in c_leaves[n][0] if torch.is_tensor(x) and x.requires_grad]
        if isinstance(eager_losses[n], torch.nn.Module):
            grads_e += [p.grad for p in eager_losses[n].parameters()]
            grads_c += [p.grad for p in compiled_losses[n].parameters()]
        _assert_same(n, (e_out[n].detach(), grads_e), (c_out[n].detach(), grads_c))


def test_static_checks_still_raise_under_compile() -> None:
    """A failing static check is traced: without fullgraph it raises its ValueError; with
    fullgraph dynamo reports it as Unsupported, carrying the ValueError's message."""
    a, t = torch.randn(8, D), torch.randn(7, D)
    if _compat.TORCH[:2] < (2, 11):
        pytest.skip(
            f"torch {torch.__version__}: compile is refused (below 2.7), or dynamo reports the "
            "error without the ValueError's text (2.8 measured; 2.11 carries it)"
        )
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="text: batch size B 7 does not match audio's 8"):
        torch.compile(InfoNCELoss(), backend="aot_eager")(a, t)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="text: batch size B 7 does not match audio's 8"):
        torch.compile(InfoNCELoss(), fullgraph=True, backend="aot_eager")(a, t)
