"""Two gloo ranks that differ where the header did not look (issue 33): the drop-in's
``local_loss`` (a gloo abort of both processes), ``world_size=1`` under a process group of
2 (a local loss, silently), ``torch.no_grad()`` or an input's ``requires_grad`` on one rank
only (both ranks waited for the timeout), a ``KnowledgeBank`` searched by faiss on one rank
and torch on the other (1.3% off, silently), a dynamic radius predictor whose weights
drifted apart outside DDP, and one rank's extra call of a loss (every later call paired
with the peer's previous batch, silently), caught by
:func:`~contrastive_losses.distributed.check_call_counts`. Each gives the same clear
``ValueError`` on both ranks; one spawn runs every case under a deadline (a hang fails)
and a gloo abort ends a process (the spawn then fails)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import init_gloo, outlasting, spawn_ranks

from contrastive_losses import ASKLoss, InfoNCELoss, KnowledgeBank, SupportVectorRegularizer
from contrastive_losses.distributed import call_count, check_call_counts
from contrastive_losses.integrations.open_clip import ClipLoss

DEADLINE_S = 240
pytestmark = outlasting(DEADLINE_S)
SCALE = torch.tensor(14.0, dtype=torch.float64)


def _clip(r: int, a, t, **kwargs) -> torch.Tensor:
    kwargs.setdefault("rank", r)
    kwargs.setdefault("world_size", 2)
    return ClipLoss(gather_with_grad=True, **kwargs)(a, t, SCALE)


def _grad_input(r: int, a, t) -> torch.Tensor:
    """Rank 0's audio requires grad, rank 1's does not."""
    return InfoNCELoss(0.1, gather=True)(a.clone().requires_grad_(r == 0), t)


def _no_grad_on_rank_0(r: int, a, t) -> torch.Tensor:
    a = a.clone().requires_grad_()
    with torch.set_grad_enabled(r != 0):
        return InfoNCELoss(0.1, gather=True)(a, t)


def _ask_backends(r: int, a, t) -> torch.Tensor:
    """Rank 0's bank says faiss searches it (faked: faiss need not be installed; the
    search itself stays torch's), rank 1's is torch's."""
    g = torch.Generator().manual_seed(3)
    kb = KnowledgeBank(4, backend="torch", num_prototypes=2, dtype=torch.float64)
    kb.build(torch.randn(12, 4, generator=g), torch.randn(12, 4, generator=g), torch.arange(12))
    if r == 0:
        kb._uses_faiss = lambda device: True  # type: ignore[method-assign]
        kb._search_faiss = kb._search_torch  # type: ignore[method-assign]
    return ASKLoss(kb, k=2, k_coarse=1, gather=True)(a, t, torch.arange(100, 100 + len(a)))


def _stepped_predictor(r: int, a, t, average: bool = False) -> torch.Tensor:
    """The regulariser outside DDP: each rank steps its predictor with its own rows'
    gradient, so step 2 meets different weights (as a temperature would); with
    ``average`` the gradients are averaged first, as DDP does, and the weights agree."""
    torch.manual_seed(0)  # the same predictor on both ranks
    loss_fn = SupportVectorRegularizer(InfoNCELoss(0.1, gather=True), radius="dynamic").double()
    optimizer = torch.optim.SGD(loss_fn.parameters(), lr=0.1)
    loss_fn(a, t).backward()
    if average:
        for p in loss_fn.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
    optimizer.step()
    return loss_fn(a, t)


# case -> (the message's start, loss(rank, audio (3, 4), text (3, 4)) on that rank)
CASES = {
    "cliploss local_loss": (
        "local_loss: differs across ranks (True on rank 0, False on rank 1)",
        lambda r, a, t: _clip(r, a, t, local_loss=r == 0),
    ),
    "cliploss world_size 1 on rank 0": (
        "rank, world_size: given 0, 1 but torch.distributed runs rank 0 of 2; pass",
        lambda r, a, t: _clip(r, a, t, **({"world_size": 1} if r == 0 else {})),
    ),
    "cliploss world_size 1 on both": (
        "rank, world_size: given 0, 1 but torch.distributed runs rank 0 of 2; pass",
        lambda r, a, t: _clip(r, a, t, rank=0, world_size=1),
    ),
    "requires_grad on rank 0 only": (
        "audio: requires_grad (with grad mode on) True on rank 0 but False on rank 1",
        _grad_input,
    ),
    "no_grad on rank 0": (
        "audio: requires_grad (with grad mode on) False on rank 0 but True on rank 1",
        _no_grad_on_rank_0,
    ),
    "ask bank backend": (
        "bank_backend: differs across ranks ('faiss flat' on rank 0, 'torch' on rank 1)",
        _ask_backends,
    ),
    "svr predictor drift": ("predictor checksum: differs across ranks (", _stepped_predictor),
}


