"""MatryoshkaLoss cost at loss level: fwd+bwd time with 4 nested dims as a ratio to its
base loss on the full dim alone, measured in the same run (CPU).

    python benchmarks/bench_matryoshka.py [--runs 25] [--repeat 3] [--warmup 2] [--threads 1]
                                          [--quick]

Base and wrapper are timed alternately (base, matryoshka, matryoshka, base, ...) so that
load from other processes hits both alike; ``time_ratio`` is the median of the per-pair
ratios, with its quartiles, and ``time_ratio_fast`` the ratio of the 10th-percentile
times. The whole measurement is repeated ``--repeat`` times, case by case
(``timing.combine_runs``): each figure is the median of the repeats with their range.
Writes ``benchmarks/results/matryoshka.json`` (``--quick``: one repeat of 5 runs, 0.2 s
warm-up, into ``results/quick/matryoshka.json``). About a minute.

Cost model: with ``dims = (D, D/2, D/4, D/8)`` the prefixes' matmuls are
``1 + 1/2 + 1/4 + 1/8 = 1.875`` of the full one's; the (B, B) softmaxes and the fixed
per-call costs (checks, normalisation) are paid once per dim, so the ratio rises above
1.875 where the matmuls do not dominate. Target: <= 2 at B = 256.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from timing import combine_runs, markdown_table, paired_times, write_results

from contrastive_losses import InfoNCELoss, KCLLoss, MatryoshkaLoss, SigLIPLoss

D = 1024
K = 4
B = 256
DIMS = (D, D // 2, D // 4, D // 8)
BASES: dict[str, Callable[[], torch.nn.Module]] = {
    "info_nce": InfoNCELoss,
    "siglip": SigLIPLoss,
    f"kcl_k{K}": KCLLoss,
}


def _step(loss_fn: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> Callable[[], None]:
    def step() -> None:
        for x in inputs:
            x.grad = None
        loss_fn(*inputs).backward()

    return step


def _inputs(name: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    audio = torch.randn(B, D, generator=g).requires_grad_()
    shape = (B, K, D) if name.startswith("kcl") else (B, D)
    return audio, torch.randn(*shape, generator=g).requires_grad_()


def _measure(
    name: str, base_step: Callable[[], None], wrapped_step: Callable[[], None], args: Any
) -> dict[str, Any]:
    """One measurement of a case: ``args.runs`` alternated pairs after the warm-up."""
    t_base, t_mat = paired_times(base_step, wrapped_step, args.warmup, args.runs)
    ratios = [m / b for m, b in zip(t_mat, t_base, strict=True)]
    quartiles = statistics.quantiles(ratios, n=4)
    return {
        "loss": name,
        "batch": B,
        "dims": list(DIMS),
        "base_ms": 1e3 * statistics.median(t_base),
        "matryoshka_ms": 1e3 * statistics.median(t_mat),
        "time_ratio": statistics.median(ratios),
        "time_ratio_quartiles": [quartiles[0], quartiles[2]],
        "time_ratio_fast": statistics.quantiles(t_mat, n=10)[0]
        / statistics.quantiles(t_base, n=10)[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=25)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3, help="whole measurements (>= 1)")
    parser.add_argument("--quick", action="store_true", help="1 repeat of 5 runs, 0.2 s warm-up")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.repeat, args.warmup = 5, 1, 0.2
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    cases = []
    for name, make in BASES.items():
        inputs = _inputs(name)
        base = make()
        cases.append((name, _step(base, inputs), _step(MatryoshkaLoss(base, DIMS), inputs)))
    runs = [[_measure(*case, args) for case in cases] for _ in range(args.repeat)]
    fields = ("base_ms", "matryoshka_ms", "time_ratio", "time_ratio_fast")
    rows = combine_runs(runs, ("loss",), fields)
    for r in rows:
        print(
            f"{r['loss']:>9} B={B} dims={DIMS}: {r['time_ratio']:.2f}x (range "
            f"{r['time_ratio_min']:.2f}-{r['time_ratio_max']:.2f} over {r['runs']} repeats; "
            f"median {r['base_ms']:.2f} -> {r['matryoshka_ms']:.2f} ms)",
            flush=True,
        )
    payload = {
        "what": "MatryoshkaLoss(base, dims) / base on the full dim, fwd+bwd at loss level, CPU",
        "dim": D,
        "kcl_languages": K,
        "threads": args.threads,
        "runs": args.runs,
        "repeat": args.repeat,
        "warmup_s": args.warmup,
        "load_average_1min_before": load_before,
        "quick": args.quick,
        "torch": torch.__version__,
        "matmul_share": sum(DIMS) / D,
        "target_ratio": 2.0,
        "rows": rows,
        "table": markdown_table(
            ["loss", "B", "dims", "time ratio", "range", "fast", "base ms", "matryoshka ms"],
            [
                [
                    r["loss"],
                    r["batch"],
                    "/".join(map(str, r["dims"])),
                    f"{r['time_ratio']:.2f}",
                    f"{r['time_ratio_min']:.2f}-{r['time_ratio_max']:.2f}",
                    f"{r['time_ratio_fast']:.2f}",
                    f"{r['base_ms']:.2f}",
                    f"{r['matryoshka_ms']:.2f}",
                ]
                for r in rows
            ],
        ),
    }
    print(f"wrote {write_results('matryoshka', payload, quick=args.quick)}")


if __name__ == "__main__":
    main()
