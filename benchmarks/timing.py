"""Timing and memory helpers shared by the benchmark scripts.

Timings are only ever reported as ratios against a reference measured in the same run:
the candidates are run interleaved (A, B, A, B, ...) so that a slow patch of the machine
hits all of them alike, after a warm-up, and the median of many repeats is kept.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def warm_up(seconds: float = 2.0) -> None:
    """Spin matmuls for ``seconds``: the first ~0.5 s of a process runs slow here."""
    x = torch.randn(256, 256)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        x = torch.tanh(x @ x)


def interleaved_medians(
    fns: dict[str, Callable[[], object]], repeats: int, min_time: float = 0.0
) -> dict[str, float]:
    """Median seconds per call of each ``fn``, run interleaved ``repeats`` times (at least
    ``min_time`` seconds in all)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # one untimed call each: allocator and kernel caches
        fn()
    start = time.perf_counter()
    rounds = 0
    while rounds < repeats or time.perf_counter() - start < min_time:
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        rounds += 1
    return {name: statistics.median(ts) for name, ts in times.items()}


def saved_tensor_bytes(fn: Callable[[], torch.Tensor]) -> int:
    """Bytes that autograd keeps alive between forward and backward (activation memory),
    counting each storage once. A device-independent stand-in for peak memory on CPU."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.backward()
    return sum(seen.values())


def machine() -> dict[str, object]:
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
    }


def write_results(name: str, payload: dict[str, object]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    return path


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    def fmt(v: object) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
