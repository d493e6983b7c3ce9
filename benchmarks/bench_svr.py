"""SupportVectorRegularizer cost at loss level: fwd+bwd time and peak memory as ratios to
its base loss, measured in the same run (CPU).

    python benchmarks/bench_svr.py [--runs 25] [--warmup 2] [--threads 1] [--quick]

Base and regulariser are timed alternately (base, svr, svr, base, ...) so that load from
other processes on a shared machine hits both alike. Two ratios: ``time_ratio``, the
median of the per-pair ratios, and ``time_ratio_fast``, the ratio of the 10th-percentile
times (the least-disturbed runs, the ``timeit`` convention on a noisy machine). Peak
memory counts the tensor storages allocated during one fwd+bwd (inputs excluded) with a
dispatch-mode tracker (``timing.peak_bytes``), since CPU tensors have no allocator
statistics; it runs after all timing (the tracker's weakref finalisers slow later runs
down). Writes ``benchmarks/results/svr.json`` (``--quick``: 5 runs, 0.2 s warm-up, into
``results/quick/svr.json``).

Cost model: per pair the base InfoNCE costs 3 (B x N x D) matmuls (logits + backward);
bi-directional SVR adds 7 (anchor-candidate similarities + 2 backward, and the
positives' Gram rows of both modalities, 1 + 1 each with the symmetric backward), uni
adds 5, so at B = 256 the matmul floor alone is ~1.9x on top of the base's own
normalisation and softmax; at B = 24 the per-op overhead dominates.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from timing import markdown_table, paired_times, peak_bytes, results_path

from contrastive_losses import InfoNCELoss, KCLLoss, SupportVectorRegularizer

D = 1024
K = 8
BATCHES = (24, 256)
VARIANTS = {  # name -> SupportVectorRegularizer kwargs
    "dynamic_bi": {"radius": "dynamic", "direction": "bi"},  # the default
    "static_bi": {"radius": "static", "direction": "bi"},
    "dynamic_uni": {"radius": "dynamic", "direction": "uni"},
}


# ----------------------------------------------------------------------- cases


def _step(loss_fn: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> Callable[[], None]:
    leaves = [x for x in inputs if x.requires_grad]

    def step() -> None:
        for x in leaves:
            x.grad = None
        loss_fn(*inputs).backward()

    return step


def _inputs(loss: str, b: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    audio = torch.randn(b, D, generator=g).requires_grad_()
    if loss == "info_nce":
        return audio, torch.randn(b, D, generator=g).requires_grad_()
    return audio, torch.randn(b, K, D, generator=g).requires_grad_()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=25)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="5 runs, 0.2 s warm-up")
    parser.add_argument("--out", type=Path, help="result file (default: see timing.results_path)")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.warmup = 5, 0.2
    if args.out is None:
        args.out = results_path("svr", args.quick)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    cases = []  # (loss, batch, variant, base step, svr step)
    for loss in ("info_nce", "kcl"):
        for b in BATCHES:
            inputs = _inputs(loss, b)
            base = InfoNCELoss(0.07) if loss == "info_nce" else KCLLoss(0.07)
            for variant, kwargs in VARIANTS.items():
                svr = SupportVectorRegularizer(base, **kwargs)
                cases.append((loss, b, variant, _step(base, inputs), _step(svr, inputs)))
    rows = []
    for loss, b, variant, base_step, svr_step in cases:
        t_base, t_svr = paired_times(base_step, svr_step, args.warmup, args.runs)
        ratios = [s / t for s, t in zip(t_svr, t_base, strict=True)]
        q_base = statistics.quantiles(t_base, n=10)[0]
        q_svr = statistics.quantiles(t_svr, n=10)[0]
        rows.append(
            {
                "loss": loss if loss == "info_nce" else f"kcl_k{K}",
                "batch": b,
                "variant": variant,
                "base_ms": 1e3 * statistics.median(t_base),
                "svr_ms": 1e3 * statistics.median(t_svr),
                "time_ratio": statistics.median(ratios),
                "time_ratio_quartiles": [
                    statistics.quantiles(ratios, n=4)[0],
                    statistics.quantiles(ratios, n=4)[2],
                ],
                "time_ratio_fast": q_svr / q_base,
            }
        )
        print(
            f"{rows[-1]['loss']:>9} B={b:<4} {variant:<12} time {rows[-1]['time_ratio']:.2f}x "
            f"(fast {rows[-1]['time_ratio_fast']:.2f}x; median "
            f"{rows[-1]['base_ms']:.2f} -> {rows[-1]['svr_ms']:.2f} ms)",
            flush=True,
        )
    base_peaks: dict[tuple[str, int], int] = {}
    for row, (loss, b, _, base_step, svr_step) in zip(rows, cases, strict=True):
        if (loss, b) not in base_peaks:
            base_peaks[loss, b] = peak_bytes(base_step)
        svr_peak = peak_bytes(svr_step)
        row["base_peak_mb"] = base_peaks[loss, b] / 2**20
        row["svr_peak_mb"] = svr_peak / 2**20
        row["memory_ratio"] = svr_peak / base_peaks[loss, b]
        print(
            f"{row['loss']:>9} B={b:<4} {row['variant']:<12} memory {row['memory_ratio']:.2f}x "
            f"({row['base_peak_mb']:.1f} -> {row['svr_peak_mb']:.1f} MB)",
            flush=True,
        )
    result = {
        "what": "SupportVectorRegularizer(base) / base, fwd+bwd at loss level, CPU",
        "dim": D,
        "kcl_languages": K,
        "threads": args.threads,
        "runs": args.runs,
        "load_average_1min_before": load_before,
        "warmup_s": args.warmup,
        "quick": args.quick,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "target_ratio": 2.2,
        "rows": rows,
        "table": markdown_table(
            ["loss", "B", "SVR", "time ratio", "fast", "memory ratio", "base ms", "svr ms"],
            [
                [
                    r["loss"],
                    r["batch"],
                    r["variant"],
                    f"{r['time_ratio']:.2f}",
                    f"{r['time_ratio_fast']:.2f}",
                    f"{r['memory_ratio']:.2f}",
                    f"{r['base_ms']:.2f}",
                    f"{r['svr_ms']:.2f}",
                ]
                for r in rows
            ],
        ),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
