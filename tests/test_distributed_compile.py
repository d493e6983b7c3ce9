"""``torch.compile(fullgraph=True)`` under ``torch.distributed`` (2 gloo ranks, issue 40
item 1): every loss, functional form and open_clip drop-in compiles, and its value and
every gradient (inputs, learnable temperature, scale, bias, radius, predictor) equal
eager; the rank checks still run compiled and raise the library's ``ValueError`` on every
rank; a rank compiled while its peer runs eager raises on both, never waits.

One spawn runs every case (a spawn and its compiles are slow on shared cores): the
backends are ``aot_eager`` for every loss (dynamo's tracing and AOTAutograd's joint
graph, what a graph break fails), ``eager`` for two, and ``inductor`` once for a graph of
InfoNCE, SigLIP and KCL together. ASK's Module is not compiled (its bank's search runs
outside the graph); its functional form on given knowledge is. Two mismatches run under
inductor too (issue 48: it ordered the gather before the rank exchange, a gloo abort), and
a rank that dynamo runs eager past its recompile limit is reported naming that limit.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import init_gloo, outlasting, spawn_ranks

from contrastive_losses import InfoNCELoss, KCLLoss, SigLIPLoss, _compat
from contrastive_losses.distributed import call_count
from contrastive_losses.integrations.open_clip import ClipLoss, SigLipLoss

# The spawn and its compiles take 6 minutes alone on 2 busy cores (load 7-36), over 10
# beside other tests: the whole spawn's deadline, and pytest's after it
DEADLINE_S = 1500
pytestmark = outlasting(DEADLINE_S)
# gloo's wait in one collective: a rank may compile for minutes while its peer waits
TIMEOUT_S = 600
B = 4  # per rank: compiled losses need equal batch sizes

# compiled with aot_eager (names from tests/test_compile.py's LOSSES)
AOT = [
    "info_nce",
    "siglip",
    "kcl",
    "kcl_all_languages",
    "cacl",
    "cacl_index",
    "svr_static",
    "svr_dynamic_kcl",
    "svr_dynamic_siglip",
    "svr_fixed_cacl",
    "support_vector_term",
    "ask",
    "info_nce_chunk",
    "kcl_chunk",
    "info_nce_fn",
    "siglip_fn",
    "kcl_fn",
    "cacl_fn",
]
DROP_INS = ["clip_loss", "clip_loss_global", "siglip_loss"]
EAGER_BACKEND = ["info_nce", "clip_loss"]


def _drop_in(name: str) -> torch.nn.Module:
    rank, world = dist.get_rank(), dist.get_world_size()
    if name == "siglip_loss":
        return SigLipLoss(rank=rank, world_size=world)
    local = name == "clip_loss"
    return ClipLoss(local_loss=local, gather_with_grad=True, rank=rank, world_size=world)


def _drop_in_inputs(rank: int) -> tuple:
    g = torch.Generator().manual_seed(10 + rank)
    image = torch.nn.functional.normalize(torch.randn(B, 16, generator=g), dim=-1)
    text = torch.nn.functional.normalize(torch.randn(B, 16, generator=g), dim=-1)
    return image, text, torch.tensor(10.0), torch.tensor(-5.0)


def _compare(name: str, backend: str, rank: int) -> tuple:
    """("same", ...) when compiled == eager (value and every gradient), else the error."""
    from test_compile import _assert_same, _build, _inputs, _step

    if name in DROP_INS:
        module = _drop_in(name)
        args: tuple = _drop_in_inputs(rank)
        kwargs: dict = {}
        fn = module
    else:
        module = fn = _build(name)
        args, kwargs = _inputs(name, B, seed=rank)
    try:
        eager = _step(fn, module, args, kwargs)
        compiled = _step(torch.compile(fn, fullgraph=True, backend=backend), module, args, kwargs)
        _assert_same(f"{name} ({backend})", eager, compiled)
    except Exception as err:  # reported by the test, on the parent's side
        return ("error", type(err).__name__, str(err)[:2000])
    return ("same", float(eager[0]), len(eager[1]))


def _inductor_graph(rank: int) -> tuple:
    """InfoNCE, SigLIP and KCL in one inductor graph against eager."""
    g = torch.Generator().manual_seed(rank)
    a, t = torch.randn(B, 16, generator=g), torch.randn(B, 16, generator=g)
    tk = torch.randn(B, 3, 16, generator=g)
    torch.manual_seed(0)
    losses = [InfoNCELoss(learnable_temperature=True), SigLIPLoss(), KCLLoss()]

    def total(a: torch.Tensor, t: torch.Tensor, tk: torch.Tensor) -> torch.Tensor:
        return losses[0](a, t) + losses[1](a, t) + losses[2](a, tk)

    def step(fn) -> list[torch.Tensor]:
        leaves = [x.detach().clone().requires_grad_(True) for x in (a, t, tk)]
        params = [p for m in losses for p in m.parameters()]
        for p in params:
            p.grad = None
        loss = fn(*leaves)
        loss.backward()
        return [loss.detach()] + [x.grad for x in leaves] + [p.grad for p in params]

    try:
        eager = step(total)
        compiled = step(torch.compile(total, fullgraph=True, backend="inductor"))
        for e, c in zip(eager, compiled, strict=True):
            torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)
    except Exception as err:
        return ("error", type(err).__name__, str(err)[:2000])
    return ("same", float(eager[0]), len(eager))


def _outcome(fn, *args) -> tuple:
    """What a call gave: its value, the library's error, or another (dynamo's, gloo's)."""
    try:
        out = fn(*args)
        out.backward()
    except (ValueError, TypeError) as err:
        return ("error", type(err).__name__, str(err))
    except Exception as err:
        return ("other", type(err).__name__, str(err))
    return ("value", float(out))


