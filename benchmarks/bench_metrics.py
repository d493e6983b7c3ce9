"""Speed and peak memory of contrastive_losses.metrics (a script, not a test).

    PYTHONPATH=src python benchmarks/bench_metrics.py              # 5k captions x 1k clips
    PYTHONPATH=src python benchmarks/bench_metrics.py --threads 1  # steadier on a busy box
    PYTHONPATH=src python benchmarks/bench_metrics.py --large      # + 50k x 10k memory run
    PYTHONPATH=src python benchmarks/bench_metrics.py --quick      # 500 x 100, D = 64: a check

``--quick`` (what ``run_all.py --quick`` passes, which keeps the output in
``results/quick/metrics.json``) shrinks every size and repeat count: it checks that the
script runs, it is not a measurement.

Speed: 5k text queries x 1k audio clips (5 captions per clip), D = 1024. Each metric is
timed on the precomputed (5k, 1k) similarity and reported as a ratio to one
(5k, D) @ (D, 1k) matmul timed in the same run (target <= 1.5x). Calls are interleaved
round-robin (one of each per round) after ~2 s of warm-up, and the median of the rounds
is kept, so a neighbour's load on this shared machine hits every call alike.

Memory: each case runs in a fresh subprocess; the kernel's peak-RSS mark is reset
(``/proc/self/clear_refs``) once the inputs exist, so "peak extra" is the high-water mark
of the call above the resident inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from contrastive_losses import metrics

N_AUDIO, N_CAPTIONS, DIM = 1000, 5, 1024
WARMUP_S, ROUNDS = 2.0, 25
QUICK = {"N_AUDIO": 100, "DIM": 64, "WARMUP_S": 0.2, "ROUNDS": 3}  # --quick overrides


def size(n_audio: int) -> str:
    """5000 -> "5k", 500 -> "500"."""
    return f"{n_audio // 1000}k" if n_audio % 1000 == 0 else str(n_audio)


# --------------------------------------------------------------------------- timing


def interleaved_medians(
    fns: dict[str, Callable[[], object]], warmup_s: float, rounds: int
) -> dict[str, tuple[float, float]]:
    """Median (wall s, process CPU s) of each callable; one call of each per round.

    Process CPU time (all threads) is the steadier figure when a neighbour loads the
    machine; wall time is what a user waits.
    """
    end = time.perf_counter() + warmup_s
    while time.perf_counter() < end:
        for fn in fns.values():
            fn()
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            w, c = time.perf_counter(), time.process_time()
            fn()
            cpu[name].append(time.process_time() - c)
            wall[name].append(time.perf_counter() - w)
    return {name: (statistics.median(wall[name]), statistics.median(cpu[name])) for name in fns}


# --------------------------------------------------------------------------- data


def make_inputs(n_audio: int, n_captions: int, dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    audio = torch.randn(n_audio, dim, generator=gen)
    text = torch.randn(n_audio, n_captions, dim, generator=gen)
    text.mul_(2.0).add_(audio[:, None])  # captions correlated with their clip
    return audio, text


def speed() -> None:
    audio, text = make_inputs(N_AUDIO, N_CAPTIONS, DIM)
    a = torch.nn.functional.normalize(audio, dim=-1)
    t = torch.nn.functional.normalize(text, dim=-1).reshape(-1, DIM)  # (5k, D)
    sim = t @ a.T  # (5k, 1k)
    cap_audio = torch.arange(N_AUDIO).repeat_interleave(N_CAPTIONS)
    n_t, n_a = size(N_AUDIO * N_CAPTIONS), size(N_AUDIO)
    matmul = f"matmul ({n_t},D)@(D,{n_a})"
    fns: dict[str, Callable[[], object]] = {
        matmul: lambda: t @ a.T,
        "recall_at_k(k=(1,5,10))": lambda: metrics.recall_at_k(sim, query_ids=cap_audio),
        "map_at_k(k=10)": lambda: metrics.map_at_k(sim, query_ids=cap_audio, k=10),
        "retrieval_ranks": lambda: metrics.retrieval_ranks(sim, query_ids=cap_audio),
        "A2T map_at_k(k=10) on sim.T": lambda: metrics.map_at_k(sim.T, gallery_ids=cap_audio, k=10),
        "audio_text_retrieval (both directions)": lambda: metrics.audio_text_retrieval(audio, text),
    }
    med = interleaved_medians(fns, WARMUP_S, ROUNDS)
    base_wall, base_cpu = med[matmul]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print(f"{n_t} captions x {n_a} clips, D = {DIM}; medians of {ROUNDS} interleaved rounds\n")
    print("| call | wall (ms) | wall / matmul | CPU (ms) | CPU / matmul |")
    print("|---|---:|---:|---:|---:|")
    rows = list(med.items())
    both = [med["recall_at_k(k=(1,5,10))"][i] + med["map_at_k(k=10)"][i] for i in (0, 1)]
    rows.append(("T2A R@1/5/10 + mAP@10 (two calls)", (both[0], both[1])))
    for name, (w, c) in rows:
        print(
            f"| {name} | {1e3 * w:.1f} | {w / base_wall:.2f}x | {1e3 * c:.1f} | "
            f"{c / base_cpu:.2f}x |"
        )
    print(
        "\naudio_text_retrieval embeds two matmuls of this size (T2A and A2T) plus "
        "normalisation; its ratio includes them."
    )


# --------------------------------------------------------------------------- memory


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise KeyError(key)


def memory_case(case: str) -> None:
    """Runs in a subprocess: prints a JSON line with the peak RSS above the inputs."""
    large = case.startswith("large")
    n_audio, dim = (10_000, 64) if large else (N_AUDIO, DIM)
    audio, text = make_inputs(n_audio, N_CAPTIONS, dim)
    cap_audio = torch.arange(n_audio).repeat_interleave(N_CAPTIONS)
    sim = None
    if case.startswith("sim"):
        a = torch.nn.functional.normalize(audio, dim=-1)
        sim = torch.nn.functional.normalize(text, dim=-1).reshape(-1, dim) @ a.T
        del a
    one_chunk = 10**9  # chunk_size larger than any query count: a single block
    calls: dict[str, Callable[[], object]] = {
        "sim_recall_chunked": lambda: metrics.recall_at_k(sim, query_ids=cap_audio),
        "sim_recall_unchunked": lambda: metrics.recall_at_k(
            sim, query_ids=cap_audio, chunk_size=one_chunk
        ),
        "sim_map_chunked": lambda: metrics.map_at_k(sim, query_ids=cap_audio),
        "sim_map_unchunked": lambda: metrics.map_at_k(
            sim, query_ids=cap_audio, chunk_size=one_chunk
        ),
        "emb_chunked": lambda: metrics.audio_text_retrieval(audio, text),
        "emb_unchunked": lambda: metrics.audio_text_retrieval(audio, text, chunk_size=one_chunk),
        "large_emb_chunked": lambda: metrics.audio_text_retrieval(audio, text),
    }
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS mark (VmHWM) to the current RSS
    before = _status_kb("VmRSS")
    start = time.perf_counter()
    calls[case]()
    seconds = time.perf_counter() - start
    peak = _status_kb("VmHWM")
    print(json.dumps({"case": case, "extra_mb": (peak - before) / 1024, "seconds": seconds}))


def memory(large: bool, quick: bool) -> None:
    shape = f"({size(N_AUDIO * N_CAPTIONS)}, {size(N_AUDIO)})"
    clips = f"{size(N_AUDIO)} clips x {N_CAPTIONS} captions"
    cases = [
        ("sim_recall_chunked", f"recall_at_k on the {shape} sim, default chunks"),
        ("sim_recall_unchunked", f"recall_at_k on the {shape} sim, one chunk"),
        ("sim_map_chunked", f"map_at_k on the {shape} sim, default chunks"),
        ("sim_map_unchunked", f"map_at_k on the {shape} sim, one chunk"),
        ("emb_chunked", f"audio_text_retrieval {clips}, default chunks"),
        ("emb_unchunked", f"audio_text_retrieval {clips}, one chunk"),
    ]
    if large:
        cases.append(("large_emb_chunked", "audio_text_retrieval 10k clips x 5 (50k x 10k), D=64"))
    sim_mb = N_AUDIO * N_AUDIO * N_CAPTIONS * 4 / 2**20
    print(f"\nPeak memory above the inputs (the {shape} float32 sim is {sim_mb:.1f} MB;")
    print("a 50k x 10k one would be 1907 MB)\n")
    print("| case | peak extra (MB) | time (s) |\n|---|---:|---:|")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    for case, label in cases:
        out = subprocess.run(
            [sys.executable, __file__, "--memory-case", case, *(["--quick"] if quick else [])],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {label} | {row['extra_mb']:.1f} | {row['seconds']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", action="store_true", help="also run the 50k x 10k memory case")
    parser.add_argument("--memory-case", help=argparse.SUPPRESS)
    parser.add_argument("--no-speed", action="store_true", help="memory only")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="small sizes, 3 rounds: a check")
    args = parser.parse_args()
    if args.quick:
        globals().update(QUICK)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_case:
        memory_case(args.memory_case)
        return
    if not args.no_speed:
        speed()
    memory(args.large, args.quick)


if __name__ == "__main__":
    main()
