"""``validate_args`` and ``set_default_validate_args``: with the value checks off, a
forward and backward of every loss make no host-device sync (counted on CPU with a
``TorchFunctionMode``, :class:`helpers.HostSyncCounter`; on CUDA with
``torch.cuda.set_sync_debug_mode("error")``), give the values and gradients of the
checked run, and the static checks (shapes, dtypes, arguments) still raise. With them
on (the default) the same runs do sync: the counter sees them, so it can fail."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import HostSyncCounter, init_gloo, spawn_ranks

import contrastive_losses as cl
from contrastive_losses import (
    CACLLoss,
    InfoNCELoss,
    KCLLoss,
    RadiusPredictor,
    SigLIPLoss,
    SupportVectorRegularizer,
    _rank_agreement,
)
from contrastive_losses import functional as CF
from contrastive_losses.distributed import validate_together

B, K, D = 6, 3, 8


@pytest.fixture(autouse=True)
def _restore_default():
    yield
    cl.set_default_validate_args(True)


def _data(dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(B, K, generator=g) < 0.7
    mask[:, 0] = True
    knowledge = [
        F.normalize(torch.randn(B, 3, 2, D, generator=g, dtype=dtype), dim=-1) for _ in range(4)
    ]
    return {
        "a": torch.randn(B, D, generator=g, dtype=dtype),
        "t": torch.randn(B, D, generator=g, dtype=dtype),
        "tk": torch.randn(B, K, D, generator=g, dtype=dtype),
        "mask": mask,
        "ids": torch.tensor([0, 1, 2, 0, 3, 4]),
        "other": torch.tensor([1, 2, 1, 2, 1, 1]),
        "radius": torch.rand(B, generator=g, dtype=dtype) * 0.3,
        "sims": torch.randn(B, B, generator=g, dtype=dtype),
        "knowledge": knowledge,  # type: ignore[dict-item]
    }


# name -> (build(validate_args) -> (callable, Module or None), inputs(data) -> (args, kwargs)).
# Every loss, with its learnable parameters, masks, ids and the tiled path (chunk_size).
Case = tuple[Callable[[Any], tuple[Callable[..., Any], torch.nn.Module | None]], Callable]


def _module(cls: Callable[..., torch.nn.Module], **kw: Any):
    def build(v: Any):
        m = cls(validate_args=v, **kw)
        return m, m

    return build


def _svr(base: Callable[[], torch.nn.Module], **kw: Any):
    def build(v: Any):
        m = SupportVectorRegularizer(base(), validate_args=v, **kw)
        m.base.validate_args = v
        return m, m

    return build


def _fn(f: Callable[..., Any]):
    return lambda v: (lambda *a, **k: f(*a, validate_args=v, **k), None)


def _ask(d: dict, *, validate_args: Any) -> torch.Tensor:
    fa, ft, ca, ct = d["knowledge"]
    return CF.ask(d["a"], d["t"], fa, ft, ca, ct, validate_args=validate_args)


CASES: dict[str, Case] = {
    "info_nce": (
        _module(InfoNCELoss, learnable_temperature=True),
        lambda d: ((d["a"], d["t"]), {}),
    ),
    "info_nce_ids_chunk": (
        _module(InfoNCELoss, learnable_temperature=True, chunk_size=4),
        lambda d: ((d["a"], d["t"], d["ids"]), {}),
    ),
    "siglip": (_module(SigLIPLoss), lambda d: ((d["a"], d["t"]), {})),
    "siglip_ids_chunk": (
        _module(SigLIPLoss, chunk_size=4),
        lambda d: ((d["a"], d["t"], d["ids"]), {}),
    ),
    "kcl_mask": (
        _module(KCLLoss, learnable_temperature=True),
        lambda d: ((d["a"], d["tk"], d["mask"]), {}),
    ),
    "kcl_all_languages_chunk": (
        _module(KCLLoss, negatives="all_languages", chunk_size=4),
        lambda d: ((d["a"], d["tk"], d["mask"]), {}),
    ),
    "cacl": (
        _module(CACLLoss, learnable_temperature=True),
        lambda d: ((d["a"], d["t"], d["tk"][:, 1]), {}),
    ),
    "cacl_index_mask": (
        _module(CACLLoss),
        lambda d: (
            (d["a"], d["tk"], d["other"]),
            {"mask": torch.ones(B, K, dtype=torch.bool, device=d["a"].device)},
        ),
    ),
    "svr_static": (
        _svr(lambda: InfoNCELoss(learnable_temperature=True), radius="static"),
        lambda d: ((d["a"], d["t"]), {"return_terms": True}),
    ),
    "svr_dynamic_kcl_mask": (
        _svr(lambda: KCLLoss(learnable_temperature=True)),
        lambda d: ((d["a"], d["tk"], d["mask"]), {"return_terms": True}),
    ),
    "svr_dynamic_siglip_chunk": (
        _svr(lambda: SigLIPLoss(chunk_size=4)),
        lambda d: ((d["a"], d["t"]), {"return_terms": True}),
    ),
    "svr_fixed_uni_cacl": (
        _svr(lambda: CACLLoss(), radius=0.2, direction="uni"),
        lambda d: ((d["a"], d["t"], d["tk"][:, 1]), {}),
    ),
    "support_vector_term": (
        _fn(CF.support_vector_term),
        lambda d: ((d["t"], d["a"], d["radius"], 0.1), {"mask": d["mask"][:, 1]}),
    ),
    "radius_predictor": (_module(RadiusPredictor, num_features=4), lambda d: ((d["sims"],), {})),
    "ask": (lambda v: (lambda d: _ask(d, validate_args=v), None), lambda d: ((d,), {})),
}


def _leaves(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The float tensors among the inputs (nested in the ASK data dict too)."""
    out = []
    for x in [*args, *kwargs.values()]:
        xs = x.values() if isinstance(x, dict) else [x]
        out += [t for t in xs if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return out


def _step(fn: Callable[..., Any], module: torch.nn.Module | None, args: tuple, kwargs: dict):
    """One forward and backward; returns the loss and every gradient (inputs, parameters)."""
    leaves = _leaves(args, kwargs)
    for x in leaves:
        x.requires_grad_(True)
        x.grad = None
    params = [] if module is None else [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    out = fn(*args, **kwargs)
    loss = out[0] if isinstance(out, tuple) else out
    loss = loss.sum() if loss.dim() else loss
    loss.backward()
    return loss.detach(), [x.grad for x in leaves + params]


def _run_counted(name: str, validate_args: Any, steps: int = 1) -> tuple[HostSyncCounter, Any]:
    """``steps`` forward, backward and optimizer steps (an optimizer over the inputs only,
    at lr 0: the loss's own parameters are left out, so the training checks listen to
    every step and, after ``stuck_after = 2``, decide)."""
    build, inputs = CASES[name]
    torch.manual_seed(0)  # the radius predictor's initial weights
    fn, module = build(validate_args)
    if module is not None:
        for m in module.modules():
            if hasattr(m, "stuck_after"):
                m.stuck_after = 2
    args, kwargs = inputs(_data())
    opt = torch.optim.SGD(_leaves(args, kwargs), lr=0.0)
    with HostSyncCounter() as counter:
        for _ in range(steps):
            result = _step(fn, module, args, kwargs)
            opt.step()
    return counter, result


@pytest.mark.parametrize("name", list(CASES))
def test_checks_off_make_no_host_sync(name: str) -> None:
    """30 training steps (forward, backward, optimizer step: the SVR monitor would read
    every 25, the never-changed watch decide after 2) with validate_args=False sync
    nowhere, the learnable temperature's clamp and the tiled kernels included; the same
    step with the checks on syncs (the counter sees it)."""
    on, _ = _run_counted(name, True)
    assert on.total > 0, f"{name}: the counter saw no sync with the checks on"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # SVR training warnings are off anyway
        off, _ = _run_counted(name, False, steps=30)
    assert off.counts == {}, f"{name}: host syncs with validate_args=False: {off.counts}"


@pytest.mark.parametrize("name", list(CASES))
def test_checks_off_give_the_same_loss_and_gradients(name: str) -> None:
    _, (loss_on, grads_on) = _run_counted(name, True)
    _, (loss_off, grads_off) = _run_counted(name, False)
    torch.testing.assert_close(loss_off, loss_on, rtol=1e-12, atol=1e-12)
    assert len(grads_on) == len(grads_off) > 0
    for g_off, g_on in zip(grads_off, grads_on, strict=True):
        torch.testing.assert_close(g_off, g_on, rtol=1e-12, atol=1e-12)


def test_global_default_and_per_object_override() -> None:
    """``None`` follows set_default_validate_args; True or False on the object wins."""
    cl.set_default_validate_args(False)
    off, _ = _run_counted("info_nce", None)
    assert off.total == 0
    forced, _ = _run_counted("info_nce", True)
    assert forced.total > 0
    cl.set_default_validate_args(True)
    on, _ = _run_counted("info_nce", None)
    assert on.total > 0
    local_off, _ = _run_counted("info_nce", False)
    assert local_off.total == 0


def test_validate_args_types_are_checked() -> None:
    with pytest.raises(TypeError, match="value: expected True or False"):
        cl.set_default_validate_args(1)  # type: ignore[arg-type]
    for make in (
        lambda: InfoNCELoss(validate_args="no"),
        lambda: SigLIPLoss(validate_args=0),
        lambda: SupportVectorRegularizer(InfoNCELoss(), validate_args="off"),
        lambda: RadiusPredictor(validate_args=1),
    ):
        with pytest.raises(TypeError, match="validate_args: expected None, True or False"):
            make()
    a = torch.randn(4, 8)
    with pytest.raises(TypeError, match="validate_args"):
        CF.info_nce(a, a, validate_args="yes")  # type: ignore[arg-type]


def test_static_checks_stay_and_value_checks_go() -> None:
    a, t = torch.randn(4, 8), torch.randn(4, 8)
    for validate in (True, False):
        with pytest.raises(ValueError, match=r"text: batch size B 3 does not match"):
            CF.info_nce(a, t[:3], validate_args=validate)
        with pytest.raises(TypeError, match=r"text: dtype torch\.float64"):
            CF.info_nce(a, t.double(), validate_args=validate)
        with pytest.raises(ValueError, match="reduction"):
            CF.kcl(a, t[:, None], reduction="avg", validate_args=validate)
        with pytest.raises(ValueError, match="temperature: must be a finite number > 0"):
            CF.info_nce(a, t, -1.0, validate_args=validate)  # a float: no sync to check it
    bad = a.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"audio: contains 1 NaN/Inf"):
        CF.info_nce(bad, t)
    assert torch.isnan(CF.info_nce(bad, t, validate_args=False))  # the documented contract
    with pytest.raises(ValueError, match="temperature: must be a finite number > 0"):
        CF.info_nce(a, t, torch.tensor(-1.0))
    CF.info_nce(a, t, torch.tensor(-1.0), validate_args=False)  # not read: no error


def test_svr_training_warnings_need_the_checks() -> None:
    """The stuck-radius and radius-above-distance warnings are value checks: they fire
    with the checks on and are off (no read-back) with them off."""

    def run(validate: bool) -> list[str]:
        svr = SupportVectorRegularizer(
            InfoNCELoss(validate_args=validate), radius="static", radius_init=5.0,
            beta=0.0, validate_args=validate,
        )  # fmt: skip
        svr.stuck_after, svr.over_distance_steps, svr.over_distance_check_every = 2, 2, 1
        a, t = torch.randn(6, 8, requires_grad=True), torch.randn(6, 8)
        opt = torch.optim.SGD([a], lr=0.0)  # without the radius: it never moves
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(4):
                svr(a, t).backward()
                opt.step()
        return [str(w.message) for w in caught]

    on = run(True)
    assert any("never changed" in m for m in on) and any("stayed above 0.5" in m for m in on)
    assert run(False) == []


def test_validate_together_without_checks_sends_a_zero_header_and_reads_nothing(
    monkeypatch,
) -> None:
    """Under gather with the checks off, validate_together sends this rank's header (all
    zeros: "no checks here") in the one exchange every rank makes, so a peer that checks
    is not paired with this rank's first gather (issue 22); it reads nothing back (no
    host sync), records no setting (no value read) and does not re-raise on every rank:
    an error is this rank's own."""
    sent: list[torch.Tensor] = []

    def exchange(header: torch.Tensor) -> torch.Tensor:
        sent.append(header.clone())
        return torch.zeros(2, header.numel(), dtype=torch.long)  # a peer without checks

    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: "gloo")
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(_rank_agreement, "_exchange_header", exchange)
    with validate_together(True, torch.zeros(2), validate=False) as v:
        assert v.min_batch == 0
        v.settings(temperature=torch.tensor(0.1))
        assert v.fingerprint == []
    with pytest.raises(ValueError, match=r"^local$"):
        with validate_together(True, torch.zeros(2), validate=False):
            raise ValueError("local")
    assert len(sent) == 2 and not any(bool(h.any()) for h in sent)
    # With the checks the header says so; the stub's peer sent zeros: a rank without them.
    with pytest.raises(ValueError, match=r"^validate_args: the value checks run on some ranks"):
        with validate_together(True, torch.zeros(2)) as v:
            v.batch = 2
    assert sent[-1][:3].tolist() == [1, 0, 2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_no_sync_on_cuda(name: str) -> None:
    build, inputs = CASES[name]
    fn, module = build(False)
    if module is not None:
        module.cuda()
    data = {
        k: [t.cuda() for t in v] if isinstance(v, list) else v.cuda() for k, v in _data().items()
    }
    args, kwargs = inputs(data)
    _step(fn, module, args, kwargs)  # warm-up: lazy initialisation may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(fn, module, args, kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ------------------------------------------------------------------ two gloo processes

SIZES = 4  # per rank: with the checks off the ranks must hold equal batch sizes


def _dist_losses() -> dict[str, Callable[..., torch.Tensor]]:
    return {
        "info_nce_ids": lambda a, t, m, i: CF.info_nce(a, t[:, 0], 0.2, ids=i, validate_args=False),
        "siglip_chunk": lambda a, t, m, i: CF.siglip(a, t[:, 0], chunk_size=3, validate_args=False),
        "kcl_mask": lambda a, t, m, i: CF.kcl(a, t, 0.2, mask=m, validate_args=False),
        "kcl_mask_chunk": lambda a, t, m, i: CF.kcl(
            a, t, 0.2, mask=m, chunk_size=3, validate_args=False
        ),
        "cacl": lambda a, t, m, i: CF.cacl(a, t[:, 0], t[:, 1], 0.2, validate_args=False),
        "svr_term": lambda a, t, m, i: CF.support_vector_term(
            t[:, 1], a, 0.3, 0.2, mask=m[:, 1], validate_args=False
        ),
    }


def _dist_data() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(2 * SIZES, K, generator=g) < 0.6
    mask[:, 0] = True
    return {
        "audio": torch.randn(2 * SIZES, D, generator=g, dtype=torch.float64),
        "text": torch.randn(2 * SIZES, K, D, generator=g, dtype=torch.float64),
        "mask": mask,
        "ids": torch.tensor([0, 1, 2, 3, 0, 4, 2, 5]),
    }


def _worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    init_gloo(rank, world, init_method)
    try:
        data = _dist_data()
        rows = slice(rank * SIZES, (rank + 1) * SIZES)
        results = {}
        for name, fn in _dist_losses().items():
            a = data["audio"][rows].clone().requires_grad_()
            t = data["text"][rows].clone().requires_grad_()
            with HostSyncCounter() as counter:
                loss = fn(a, t, data["mask"][rows], data["ids"][rows])
                loss.backward()
            results[name] = (loss.detach(), a.grad, t.grad, counter.total)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    return spawn_ranks(_worker, tmp_path_factory.mktemp("dist_off"))


@pytest.mark.parametrize("name", list(_dist_losses()))
def test_gathered_without_checks_matches_single_process_and_never_syncs(rank_results, name):
    """Equal batches on two ranks, checks off: no size exchange, no joint validation, no
    host sync, and the loss and gradients of the single process on the whole batch."""
    data = _dist_data()
    a = data["audio"].clone().requires_grad_()
    t = data["text"].clone().requires_grad_()
    loss = _dist_losses()[name](a, t, data["mask"], data["ids"])
    loss.backward()
    assert [r[name][3] for r in rank_results] == [0, 0]
    mean = sum(r[name][0] for r in rank_results) / 2
    torch.testing.assert_close(mean, loss.detach(), rtol=1e-6, atol=0)
    for i, x in ((1, a), (2, t)):
        grad = torch.cat([r[name][i] for r in rank_results]) / 2
        torch.testing.assert_close(grad, x.grad, rtol=1e-6, atol=1e-12)


# ------------------------------------------------------------------ the switch sweep
# Checks on and off give the same loss and gradients for every loss, dense and tiled
# (chunk_size), alone and under SVR, at ordinary inputs and at extreme finite ones that
# normalise (issue 29: a KCL caption coordinate of 3.4e38 gave 2.677 with the checks on,
# inf and a non-finite gradient with them off; both inputs so, 2.907 against NaN).

# base -> (Module factory, the form of its inputs)
_BASES: dict[str, tuple[Callable[..., torch.nn.Module], str]] = {
    "info_nce": (lambda **kw: InfoNCELoss(learnable_temperature=True, **kw), "pair"),
    "siglip": (SigLIPLoss, "pair"),
    "kcl": (lambda **kw: KCLLoss(learnable_temperature=True, **kw), "multi"),
    "kcl_all_languages": (lambda **kw: KCLLoss(negatives="all_languages", **kw), "multi"),
    "cacl": (lambda **kw: CACLLoss(learnable_temperature=True, **kw), "triplet"),
}
_CHUNKS = {"dense": None, "tiled": 4}


def _sweep_cases() -> dict[str, tuple[Callable[[bool], Any], str]]:
    """name -> (build(validate_args) -> callable, input form)."""
    cases: dict[str, tuple[Callable[[bool], Any], str]] = {}
    for base, (make, form) in _BASES.items():
        for path, chunk in _CHUNKS.items():

            def plain(v: bool, make=make, chunk=chunk) -> Any:
                return make(chunk_size=chunk, validate_args=v)

            def svr(v: bool, make=make, chunk=chunk) -> Any:
                torch.manual_seed(0)  # the radius predictor's weights, the same on and off
                base_loss = make(chunk_size=chunk, validate_args=v)
                return SupportVectorRegularizer(base_loss, validate_args=v)

            cases[f"{base}_{path}"] = (plain, form)
            cases[f"svr_{base}_{path}"] = (svr, form)
    for path, chunk in _CHUNKS.items():

        def term(v: bool, chunk=chunk) -> Any:
            return lambda a, t: CF.support_vector_term(
                t, a, 0.2, 0.1, chunk_size=chunk, validate_args=v
            )

        cases[f"support_vector_term_{path}"] = (term, "pair")
    cases["ask"] = (lambda v: lambda a, t, k: CF.ask(a, t, *k, validate_args=v), "knowledge")
    return cases


_SWEEP = _sweep_cases()
# The extremes per dtype: a coordinate near the dtype's max, and rows scaled near its floor.
_EXTREMES = {torch.float32: (3.4e38, 1e-36), torch.float64: (1.7e308, 1e-300)}


def _sweep_inputs(form: str, extreme: str, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    a = torch.randn(B, D, generator=g, dtype=dtype)
    tk = torch.randn(B, K, D, generator=g, dtype=dtype)
    huge, tiny = _EXTREMES[dtype]
    if extreme in ("huge_text", "huge_both"):
        tk[1, :, 3] = huge  # every language's caption of sample 1 (pair and triplet forms)
    if extreme == "huge_both":
        a[2, 5] = huge
    if extreme == "tiny_rows":
        a[0], tk[0] = a[0] * tiny, tk[0] * tiny
    if form == "pair":
        return [a, tk[:, 0]]
    if form == "multi":
        return [a, tk]
    if form == "triplet":
        return [a, tk[:, 0], tk[:, 1]]
    knowledge = [
        F.normalize(torch.randn(B, 3, 2, D, generator=g, dtype=dtype), dim=-1) for _ in range(4)
    ]
    return [a, tk[:, 0], knowledge]  # type: ignore[list-item]


def _sweep_step(name: str, validate: bool, extreme: str, dtype: torch.dtype):
    build, form = _SWEEP[name]
    fn = build(validate)
    inputs = _sweep_inputs(form, extreme, dtype)
    leaves = [x for x in inputs if isinstance(x, torch.Tensor)]
    for x in leaves:
        x.requires_grad_(True)
    module = fn if isinstance(fn, torch.nn.Module) else None
    if module is not None:
        module.to(dtype)
    params = [] if module is None else [p for p in module.parameters() if p.requires_grad]
    loss = fn(*inputs)
    loss.backward()
    return loss.detach(), [x.grad for x in leaves + params]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("extreme", ["ordinary", "huge_text", "huge_both", "tiny_rows"])
@pytest.mark.parametrize("name", list(_SWEEP))
def test_switch_sweep_checks_on_equal_checks_off(name, extreme, dtype) -> None:
    """Forward and backward: the same finite loss and gradients with the checks on and
    off (float64 to 1e-12; float32 to its default tolerance: KCL's fused fast path runs
    only where the checks found moderate norms)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # SVR training warnings
        loss_on, grads_on = _sweep_step(name, True, extreme, dtype)
        loss_off, grads_off = _sweep_step(name, False, extreme, dtype)
    assert torch.isfinite(loss_on), (name, extreme, float(loss_on))
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {}
    torch.testing.assert_close(loss_off, loss_on, **tol)
    assert len(grads_on) == len(grads_off) > 0
    for g_on, g_off in zip(grads_on, grads_off, strict=True):
        assert torch.isfinite(g_on).all(), (name, extreme)
        torch.testing.assert_close(g_off, g_on, **tol)