def _past_the_recompile_limit(rank: int, a: torch.Tensor, t: torch.Tensor) -> tuple:
    """Both ranks compile a function (no fullgraph) and call it at two batch sizes; rank 1
    allows dynamo one compile of it, so its second call runs eager (dynamo's fallback)
    while rank 0 recompiles: what the ranks raise then."""
    # Past the limit dynamo still runs the code it compiled for the frames called inside:
    # the earlier cases' (the loss Module's) would serve rank 1 compiled. None are kept.
    torch._dynamo.reset()
    loss = InfoNCELoss()

    def fresh(a: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # a code object of its own
        return loss(a, t)

    fn = torch.compile(fresh, backend="aot_eager")
    name = _compat.recompile_limit_name()
    before = getattr(torch._dynamo.config, name)
    setattr(torch._dynamo.config, name, (before, 1)[rank])
    try:
        first = _outcome(fn, a, t)
        return first if first[0] != "value" else _outcome(fn, a[:3], t[:3])
    finally:
        setattr(torch._dynamo.config, name, before)


def _mismatches(rank: int) -> dict[str, tuple]:
    """The rank checks, compiled: each case one call on both ranks (each raising case
    ends with no collective left unpaired, so the next case starts clean)."""
    g = torch.Generator().manual_seed(rank)
    a = torch.randn(B, 16, generator=g, requires_grad=True)
    t = torch.randn(B, 16, generator=g, requires_grad=True)
    out: dict[str, tuple] = {}

    def compiled(loss: torch.nn.Module):
        return torch.compile(loss, fullgraph=True, backend="aot_eager")

    # a setting differs, both compiled: a float, then a learnable temperature's value
    out["temperature"] = _outcome(compiled(InfoNCELoss(temperature=(0.07, 0.08)[rank])), a, t)
    learnable = InfoNCELoss(temperature=(0.07, 0.05)[rank], learnable_temperature=True)
    out["learnable"] = _outcome(compiled(learnable), a, t)
    out["reduction"] = _outcome(
        lambda *x: compiled(InfoNCELoss(reduction=("mean", "sum")[rank]))(*x), a, t
    )
    # the drop-in's own setting (local_loss), compiled on both
    clip = ClipLoss(local_loss=rank == 0, rank=rank, world_size=2)
    scale = torch.tensor(10.0)
    out["local_loss"] = _outcome(lambda x, y: compiled(clip)(x, y, scale), a, t)
    # the embeddings' size differs (a traced slot): D 16 against 8
    out["dim"] = _outcome(compiled(InfoNCELoss()), a[:, : (16, 8)[rank]], t[:, : (16, 8)[rank]])
    # unequal batch sizes: the compiled loss exchanges none
    out["sizes"] = _outcome(compiled(InfoNCELoss()), a[: B - rank], t[: B - rank])
    # a static check fails on rank 1 while dynamo traces (text rows != audio rows)
    out["static"] = _outcome(compiled(InfoNCELoss()), a, t[: B - rank])
    # compiled on rank 0 only
    one = InfoNCELoss()
    out["one_rank"] = _outcome(compiled(one) if rank == 0 else one, a, t)
    # inductor may order a size-dependent gather before the exchange unless the gathered
    # tensors depend on it (a gloo abort there): a setting, then a dtype that differs
    inductor = functools.partial(torch.compile, fullgraph=True, backend="inductor")
    out["inductor chunk_size"] = _outcome(inductor(InfoNCELoss(chunk_size=(None, 2)[rank])), a, t)
    wide = (a, t) if rank == 0 else (a.double(), t.double())
    out["inductor dtype"] = _outcome(inductor(InfoNCELoss(chunk_size=2)), *wide)
    out["recompile_limit"] = _past_the_recompile_limit(rank, a, t)
    # the same settings after all of this: the ranks still pair, and a second batch size
    # (a recompile with a dynamic one, in the header as a tensor) too; none is counted
    counted = InfoNCELoss()
    out["after"] = _outcome(compiled(counted), a, t)
    out["dynamic"] = _outcome(compiled(counted), a[:3], t[:3])
    out["count"] = ("count", call_count(counted))
    out["dynamic eager"] = _outcome(counted, a[:3], t[:3])
    # the static failure without fullgraph: dynamo breaks the graph there and runs the
    # call eager. Last: after that split, dynamo compiles the library's inner frames on
    # their own in that process, and a later fullgraph compile there failed in dynamo
    # ("Attempt to trace generator"; a data-dependent guard in the value checks)
    partial = torch.compile(InfoNCELoss(), backend="aot_eager")
    out["static partial"] = _outcome(partial, a, t[: B - rank])
    return out


def _worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    init_gloo(rank, world, init_method, timeout_s=TIMEOUT_S)
    warnings.simplefilter("ignore")
    torch._dynamo.config.cache_size_limit = 256
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 256
    result: dict[str, object] = {}
    for name in AOT + DROP_INS:
        result[f"{name} aot_eager"] = _compare(name, "aot_eager", rank)
    for name in EAGER_BACKEND:
        result[f"{name} eager"] = _compare(name, "eager", rank)
    result["inductor"] = _inductor_graph(rank)
    result["mismatch"] = _mismatches(rank)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_ranks(_worker, tmp_path_factory.mktemp("dist_compile"), deadline_s=DEADLINE_S)


CASES = [f"{n} aot_eager" for n in AOT + DROP_INS] + [f"{n} eager" for n in EAGER_BACKEND]


@pytest.mark.parametrize("case", [*CASES, "inductor"])
def test_compiled_equals_eager_on_two_ranks(results, case):
    for rank, result in enumerate(results):
        assert result[case][0] == "same", f"rank {rank}: {result[case]}"
    if case != "clip_loss_global aot_eager":  # local_loss=False: the global loss on each
        assert results[0][case][1] != results[1][case][1]  # each rank's own rows


MISMATCHES = {
    "temperature": "temperature: differs across ranks (0.07 on rank 0, 0.08 on rank 1);",
    "learnable": "temperature: differs across ranks (0.07 on rank 0, 0.05 on rank 1);",
    "reduction": "reduction: differs across ranks ('mean' on rank 0, 'sum' on rank 1);",
    "local_loss": "local_loss: differs across ranks (True on rank 0, False on rank 1);",
    "dim": "audio: shape after the batch dim (16,) on rank 0 but (8,) on rank 1;",
    "sizes": "audio: batch sizes differ across ranks (4 on rank 0, 3 on rank 1) under "
    "torch.compile;",
    "one_rank": "torch.compile: the loss runs compiled on some ranks only (True on rank 0, "
    "False on rank 1);",
    "recompile_limit": "torch.compile: the loss runs compiled on some ranks only (True on "
    "rank 0, False on rank 1);",
    "inductor chunk_size": "chunk_size: differs across ranks (None on rank 0, 2 on rank 1);",
    "inductor dtype": "audio: dtype torch.float32 on rank 0 but torch.float64 on rank 1;",
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_compiled_ranks_that_differ_raise_the_eager_error_on_both(results, case):
    outcomes = [r["mismatch"][case] for r in results]
    assert outcomes[0] == outcomes[1], outcomes  # the same type and message on both
    assert outcomes[0][:2] == ("error", "ValueError"), outcomes[0]
    assert outcomes[0][2].startswith(MISMATCHES[case]), outcomes[0][2]
    assert outcomes[0][2].endswith("(every rank raises it)"), outcomes[0][2]


def test_a_static_check_failing_while_one_rank_traces_raises_on_both(results):
    message = "text: batch size B 3 does not match audio's 4"
    peer, failing = (r["mismatch"]["static"] for r in results)
    assert peer[:2] == ("error", "ValueError"), peer
    assert peer[2].startswith(message) and peer[2].endswith("(on rank 1; every rank raises it)")
    # the failing rank: dynamo's report of the same error (fullgraph), as in one process
    assert failing[0] == "other" and message in failing[2], failing
    # without fullgraph the failing rank's call runs eager: the library's error on both
    outcomes = [r["mismatch"]["static partial"] for r in results]
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0][:2] == ("error", "ValueError"), outcomes[0]
    assert outcomes[0][2].startswith(message), outcomes[0][2]


def test_compiled_ranks_pair_after_the_errors_at_a_new_batch_size_uncounted(results):
    for r in results:
        assert r["mismatch"]["after"][0] == "value", r["mismatch"]["after"]
        dynamic, eager = r["mismatch"]["dynamic"], r["mismatch"]["dynamic eager"]
        assert dynamic[0] == eager[0] == "value", (dynamic, eager)
        assert dynamic[1] == pytest.approx(eager[1], rel=1e-6)
        assert r["mismatch"]["count"] == ("count", 0)  # compiled calls are not counted


def test_a_rank_past_dynamos_recompile_limit_is_named_as_a_cause(results):
    """A rank that dynamo runs eager at its recompile limit is reported, and the message
    names the limit (not only the user's compile calls)."""
    message = results[0]["mismatch"]["recompile_limit"][2]
    assert f"torch._dynamo.config.{_compat.recompile_limit_name()}" in message, message
