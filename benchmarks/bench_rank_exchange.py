"""The ranks' agreement exchange against a whole loss step, on 2 gloo ranks.

Under gather with the checks on, every loss call starts with one small ``all_gather`` of
a fixed-length header (:func:`contrastive_losses.distributed.validate_together`): each
rank's batch size, checks, a fingerprint of the effective settings (the scale and its
dtype, an SVR radius, CACL's ``english_index``, ASK's effective ``k_coarse``, ...), the
Module's call count, and the dtype and trailing shape of every gathered tensor (ids and
ASK's knowledge included). This times that exchange (encoding, the collective and the
comparison, exactly as :func:`~contrastive_losses.functional.info_nce` makes it) against
a whole training step of the loss (forward + backward, checks on, the exchange
included), both ranks running the same interleaved rounds; ratio = exchange / step.
The header's all_gather alone is also timed at its length before issue 29 (75 longs)
and now (131 longs: issue 33 added a grad bit to each tensor's slot).

    PYTHONPATH=src python benchmarks/bench_rank_exchange.py [--quick]

Each rank runs single-threaded (the 2 ranks share the machine's cores).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from timing import interleaved_times, markdown_table, warm_up, write_results

from contrastive_losses import InfoNCELoss, KCLLoss
from contrastive_losses import distributed as cd
from contrastive_losses._common import _scale_setting


def _exchange(a: torch.Tensor, t: torch.Tensor, temperature: torch.Tensor) -> None:
    """info_nce's exchange: its settings and tensors, one all_gather, the comparison."""
    with cd.validate_together(True, a) as v:
        v.batch = a.shape[0]
        v.agree(audio=a, text=t)
        v.settings(
            **_scale_setting(temperature, None),
            reduction="mean",
            chunk_size=None,
            normalize=True,
            ids_given=False,
        )


def _raw_gather(n: int) -> None:
    """The header's all_gather alone (``n`` longs), read back as the exchange does."""
    from torch.distributed import _functional_collectives as fc

    gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor
    out = gather(torch.zeros(n, dtype=torch.long), 0, dist.group.WORLD)
    fc.wait_tensor(out).tolist()


def _worker(rank: int, world: int, init: str, out: str, quick: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        b, d, k = (32, 64, 3) if quick else (256, 512, 3)
        g = torch.Generator().manual_seed(rank)
        a = torch.randn(b, d, generator=g).requires_grad_()
        t = torch.randn(b, d, generator=g).requires_grad_()
        tk = torch.randn(b, k, d, generator=g).requires_grad_()
        info, kcl = InfoNCELoss(gather=True), KCLLoss(gather=True)
        temperature = info.temperature

        def info_step() -> None:
            info(a, t).backward()

        def kcl_step() -> None:
            kcl(a, tk).backward()

        fns = {
            "InfoNCE step": info_step,
            "KCL step": kcl_step,
            "exchange": lambda: _exchange(a.detach(), t.detach(), temperature),
            "all_gather 75 longs": lambda: _raw_gather(75),
            "all_gather header": lambda: _raw_gather(cd._HEADER),
        }
        warm_up(0.5 if quick else 2.0)
        for _ in range(2 if quick else 10):  # a fixed number of rounds on every rank
            for fn in fns.values():
                fn()
        # Exactly `repeats` rounds (no time limit): a rank that ran one round more than
        # its peer would pair different collectives.
        times = interleaved_times(fns, 5 if quick else 60, warmup=0.0, alternate=True)
        if rank == 0:
            medians = {name: statistics.median(ts) for name, ts in times.items()}
            torch.save({"medians": medians, "shape": (b, d, k)}, Path(out) / "rank0.pt")
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes: check it runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        init = (Path(out) / f"rendezvous-{uuid.uuid4().hex}").as_uri()
        mp.start_processes(_worker, args=(2, init, out, args.quick), nprocs=2, join=True)
        result = torch.load(Path(out) / "rank0.pt")
    med, (b, d, k) = result["medians"], result["shape"]
    rows = [
        [
            "exchange / InfoNCE step",
            f"B={b}, D={d}",
            f"{med['exchange'] / med['InfoNCE step']:.4f}x",
        ],
        [
            "exchange / KCL step",
            f"B={b}, K={k}, D={d}",
            f"{med['exchange'] / med['KCL step']:.4f}x",
        ],
        [
            f"all_gather of {cd._HEADER} longs (the header) / of 75 (issue 22's)",
            "2 ranks",
            f"{med['all_gather header'] / med['all_gather 75 longs']:.3f}x",
        ],
    ]
    table = markdown_table(["what", "size", "ratio"], rows)
    print(table)
    times = {name: f"{s * 1e3:.3f} ms" for name, s in med.items()}
    print("medians (rank 0, this machine only):", times)
    write_results(
        "rank_exchange",
        {"quick": args.quick, "table_markdown": table, "header_longs": cd._HEADER},
        quick=args.quick,
    )


if __name__ == "__main__":
    main()
