"""Timing and memory helpers shared by the benchmark scripts.

Timings are only ever reported as ratios against a reference measured in the same run:
the candidates are run interleaved (A, B, A, B, ...) so that a slow patch of the machine
hits all of them alike, after a warm-up, and the median of many repeats is kept.

Results: a full run writes ``results/<name>.json``; a ``--quick`` run (a check that the
script works, not a measurement) writes ``results/quick/<name>.json`` so that it never
overwrites the committed numbers.
"""

from __future__ import annotations

import json
import math
import platform
import random
import statistics
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

RESULTS = Path(__file__).parent / "results"
QUICK_RESULTS = RESULTS / "quick"


# ----------------------------------------------------------------------- timing


def warm_up(seconds: float = 2.0) -> None:
    """Spin matmuls for ``seconds``: the first ~0.5 s of a process runs slow here."""
    x = torch.randn(256, 256)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        x = torch.tanh(x @ x)


def interleaved_times(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    *,
    min_time: float = 0.0,
    max_time: float = math.inf,
    warmup: float = 0.0,
    alternate: bool = False,
    shuffle: bool = False,
) -> dict[str, list[float]]:
    """Wall seconds of every call of each ``fn``, run interleaved round by round.

    Warm-up: every ``fn`` is called (untimed) at least once, round by round until
    ``warmup`` seconds have passed. Then rounds of one timed call each run while fewer
    than ``repeats`` rounds are done or less than ``min_time`` seconds have passed, but
    stop at ``max_time`` seconds once ``min(3, repeats)`` rounds are done. With
    ``alternate`` every other round runs the ``fns`` in reverse order (A, B, B, A, ...), so
    neither always runs first. With ``shuffle`` every round runs them in a new random
    order (seeded): a call's cost depends on what ran just before it (caches), up to
    15% for sub-millisecond calls, and alternating keeps each one's neighbours.
    """
    start = time.perf_counter()
    for fn in fns.values():  # allocator and kernel caches
        fn()
    while time.perf_counter() - start < warmup:
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    items = list(fns.items())
    rng = random.Random(0)
    start = time.perf_counter()
    rounds = 0
    while True:
        elapsed = time.perf_counter() - start
        if rounds >= min(3, repeats) and elapsed >= max_time:
            break
        if rounds >= repeats and elapsed >= min_time:
            break
        order = items[::-1] if alternate and rounds % 2 else items
        if shuffle:
            order = rng.sample(items, len(items))
        for name, fn in order:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        rounds += 1
    return times


def interleaved_wall_and_cpu(
    fns: dict[str, Callable[[], object]], repeats: int, *, warmup: float = 0.0
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """:func:`interleaved_times` (a random order each round) with each call's thread CPU time
    beside its wall time: ``(wall, cpu)`` seconds per timed call, round by round. On a
    shared machine the CPU time leaves out the time the thread waited for a core, so
    its ratios are far less noisy; the two agree on a quiet machine (one thread)."""
    cpu: dict[str, list[float]] = {name: [] for name in fns}

    def timed(name: str, fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            c0 = time.thread_time()
            fn()
            cpu[name].append(time.thread_time() - c0)

        return run

    wall = interleaved_times(
        {name: timed(name, fn) for name, fn in fns.items()}, repeats, warmup=warmup, shuffle=True
    )
    return wall, {name: cpu[name][-len(ts) :] for name, ts in wall.items()}  # no warm-up


def interleaved_medians(
    fns: dict[str, Callable[[], object]], repeats: int, min_time: float = 0.0
) -> dict[str, float]:
    """Median seconds per call of each ``fn``, run interleaved ``repeats`` times (at least
    ``min_time`` seconds in all)."""
    times = interleaved_times(fns, repeats, min_time=min_time)
    return {name: statistics.median(ts) for name, ts in times.items()}


def paired_times(
    base: Callable[[], object], other: Callable[[], object], warmup: float, runs: int
) -> tuple[list[float], list[float]]:
    """Alternate the two steps (base, other, other, base, ...) ``runs`` times after
    ``warmup`` seconds of both; return their wall times in seconds, pair by pair."""
    times = interleaved_times({"base": base, "other": other}, runs, warmup=warmup, alternate=True)
    return times["base"], times["other"]


def median_time(
    fn: Callable[[], object], warmup: float, runs: int, budget: float
) -> tuple[float, int]:
    """Median wall time of ``fn`` after ``warmup`` seconds of calls: up to ``runs`` calls,
    stopping after ``budget`` seconds once 3 are done. Returns ``(median, calls timed)``."""
    times = interleaved_times({"fn": fn}, runs, max_time=budget, warmup=warmup)["fn"]
    return statistics.median(times), len(times)


def combine_runs(
    runs: list[list[dict[str, Any]]], key: tuple[str, ...], fields: tuple[str, ...]
) -> list[dict[str, Any]]:
    """Rows of several whole runs of a benchmark, one row per ``key``: each ``field`` the
    median over the runs, with ``<field>_min`` / ``<field>_max`` (the range) and
    ``<field>_runs`` (every run's value) beside it; the other entries are the first run's.
    A committed timing is the median of >= 3 interleaved runs quoted with its range: the
    runs are interleaved case by case (run 1 of every case, then run 2, ...), so a slow
    patch of the machine lands on one run of every case, not on every run of one."""
    combined = []
    for row in runs[0]:
        ident = tuple(row[k] for k in key)
        same = [r for rows in runs for r in rows if tuple(r[k] for k in key) == ident]
        out = dict(row, runs=len(same))
        for f in fields:
            values = [r[f] for r in same if f in r]
            if not values:
                continue
            out[f] = statistics.median(values)
            out[f"{f}_min"], out[f"{f}_max"] = min(values), max(values)
            out[f"{f}_runs"] = values
        combined.append(out)
    return combined


# ----------------------------------------------------------------------- memory


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


def _storages(tree: object) -> list[torch.UntypedStorage]:
    return [x.untyped_storage() for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


class PeakMemory(TorchDispatchMode):
    """Live bytes of storages created by ops while active (views of inputs excluded).

    CPU tensors have no allocator statistics; this tracks every storage an op returns
    until it is freed. Its weakref finalisers slow later code down: measure after timing.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._alive: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        inputs = {s.data_ptr() for s in _storages((args, kwargs))}
        for storage in _storages(out):
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in inputs or key in self._alive:
                continue
            self._alive.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, nbytes)
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self._alive.discard(key)
        self.live -= nbytes


def peak_bytes(step: Callable[[], object]) -> int:
    """Peak bytes of the storages allocated during ``step()`` (inputs excluded)."""
    with PeakMemory() as mem:
        step()
    return mem.peak


# ----------------------------------------------------------------------- results


def machine() -> dict[str, object]:
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
    }


def results_path(name: str, quick: bool = False) -> Path:
    """``results/<name>.json``, or ``results/quick/<name>.json`` for a ``--quick`` run."""
    return (QUICK_RESULTS if quick else RESULTS) / f"{name}.json"


def write_results(
    name: str, payload: dict[str, object], *, quick: bool = False, path: Path | None = None
) -> Path:
    path = path if path is not None else results_path(name, quick)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
    return path


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    def fmt(v: object) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
