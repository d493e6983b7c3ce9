"""What the ranks' exchange cannot see, one 2-rank test per sentence of the docs' list
("What the exchange cannot see", ``docs/trainer.rst``; issue 40 item 4):

* two offsetting extra calls of *other kinds* (an evaluation call, grad mode off, where the
  peer makes a training call): every call's exchange pairs (nothing gathered requires
  grad), the totals agree, and :func:`check_call_counts` raises on both ranks because it
  compares the order of the kinds, not only the totals;
* two offsetting extra calls of the *same* kind between two checks: nothing can tell
  them apart, the check passes (checking after each evaluation catches the first);
* a backward skipped on one rank: the peer's backward exchange meets the other's next
  forward, and a rank waits until the process group's timeout.

One spawn, with a short process-group timeout (the last case waits for it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import init_gloo, outlasting, spawn_ranks

from contrastive_losses import InfoNCELoss
from contrastive_losses.distributed import call_count, check_call_counts

DEADLINE_S = 300
pytestmark = outlasting(DEADLINE_S)
TIMEOUT_S = 10  # the process group's: the skipped backward waits for it


def _outcome(fn) -> tuple:
    try:
        out = fn()
    except (ValueError, TypeError) as err:
        return ("error", type(err).__name__, str(err))
    except RuntimeError as err:  # gloo: a timeout, a closed connection
        return ("runtime", type(err).__name__, str(err))
    return ("value", None if out is None else float(out))


def _calls(loss_fn, a, t, kinds: str) -> list[float]:
    """One call per letter: ``t`` with grad mode on, ``e`` under ``torch.no_grad()``."""
    values = []
    for kind in kinds:
        with torch.set_grad_enabled(kind == "t"):
            values.append(float(loss_fn(a, t)))
    return values


def _worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    init_gloo(rank, world, init_method, timeout_s=TIMEOUT_S)
    g = torch.Generator().manual_seed(rank)
    a, t = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)  # no grad
    out: dict[str, object] = {}
    # other kinds: rank 0 evaluates at its 2nd call, rank 1 at its 3rd
    loss_fn = InfoNCELoss(0.1)
    out["other kinds calls"] = _outcome(lambda: _calls(loss_fn, a, t, ("tett", "ttet")[rank])[0])
    out["other kinds count"] = call_count(loss_fn)
    out["other kinds"] = _outcome(lambda: check_call_counts(loss_fn, "evaluation"))
    # the same kind: rank 0's extra evaluation call in the first evaluation, rank 1's
    # in the second, checked at the end only; each call pairs with a peer's other batch
    loss_fn = InfoNCELoss(0.1)
    kinds = ("eee" + "ee", "ee" + "eee")[rank]
    _calls(loss_fn, a, t, kinds)
    out["same kind"] = _outcome(lambda: check_call_counts(loss_fn, "evaluation"))
    # a backward skipped on rank 1: rank 0's backward exchange meets rank 1's next forward
    leaf = a.clone().requires_grad_(True)
    loss_fn = InfoNCELoss(0.1)

    def skipped_backward() -> None:
        loss = loss_fn(leaf, t)
        if rank == 0:
            loss.backward()
        loss_fn(leaf, t).backward()
        dist.barrier()

    out["skipped backward"] = _outcome(skipped_backward)
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    # The skipped backward leaves the ranks' collectives out of step, on purpose: tearing
    # down that process group at exit may abort the process (gloo's "terminate called
    # without an active exception", SIGABRT on rank 0 in 1 fresh-clone CI run under load)
    # after its results are saved. Leave without the C++ teardown: the results are on disk.
    os._exit(0)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_ranks(_worker, tmp_path_factory.mktemp("dist_calls"), deadline_s=DEADLINE_S)


def test_offsetting_calls_of_other_kinds_raise_at_the_check(results):
    assert [r["other kinds calls"][0] for r in results] == ["value", "value"]
    assert [r["other kinds count"] for r in results] == [4, 4]  # the totals agree
    outcomes = [r["other kinds"] for r in results]
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0][:2] == ("error", "ValueError"), outcomes[0]
    assert outcomes[0][2].startswith(
        "order of the calls of InfoNCELoss (evaluation): the ranks made as many gathered "
        "calls but of other kinds in another order (call 2 of InfoNCELoss was evaluation on "
        "rank 0, training on rank 1;"
    ), outcomes[0][2]
    assert outcomes[0][2].endswith("(every rank raises it)")


def test_offsetting_calls_of_the_same_kind_are_not_seen(results):
    # every call paired with the peer's call of the same number, the kinds in the same
    # order: the check passes on both ranks
    assert [r["same kind"][0] for r in results] == ["value", "value"], results


def test_a_backward_skipped_on_one_rank_waits_for_the_timeout(results):
    outcomes = [r["skipped backward"] for r in results]
    assert any(o[0] == "runtime" for o in outcomes), outcomes
