"""Two gloo processes with a rank holding one sample (or none, or a NaN): legal global
batches (1 + 1, 1 + 6) give the single-process loss and gradient, illegal inputs raise
the same error on every rank. A check failing on one rank only used to leave the other
waiting in the first collective: the spawn below has a deadline, so a hang fails."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import assert_ddp_average_matches, rank_data, spawn_ranks

from contrastive_losses import KnowledgeBank
from contrastive_losses import functional as CF

# name -> (sizes per rank, rank holding a NaN or None)
CASES = {
    "1+1": ((1, 1), None),
    "1+6": ((1, 6), None),
    "0+2": ((0, 2), None),
    "1+0": ((1, 0), None),
    "nan_on_rank1": ((2, 2), 1),
}
BANK_CASES = {
    "bank 0+3": ((0, 3), None),
    "bank nan_on_rank0": ((2, 3), 0),
}
DEADLINE_S = 240  # the whole spawn; gloo's own timeout below is shorter


def _losses(gather: bool):
    return {
        "info_nce": lambda a, t, m: CF.info_nce(a, t[:, 0], 0.2, gather=gather),
        "siglip": lambda a, t, m: CF.siglip(a, t[:, 0], 3.0, -1.0, gather=gather),
        "kcl": lambda a, t, m: CF.kcl(a, t, 0.2, mask=m, gather=gather),
        "kcl_all": lambda a, t, m: CF.kcl(
            a, t, 0.2, mask=m, negatives="all_languages", gather=gather
        ),
        "cacl": lambda a, t, m: CF.cacl(a, t[:, 0], t[:, 1], 0.2, gather=gather),
    }


def _rows(sizes: tuple[int, ...], rank: int) -> slice:
    lo = sum(sizes[:rank])
    return slice(lo, lo + sizes[rank])


def _case_data(case: str, cases: dict = CASES) -> dict[str, torch.Tensor]:
    sizes, nan_rank = cases[case]
    data = {k: v[: sum(sizes)].clone() for k, v in rank_data().items() if k != "ids"}
    if nan_rank is not None:
        data["audio"][_rows(sizes, nan_rank).start, 1] = float("nan")
    return data


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        results: dict[str, object] = {}
        for case, (sizes, _) in CASES.items():
            data = _case_data(case)
            rows = _rows(sizes, rank)
            for name, fn in _losses(gather=True).items():
                a = data["audio"][rows].clone().requires_grad_()
                t = data["text"][rows].clone().requires_grad_()
                try:
                    loss = fn(a, t, data["mask"][rows])
                except (ValueError, TypeError) as err:
                    results[case, name] = ("error", type(err).__name__, str(err))
                    continue
                loss.backward()
                results[case, name] = (loss.detach(), a.grad, t.grad)
        for case, (sizes, _) in BANK_CASES.items():
            data = _case_data(case, BANK_CASES)
            rows = _rows(sizes, rank)
            kb = KnowledgeBank(4, backend="torch", num_prototypes=0)
            try:
                kb.build(data["audio"][rows], data["text"][rows, 0], torch.arange(sum(sizes))[rows])
                results[case, "bank"] = kb.state_dict()
            except (ValueError, TypeError) as err:
                results[case, "bank"] = ("error", type(err).__name__, str(err))
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    return spawn_ranks(_worker, tmp_path_factory.mktemp("dist_edges"), deadline_s=DEADLINE_S)


@pytest.mark.parametrize("name", list(_losses(gather=False)))
@pytest.mark.parametrize("case", ["1+1", "1+6", "0+2"])
def test_a_rank_with_one_sample_or_none_is_legal(rank_results, case, name):
    data = _case_data(case)
    a = data["audio"].clone().requires_grad_()
    t = data["text"].clone().requires_grad_()
    loss = _losses(gather=False)[name](a, t, data["mask"])
    loss.backward()
    per_rank = [{name: r[case, name]} for r in rank_results]
    assert_ddp_average_matches(per_rank, name, loss, a, t)


@pytest.mark.parametrize("name", list(_losses(gather=False)))
@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("1+0", r"^audio: global batch size 1 over 2 ranks is too small"),
        ("nan_on_rank1", r"audio: contains 1 NaN/Inf value.* \(on rank 1; every rank raises it\)"),
    ],
)
def test_an_error_on_one_rank_is_raised_on_every_rank(rank_results, case, message, name):
    outcomes = [r[case, name] for r in rank_results]
    assert outcomes[0] == outcomes[1]  # same type and message everywhere
    kind, text = outcomes[0][0], outcomes[0][2]
    assert kind == "error" and outcomes[0][1] == "ValueError"
    assert __import__("re").search(message, text), text


def test_a_bank_build_with_an_empty_rank_or_a_nan_on_one_rank(rank_results):
    data = _case_data("bank 0+3", BANK_CASES)
    ref = KnowledgeBank(4, backend="torch", num_prototypes=0)
    ref.build(data["audio"], data["text"][:, 0], torch.arange(3))
    for r in rank_results:
        torch.testing.assert_close(r["bank 0+3", "bank"]["audio"], ref.audio)
    outcomes = [r["bank nan_on_rank0", "bank"] for r in rank_results]
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == "error"
    assert outcomes[0][2].startswith("audio_emb: contains 1 NaN/Inf"), outcomes[0]
    assert outcomes[0][2].endswith("(on rank 0; every rank raises it)"), outcomes[0]
