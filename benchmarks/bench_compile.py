"""What the performance switches buy: forward+backward of every loss in eager mode with
the value checks on (the default), eager with them off (``validate_args=False``), and
``torch.compile(loss, fullgraph=True)`` (inductor, the value checks step aside by
themselves), as ratios to the checked eager step measured in the same run.

    python benchmarks/bench_compile.py [--quick] [--out PATH]

Losses (float32, ``D = 512``): ``InfoNCELoss`` (learnable temperature), ``SigLIPLoss``,
``KCLLoss`` (``K = 8`` captions, learnable temperature), ``CACLLoss``, the default
``SupportVectorRegularizer(KCLLoss)`` (dynamic radius, both directions) and ``ask`` on
given knowledge (``k = 10`` fine and coarse pairs per sample; the bank search is no part
of the step), at ``B`` in {24, 256, 1024}. One step: zero the gradients, the loss, its
backward. The three candidates run interleaved (A, B, C, C, B, A, ...) after a warm-up
(their first calls compile); the median per candidate is kept. One thread
(``torch.set_num_threads(1)``): the machine is shared, and the ratios are what matters.
Each ``B`` compiles anew (static shapes, the usual training setting); compile time is
reported separately, it is paid once per shape.

On CPU a host sync is nearly free (the "device" is the host), so checks-off vs checks-on
here measures the work of the checks themselves (a norm pass and a few reductions),
not the stall a sync causes on a GPU, where the CPU can no longer run ahead of the
kernels. ``--quick`` (``B = 24``, a few repeats) only checks that the script runs.

The training loop: the one-call figures reuse the same input tensors, which a compiled
function may guard on; a real loop feeds new tensors every step. So each loss also runs
as the steady-state step of a loop (two ``nn.Linear(D, D)`` encoders on a new batch each
step, the loss, backward, an SGD step), eager with the checks on against the compiled
loss (the graph compiled above, counted: ``loop recompiles`` must be 0), interleaved,
medians, at least 20 steps each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from timing import interleaved_times, markdown_table, warm_up, write_results

from contrastive_losses import (
    CACLLoss,
    InfoNCELoss,
    KCLLoss,
    SigLIPLoss,
    SupportVectorRegularizer,
)
from contrastive_losses import functional as CF

D, K, K_KNOWLEDGE = 512, 8, 10


def _ask(validate: bool) -> Callable[..., torch.Tensor]:
    def loss(a: torch.Tensor, t: torch.Tensor, *knowledge: torch.Tensor) -> torch.Tensor:
        return CF.ask(a, t, *knowledge, validate_args=validate)

    return loss


# name -> (build(validate_args) -> loss, inputs(B, generator) -> tensors)
LOSSES: dict[str, tuple[Callable[[bool], Any], Callable[[int, torch.Generator], list]]] = {
    "InfoNCE": (
        lambda v: InfoNCELoss(learnable_temperature=True, validate_args=v),
        lambda b, g: [torch.randn(b, D, generator=g), torch.randn(b, D, generator=g)],
    ),
    "SigLIP": (
        lambda v: SigLIPLoss(validate_args=v),
        lambda b, g: [torch.randn(b, D, generator=g), torch.randn(b, D, generator=g)],
    ),
    "KCL": (
        lambda v: KCLLoss(learnable_temperature=True, validate_args=v),
        lambda b, g: [torch.randn(b, D, generator=g), torch.randn(b, K, D, generator=g)],
    ),
    "CACL": (
        lambda v: CACLLoss(validate_args=v),
        lambda b, g: [torch.randn(b, D, generator=g) for _ in range(3)],
    ),
    "SVR(KCL), dynamic": (
        lambda v: SupportVectorRegularizer(KCLLoss(validate_args=v), validate_args=v),
        lambda b, g: [torch.randn(b, D, generator=g), torch.randn(b, K, D, generator=g)],
    ),
    "ask (given knowledge)": (
        _ask,
        lambda b, g: (
            [torch.randn(b, D, generator=g), torch.randn(b, D, generator=g)]
            + [
                F.normalize(torch.randn(b, K_KNOWLEDGE, 2, D, generator=g), dim=-1)
                for _ in range(4)
            ]
        ),
    ),
}


def _step(loss_fn: Any, inputs: list[torch.Tensor]) -> Callable[[], None]:
    leaves = [x.clone().requires_grad_(i < 2) for i, x in enumerate(inputs)]
    params = list(loss_fn.parameters()) if isinstance(loss_fn, torch.nn.Module) else []

    def step() -> None:
        for x in leaves[:2]:
            x.grad = None
        for p in params:
            p.grad = None
        loss_fn(*leaves).backward()

    return step


class CountingBackend:
    """The inductor backend, counting the graphs it compiles (a recompile is a second)."""

    def __init__(self) -> None:
        self.inner = torch._dynamo.lookup_backend("inductor")
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        self.graphs += 1
        return self.inner(gm, example_inputs)


def _loop_step(loss_fn: Any, pool: list[list[torch.Tensor]]) -> Callable[[], None]:
    """One step of a training loop: fresh non-leaf embeddings from two linear encoders
    (a new batch of the ``pool`` each step), the loss, backward, an optimizer step."""
    torch.manual_seed(1)
    encoders = [torch.nn.Linear(D, D), torch.nn.Linear(D, D)]
    params = [p for m in encoders for p in m.parameters()]
    if isinstance(loss_fn, torch.nn.Module):
        params += list(loss_fn.parameters())
    opt = torch.optim.SGD(params, lr=1e-4)
    count = iter(range(1 << 62))

    def step() -> None:
        raw = pool[next(count) % len(pool)]
        opt.zero_grad(set_to_none=True)
        loss_fn(encoders[0](raw[0]), encoders[1](raw[1]), *raw[2:]).backward()
        opt.step()

    return step


def bench(name: str, batch: int, repeats: int, min_time: float) -> dict[str, object]:
    """One call on the same leaves (``checks on``/``off``/``compiled``), then the
    steady-state step of a training loop, eager (checks on) and compiled."""
    build, make_inputs = LOSSES[name]
    inputs = make_inputs(batch, torch.Generator().manual_seed(batch))
    torch.manual_seed(0)
    checked, unchecked, to_compile = build(True), build(False), build(True)
    torch._dynamo.reset()
    counter = CountingBackend()
    compiled = torch.compile(to_compile, fullgraph=True, dynamic=False, backend=counter)
    compiled_step = _step(compiled, inputs)
    t0 = time.perf_counter()
    compiled_step()  # compiles forward and backward
    compile_s = time.perf_counter() - t0
    steps = {
        "eager, checks on": _step(checked, inputs),
        "eager, checks off": _step(unchecked, inputs),
        "compiled": compiled_step,
    }
    times = interleaved_times(steps, repeats, min_time=min_time, warmup=1.0, alternate=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    ref = med["eager, checks on"]
    # The loop: every step new embeddings (new tensor objects), as in training; the
    # compiled loss must serve them all with the graph compiled above.
    g = torch.Generator().manual_seed(batch + 1)
    pool = [make_inputs(batch, g) for _ in range(4)]
    graphs_before = counter.graphs
    loops = {"loop, eager": _loop_step(checked, pool), "loop, compiled": _loop_step(compiled, pool)}
    loop_times = interleaved_times(
        loops, max(repeats, 20), min_time=min_time, warmup=1.0, alternate=True
    )
    loop_med = {k: statistics.median(v) for k, v in loop_times.items()}
    return {
        "loss": name,
        "B": batch,
        "checks_on_ms": 1e3 * ref,
        "checks_off_ratio": med["eager, checks off"] / ref,
        "compiled_ratio": med["compiled"] / ref,
        "compiled_vs_checks_off": med["compiled"] / med["eager, checks off"],
        "compile_s": compile_s,
        "runs": len(times["compiled"]),
        "loop_eager_ms": 1e3 * loop_med["loop, eager"],
        "loop_compiled_ratio": loop_med["loop, compiled"] / loop_med["loop, eager"],
        "loop_steps": len(loop_times["loop, compiled"]),
        "loop_recompiles": counter.graphs - graphs_before,
    }


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of the result rows."""
    return markdown_table(
        [
            "loss",
            "B",
            "eager, checks on (ms)",
            "checks off / on",
            "compiled / checks on",
            "compiled / checks off",
            "compile (s)",
            "loop step, eager (ms)",
            "loop compiled / eager",
            "loop recompiles",
        ],
        [
            [
                r["loss"],
                r["B"],
                r["checks_on_ms"],
                f"{r['checks_off_ratio']:.3f}x",
                f"{r['compiled_ratio']:.3f}x",
                f"{r['compiled_vs_checks_off']:.3f}x",
                f"{r['compile_s']:.0f}",
                r["loop_eager_ms"],
                f"{r['loop_compiled_ratio']:.3f}x",
                f"{r['loop_recompiles']} in {r['loop_steps']} steps",
            ]
            for r in rows
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="B = 24, 3 repeats: a check, not a measurement"
    )
    parser.add_argument("--only", nargs="*", help="loss names (default: all)")
    parser.add_argument("--out", type=Path, help="result file (default: see timing.results_path)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    batches = [24] if args.quick else [24, 256, 1024]
    warm_up(0.5 if args.quick else 2.0)
    rows: list[dict[str, Any]] = []
    for name in args.only or LOSSES:
        for batch in batches:
            if args.quick:
                row = bench(name, batch, repeats=3, min_time=0.0)
            else:
                row = bench(name, batch, repeats=41 if batch < 1024 else 11, min_time=4.0)
            rows.append(row)
            print(
                f"{name:24s} B={batch:5d} on {row['checks_on_ms']:8.2f} ms  off "
                f"{row['checks_off_ratio']:.3f}x  compiled {row['compiled_ratio']:.3f}x  "
                f"(compile {row['compile_s']:.0f} s, {row['runs']} runs)  loop: eager "
                f"{row['loop_eager_ms']:8.2f} ms, compiled {row['loop_compiled_ratio']:.3f}x, "
                f"{row['loop_recompiles']} recompiles in {row['loop_steps']} steps",
                flush=True,
            )
    md = table(rows)
    print()
    print(md)
    payload = {
        "quick": args.quick,
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "rows": rows,
        "table_markdown": md,
    }
    path = write_results("compile", payload, quick=args.quick, path=args.out)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
