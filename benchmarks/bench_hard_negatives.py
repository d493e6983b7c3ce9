"""Hard negatives' cost (issue 49, item 1): InfoNCE with ``H`` text negatives per row,
forward and backward, as ratios to references measured in the same run.

* ``plain``: ``info_nce(a, t)``, the step without negatives. The target: with ``H``
  negatives per row (``B*H`` extra columns for every anchor) at most ``(1 + H)`` times it,
  the ratio of the a->t matmuls' sizes (``B x B(1+H)`` against ``B x B``).
* ``concat_ce``: what sentence-transformers' MultipleNegativesRankingLoss computes, written
  with plain torch: normalise, one ``(B, B + BH)`` logits matrix and its cross-entropy,
  plus the t->a cross-entropy, halved.
* ``both_sides``: ``H`` text and ``H`` audio negatives (both directions widened).
* ``tiled``: ``chunk_size=64`` with ``H`` negatives against the plain tiled step.

Every candidate runs interleaved in a random order each round after a warm-up (``timing``),
one CPU thread, float32, ``B = D = 256``; its thread CPU time (less noisy than wall time
on a shared machine) and wall time are kept per call and their medians compared. ``--runs``
whole runs are combined (median and range of each ratio, ``timing.combine_runs``).

Run: ``python benchmarks/bench_hard_negatives.py [--runs 3] [--quick]``; writes
results/hard_negatives.json (``--quick``: results/quick/hard_negatives.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from timing import (
    combine_runs,
    interleaved_wall_and_cpu,
    markdown_table,
    warm_up,
    write_results,
)

from contrastive_losses import functional as CF

TAU = 0.07


def concat_ce(a: torch.Tensor, t: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """MultipleNegativesRankingLoss's logits, symmetric: a->t over ``[t; n]``, t->a over a."""
    a, t, n = (F.normalize(x, dim=-1) for x in (a, t, n))
    target = torch.arange(a.shape[0])
    a2t = (a / TAU) @ torch.cat([t, n.flatten(0, 1)]).T
    t2a = (t / TAU) @ a.T
    return (F.cross_entropy(a2t, target) + F.cross_entropy(t2a, target)) / 2


def _step(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> Callable[[], None]:
    """Forward and backward from fresh leaves."""
    leaves = [x.clone().requires_grad_() for x in xs]

    def run() -> None:
        for x in leaves:
            x.grad = None
        fn(*leaves).backward()

    return run


def one_run(b: int, d: int, hs: list[int], repeats: int, warmup: float) -> list[dict]:
    """Rows ``{"h", "case", "cpu_ratio", "wall_ratio", "reference"}`` of one run."""
    g = torch.Generator().manual_seed(0)
    a, t = torch.randn(b, d, generator=g), torch.randn(b, d, generator=g)
    fns: dict[str, Callable[[], None]] = {
        "plain": _step(lambda a, t: CF.info_nce(a, t, TAU), a, t),
        "plain_tiled": _step(lambda a, t: CF.info_nce(a, t, TAU, chunk_size=64), a, t),
    }
    for h in hs:
        n, m = torch.randn(b, h, d, generator=g), torch.randn(b, h, d, generator=g)
        fns[f"ours_{h}"] = _step(lambda a, t, n: CF.info_nce(a, t, TAU, hard_negatives=n), a, t, n)
        fns[f"concat_ce_{h}"] = _step(concat_ce, a, t, n)
        fns[f"both_sides_{h}"] = _step(
            lambda a, t, n, m: CF.info_nce(a, t, TAU, hard_negatives=n, audio_hard_negatives=m),
            a,
            t,
            n,
            m,
        )
        fns[f"tiled_{h}"] = _step(
            lambda a, t, n: CF.info_nce(a, t, TAU, hard_negatives=n, chunk_size=64), a, t, n
        )
    wall, cpu = interleaved_wall_and_cpu(fns, repeats, warmup=warmup)
    med = {k: (statistics.median(cpu[k]), statistics.median(wall[k])) for k in fns}
    rows = []
    for h in hs:
        for case, ref in (
            ("ours", "plain"),
            ("ours", "concat_ce"),
            ("both_sides", "plain"),
            ("tiled", "plain_tiled"),
        ):
            ref_key = ref if ref.startswith("plain") else f"{ref}_{h}"
            c, w = med[f"{case}_{h}"]
            rc, rw = med[ref_key]
            rows.append(
                {
                    "h": h,
                    "case": case,
                    "reference": ref,
                    "cpu_ratio": c / rc,
                    "wall_ratio": w / rw,
                    "cpu_ms": 1e3 * c,
                    "reference_cpu_ms": 1e3 * rc,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3, help="whole runs combined (median, range)")
    parser.add_argument("--repeats", type=int, default=50, help="timed rounds per run")
    parser.add_argument("--quick", action="store_true", help="a check that the script runs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    b, d, hs = (32, 16, [1]) if args.quick else (256, 256, [1, 3])
    runs, repeats = (1, 3) if args.quick else (args.runs, args.repeats)
    warm_up(0.2 if args.quick else 2.0)
    results = [one_run(b, d, hs, repeats, 0.1 if args.quick else 1.0) for _ in range(runs)]
    rows = combine_runs(results, ("h", "case", "reference"), ("cpu_ratio", "wall_ratio"))
    table = markdown_table(
        ["H", "case", "vs", "CPU ratio (median)", "min", "max", "wall ratio", "target"],
        [
            [
                r["h"],
                r["case"],
                r["reference"],
                r["cpu_ratio"],
                r["cpu_ratio_min"],
                r["cpu_ratio_max"],
                r["wall_ratio"],
                f"<= {1 + r['h']}" if r["case"] == "ours" and r["reference"] == "plain" else "",
            ]
            for r in rows
        ],
    )
    print(table)
    payload = {
        "batch": b,
        "dim": d,
        "runs": runs,
        "repeats": repeats,
        "rows": rows,
        "table_markdown": table,
    }
    print(write_results("hard_negatives", payload, quick=args.quick))


if __name__ == "__main__":
    main()
