"""Two gloo processes on CPU with uneven batches (5 and 3) reproduce the single-process
loss on the concatenated batch, and its gradient, for every loss (float64, 1e-6 rel), on
the dense path and tiled (``chunk_size``): tiled == dense == single process."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import assert_ddp_average_matches, init_gloo, rank_data, rank_rows, spawn_ranks

from contrastive_losses import InfoNCELoss, KCLLoss, SupportVectorRegularizer
from contrastive_losses import functional as CF
from contrastive_losses.distributed import resolve_gather


def _svr(base, radius="dynamic"):
    """The regulariser with the same (seeded) predictor weights on every rank."""
    torch.manual_seed(0)
    return SupportVectorRegularizer(base, radius=radius, num_features=4).double()


def _losses(gather: bool):
    """name -> fn(audio, text, mask, ids); each uses text differently. Every loss runs
    dense and tiled (``chunk_size`` 2 and 3: one divides the 8-sample batch, one does not;
    3 equals rank 1's rows)."""
    dense = {
        "info_nce": lambda a, t, m, i, c: CF.info_nce(a, t[:, 0], 0.2, gather=gather, chunk_size=c),
        "info_nce_ids": lambda a, t, m, i, c: CF.info_nce(
            a, t[:, 0], 0.2, ids=i, gather=gather, chunk_size=c
        ),
        "siglip": lambda a, t, m, i, c: CF.siglip(
            a, t[:, 0], 3.0, -1.0, gather=gather, chunk_size=c
        ),
        "siglip_ids": lambda a, t, m, i, c: CF.siglip(
            a, t[:, 0], 3.0, -1.0, ids=i, gather=gather, chunk_size=c
        ),
        "kcl": lambda a, t, m, i, c: CF.kcl(a, t, 0.2, mask=m, gather=gather, chunk_size=c),
        "kcl_nomask": lambda a, t, m, i, c: CF.kcl(a, t, 0.2, gather=gather, chunk_size=c),
        "kcl_all": lambda a, t, m, i, c: CF.kcl(
            a, t, 0.2, mask=m, negatives="all_languages", gather=gather, chunk_size=c
        ),
        "cacl": lambda a, t, m, i, c: CF.cacl(
            a, t[:, 0], t[:, 1], 0.2, gather=gather, chunk_size=c
        ),
        "svr_term": lambda a, t, m, i, c: CF.support_vector_term(
            t[:, 1], a, 0.3, 0.2, mask=m[:, 1], gather=gather, chunk_size=c
        ),
        "svr_kcl_dynamic": lambda a, t, m, i, c: _svr(KCLLoss(0.2, gather=gather, chunk_size=c))(
            a, t, m
        ),
        "svr_info_nce_static": lambda a, t, m, i, c: _svr(
            InfoNCELoss(0.2, gather=gather, chunk_size=c), radius="static"
        )(a, t[:, 0]),
    }
    out = {}
    for name, fn in dense.items():
        for chunk in (None, 2, 3):
            key = name if chunk is None else f"{name}_chunk{chunk}"
            out[key] = lambda a, t, m, i, fn=fn, chunk=chunk: fn(a, t, m, i, chunk)
    return out


def _worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    init_gloo(rank, world, init_method)
    try:
        data = rank_data()
        rows = rank_rows(rank)
        results = {"auto_gather": resolve_gather(None)}
        for name, fn in _losses(gather=True).items():
            a = data["audio"][rows].clone().requires_grad_()
            t = data["text"][rows].clone().requires_grad_()
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no deprecated collective on this torch
                loss = fn(a, t, data["mask"][rows], data["ids"][rows])
            loss.backward()
            results[name] = (loss.detach(), a.grad, t.grad)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    return spawn_ranks(_worker, out)


@pytest.mark.parametrize("name", list(_losses(gather=False)))
def test_gathered_loss_and_grads_match_single_process(rank_results, name):
    data = rank_data()
    a = data["audio"].clone().requires_grad_()
    t = data["text"].clone().requires_grad_()
    # the single-process reference is always the dense path
    dense_name = name.split("_chunk")[0]
    loss = _losses(gather=False)[dense_name](a, t, data["mask"], data["ids"])
    loss.backward()
    assert_ddp_average_matches(rank_results, name, loss, a, t)


def test_gather_turns_on_automatically(rank_results):
    assert all(r["auto_gather"] for r in rank_results)
    assert resolve_gather(None) is False  # this process is not distributed
