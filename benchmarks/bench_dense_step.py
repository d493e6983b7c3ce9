"""InfoNCE's dense one-process step against its matmul floor and against open_clip.

    python benchmarks/bench_dense_step.py [--quick] [--runs N] [--out PATH]

Two ratios (issue 49, item 7), forward + backward, float32, one process, one thread
(``torch.set_num_threads(1)``; run it under ``taskset -c N`` on a shared machine),
reduction mean, no ids:

* ``B = D = 1024``: ``info_nce``'s step (its defaults: normalised inputs, the checks on;
  temperature 0.07) over one bare ``(B, D) @ (D, B)`` matmul. The floor is 3 (one
  matmul forward, two backward); target at most 3.4x.
* ``B = 32``, ``D = 512``: the ``ClipLoss`` drop-in's step
  (``contrastive_losses.integrations.open_clip``, checks on) over open_clip's
  ``ClipLoss`` step, on the inputs of ``bench_open_clip.py`` (unit-norm features and
  the exp'd scale, all requiring grad); the fixed cost, target at most 1.10x.

``--baseline SRC`` (e.g. another checkout's ``src``) also times that copy of the package,
imported under another name, in the same rounds: the before/after of a change, same
process, same inputs (its rows: candidate ``baseline``).

Each case's calls run interleaved, each round in a new random order, after a
warm-up, many rounds; each call's thread CPU time is taken beside its wall time
(``timing.interleaved_wall_and_cpu``) and the medians are kept. The whole measurement
runs ``--runs`` times (default 3), interleaved case by case; the committed ratio is the
median of the runs' ratios with its range (``timing.combine_runs``). The targets are
judged on the CPU-time ratios: on a shared machine they leave out the waits for a core
(the wall ratios are beside them; equal on a quiet machine, one thread).
``--quick`` (``B = D = 256`` for the first case, a few rounds, one run) checks that the
script runs and writes ``results/quick/dense_step.json``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_memory import load_open_clip_loss
from bench_open_clip import make_step
from timing import combine_runs, interleaved_wall_and_cpu, markdown_table, warm_up, write_results

from contrastive_losses import functional as CF
from contrastive_losses.integrations import open_clip as ours

DENSE = "info_nce / one matmul"
SMALL = "ClipLoss / open_clip ClipLoss"
TARGETS = {(DENSE, 1024): 3.4, (SMALL, 32): 1.10}  # (case, B): the most the ratio may be
FIELDS = ("cpu_ratio", "wall_ratio", "cpu_ms", "ref_cpu_ms")


def load_baseline(src: Path) -> Any:
    """The ``contrastive_losses`` package under ``src``, imported as ``cl_baseline``."""
    init = src / "contrastive_losses" / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        "cl_baseline", init, submodule_search_locations=[str(init.parent)]
    )
    if spec is None or spec.loader is None:
        sys.exit(f"bench_dense_step: no package at {init}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["cl_baseline"] = module
    spec.loader.exec_module(module)
    return module


def baseline_provenance(src: Path) -> dict[str, str | None]:
    """The baseline's folder and, where it is in a git checkout, its commit."""
    try:
        done = subprocess.run(
            ["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True
        )
        commit = done.stdout.strip() or None
    except OSError:
        commit = None
    return {"src": str(src), "commit": commit}


def dense_case(b: int, baseline: Any) -> dict[str, Callable[[], object]]:
    """``info_nce``'s step at ``B = D = b`` (and the baseline's) and one
    ``(b, b) @ (b, b)`` matmul."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(b, b, generator=g).requires_grad_()
    t = torch.randn(b, b, generator=g).requires_grad_()
    x, y = torch.randn(b, b, generator=g), torch.randn(b, b, generator=g)

    def step(fn: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            a.grad = t.grad = None
            fn(a, t, temperature=0.07).backward()

        return run

    fns = {"ours": step(CF.info_nce), "reference": lambda: x @ y.T}
    if baseline is not None:
        fns["baseline"] = step(importlib.import_module("cl_baseline.functional").info_nce)
    return fns


def small_case(oc: Any, b: int, baseline: Any) -> dict[str, Callable[[], object]]:
    """The ``ClipLoss`` drop-in's step (and the baseline's) and open_clip's,
    ``bench_open_clip``'s inputs."""
    fns = {
        "ours": make_step(ours.ClipLoss(), False, b),
        "reference": make_step(oc.ClipLoss(), False, b),
    }
    if baseline is not None:
        theirs = importlib.import_module("cl_baseline.integrations.open_clip")
        fns["baseline"] = make_step(theirs.ClipLoss(), False, b)
    return fns