def _outcome(fn, *args, **kwargs) -> tuple:
    try:
        loss = fn(*args, **kwargs)
    except (ValueError, TypeError) as err:
        return ("error", type(err).__name__, str(err))
    return ("value", float(loss.detach()))


def _extra_call(r: int, a, t) -> tuple:
    """Both ranks call a loss twice; rank 0 once more (an extra evaluation batch); then
    each checks the counts: rank 0's extra call meets rank 1's check."""
    loss_fn = InfoNCELoss(0.1, gather=True)
    loss_fn(a, t), loss_fn(a, t)
    if r == 0:
        outcome = _outcome(loss_fn, a, t)
        if outcome[0] == "error":
            return outcome
    return _outcome(lambda: check_call_counts(loss_fn, "evaluation") or torch.zeros(()))


def _different_modules(r: int, a, t) -> tuple:
    """Rank 0 calls one Module twice, rank 1 another (of the same settings): every call
    pairs (each is its Module's first, then second), silently; the totals differ."""
    first, second = InfoNCELoss(0.1, gather=True), InfoNCELoss(0.1, gather=True)
    for _ in range(2):
        (first if r == 0 else second)(a, t)
    return _outcome(lambda: check_call_counts(first, "evaluation") or torch.zeros(()))


def _worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    init_gloo(rank, world, init_method, timeout_s=60)
    results: dict[str, object] = {}
    g = torch.Generator().manual_seed(rank)
    a = torch.randn(3, 4, generator=g, dtype=torch.float64)
    t = torch.randn(3, 4, generator=g, dtype=torch.float64)
    try:
        for case, (_, fn) in CASES.items():
            results[case] = _outcome(fn, rank, a, t)
        results["extra call"] = _extra_call(rank, a, t)
        results["different modules"] = _different_modules(rank, a, t)
        # The same on both ranks: every check passes, and the counts agree.
        loss_fn = InfoNCELoss(0.1, gather=True)
        results["agree"] = [
            _outcome(_clip, rank, a, t, local_loss=True),
            _outcome(_clip, rank, a, t, local_loss=False),
            _outcome(_no_grad_on_rank_0, 1, a, t),  # grad on both
            _outcome(_stepped_predictor, rank, a, t, True),  # averaged, as DDP does
            _outcome(lambda: loss_fn(a, t)),
            _outcome(lambda: check_call_counts(loss_fn) or torch.zeros(())),
        ]
        results["count"] = call_count(loss_fn)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_ranks(_worker, tmp_path_factory.mktemp("dist_ranks"), deadline_s=DEADLINE_S)


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_that_differ_raise_the_same_clear_error(results, case):
    start, _ = CASES[case]
    outcomes = [r[case] for r in results]
    assert outcomes[0] == outcomes[1], outcomes  # the same type and message on both ranks
    assert outcomes[0][:2] == ("error", "ValueError"), outcomes[0]
    assert outcomes[0][2].startswith(start), outcomes[0][2]
    assert outcomes[0][2].endswith("every rank raises it)"), outcomes[0][2]


def test_an_extra_call_on_one_rank_raises_at_the_count_check(results):
    outcomes = [r["extra call"] for r in results]
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0][:2] == ("error", "ValueError"), outcomes[0]
    assert outcomes[0][2].startswith(
        "calls of InfoNCELoss (evaluation): rank 1 compared the calls of the loss while "
        "rank 0 made another gathered loss call"
    ), outcomes[0][2]


def test_call_totals_that_differ_raise_at_the_count_check(results):
    outcomes = [r["different modules"] for r in results]
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0][:2] == ("error", "ValueError"), outcomes[0]
    assert outcomes[0][2].startswith(
        "calls of InfoNCELoss (evaluation): the ranks made different numbers of gathered "
        "calls (2 on rank 0, 0 on rank 1)"
    ), outcomes[0][2]


def test_ranks_that_agree_compute_and_count_alike(results):
    for r in results:
        assert [o[0] for o in r["agree"]] == ["value"] * 6, r["agree"]
    assert [r["count"] for r in results] == [1, 1]
