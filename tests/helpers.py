"""Small helpers shared by the test modules: seeded float64 data and 2-process runs."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

F64 = torch.float64


def randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Standard normal float64 tensor from ``gen``."""
    return torch.randn(*shape, generator=gen, dtype=F64)


def random_mask(gen: torch.Generator, b: int, k: int, p: float = 0.7) -> torch.Tensor:
    """``(b, k)`` presence mask, each caption present with probability ``p``; every clip
    keeps its English caption (column 0)."""
    mask = torch.rand(b, k, generator=gen) < p
    mask[:, 0] = True
    return mask


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(
    worker: Callable[..., None], out_dir: Path, world: int = 2, deadline_s: float = 300
) -> list[dict]:
    """Run ``worker(rank, world, port, out_dir)`` in ``world`` gloo processes; each saves
    ``out_dir/rank{r}.pt``. Returns the loaded results in rank order. Past ``deadline_s``
    the processes are killed and the test fails: a rank waiting forever in a collective
    is a failure, not a stuck CI job."""
    ctx = mp.start_processes(
        worker, args=(world, free_port(), str(out_dir)), nprocs=world, join=False
    )
    deadline = time.monotonic() + deadline_s
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{world} ranks did not finish in {deadline_s:g} s (a rank hangs)")
    return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(world)]


RANK_SIZES = (5, 3)  # uneven on purpose: the last batch of an epoch


def rank_data(k: int = 3, d: int = 4) -> dict[str, torch.Tensor]:
    """The global batch that the 2-process tests split by ``RANK_SIZES``."""
    g = torch.Generator().manual_seed(0)
    n = sum(RANK_SIZES)
    return {
        "audio": randn(g, n, d),
        "text": randn(g, n, k, d),
        "mask": random_mask(g, n, k, p=0.6),
        "ids": torch.tensor([0, 1, 2, 3, 0, 4, 2, 5]),
    }


def rank_rows(rank: int) -> slice:
    lo = sum(RANK_SIZES[:rank])
    return slice(lo, lo + RANK_SIZES[rank])


def assert_ddp_average_matches(
    rank_results: list[dict], name: str, loss: torch.Tensor, *inputs: torch.Tensor
) -> None:
    """What DDP sees equals the single-process run: the mean over ranks of the rank losses
    is ``loss``, and the rank input gradients (``rank_results[r][name] = (loss, grad, ...)``
    in input order), averaged the same way, are the rows of ``inputs[i].grad``."""
    world = len(rank_results)
    mean_loss = sum(r[name][0] for r in rank_results) / world
    torch.testing.assert_close(mean_loss, loss.detach(), rtol=1e-6, atol=0)
    for i, x in enumerate(inputs, start=1):
        grad = torch.cat([r[name][i] for r in rank_results]) / world
        torch.testing.assert_close(grad, x.grad, rtol=1e-6, atol=1e-12)