def measure(
    case: str, b: int, fns: dict[str, Callable[[], object]], rounds: int, warmup: float
) -> list[dict[str, Any]]:
    wall, cpu = interleaved_wall_and_cpu(fns, rounds, warmup=warmup)
    med = {clock: {n: statistics.median(ts) for n, ts in times.items()}
           for clock, times in (("cpu", cpu), ("wall", wall))}  # fmt: skip
    return [
        {
            "case": case,
            "candidate": name,
            "B": b,
            "rounds": len(cpu[name]),
            "cpu_ratio": med["cpu"][name] / med["cpu"]["reference"],
            "wall_ratio": med["wall"][name] / med["wall"]["reference"],
            "cpu_ms": med["cpu"][name] * 1e3,
            "ref_cpu_ms": med["cpu"]["reference"] * 1e3,
        }
        for name in fns
        if name != "reference"
    ]


def table(rows: list[dict[str, Any]]) -> str:
    body = []
    for r in rows:
        # none at --quick's sizes nor for the baseline
        target = TARGETS.get((r["case"], r["B"])) if r["candidate"] == "ours" else None
        ratio = r["cpu_ratio"]
        body.append(
            [
                r["case"],
                r["candidate"],
                r["B"],
                f"{ratio:.3g}x",
                f"{r.get('cpu_ratio_min', ratio):.3f}-{r.get('cpu_ratio_max', ratio):.3f}",
                f"{r['wall_ratio']:.3g}x",
                f"{r['cpu_ms']:.3g}",
                f"{r['ref_cpu_ms']:.3g}",
                "" if target is None else f"<= {target}x",
                "" if target is None else ("met" if ratio <= target else "MISSED"),
            ]
        )
    header = ["ratio", "candidate", "B", "cpu ratio (median of the runs)", "range over the runs"]
    header += ["wall ratio", "ours cpu ms", "reference cpu ms", "target", ""]
    return markdown_table(header, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="B = 256 dense, a few rounds")
    parser.add_argument("--out", type=Path, help="result file (default: results/dense_step.json)")
    parser.add_argument(
        "--runs", type=int, default=3, help="whole runs, interleaved case by case (default 3)"
    )
    parser.add_argument("--baseline", type=Path, help="another copy's src folder to time too")
    args = parser.parse_args()
    baseline = None if args.baseline is None else load_baseline(args.baseline)
    oc, provenance = load_open_clip_loss()
    if oc is None:
        sys.exit(f"bench_dense_step: needs open_clip's loss.py: {provenance}")
    torch.set_num_threads(1)
    warm_up(0.5 if args.quick else 2.0)
    dense_b = 256 if args.quick else 1024
    runs: list[list[dict[str, Any]]] = []
    for _ in range(1 if args.quick else args.runs):  # run r of every case, then r + 1
        dense = dense_case(dense_b, baseline)
        rows = measure(DENSE, dense_b, dense, 3 if args.quick else 40, 1.0)
        rows += measure(SMALL, 32, small_case(oc, 32, baseline), 20 if args.quick else 3000, 1.0)
        runs.append(rows)
    rows = combine_runs(runs, ("case", "candidate"), FIELDS)
    md = table(rows)
    print(md)
    payload = {"quick": args.quick, "open_clip": provenance, "runs": len(runs), "rows": rows}
    payload["baseline"] = None if args.baseline is None else baseline_provenance(args.baseline)
    payload["table_markdown"] = md
    path = write_results("dense_step", payload, quick=args.quick, path=args.out)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
