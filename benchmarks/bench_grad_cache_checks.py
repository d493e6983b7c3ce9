"""What :class:`contrastive_losses.GradCache`'s replay checks cost, and how far GradCache with
dropout is from the full-batch step.

    python benchmarks/bench_grad_cache_checks.py [--quick] [--b 256] [--chunk 32] [--rounds 9]
        [--baseline FILE]   # a grad_cache.py without the checks, e.g.
                            # git show b7e870e:src/contrastive_losses/grad_cache.py > FILE

**Cost**: the encoders of ``bench_grad_cache.py`` (the example's CED and a 2-layer
transformer, no dropout; CPU, one thread, float32), one GradCache step at ``B`` rows in
chunks of ``chunk``: ``checked`` (the default: each replayed chunk compared with its first
pass), ``unchecked`` (``check_replay=False``: the module watch, the inputs' version
counters, the buffer and DDP checks still run) and, with ``--baseline``, the same step of
a GradCache without any check. The steps run interleaved in a new random order each round
after a warm-up; each ratio is taken per round on thread CPU time (the machine is shared),
and its median and range over the rounds are reported, for ``--runs`` such runs (the
summary: the median and range of the runs' medians).

**Dropout**: the same encoders with dropout ``p`` in both towers (``B_d`` rows, chunks of
``chunk_d``), for several seeds: the relative L2 distance ``|g - g_ref| / |g_ref|`` of the
encoders' gradients (every parameter, concatenated) between GradCache and

* the plain step run in the same chunks (the same dropout masks: float summation order);
* the full-batch plain step from the same seed (other masks: they are drawn per chunk);

and, for scale, between two full-batch plain steps from different seeds (two dropout
draws of the same step).

Results: ``results/grad_cache_checks.json`` (``--quick``: ``results/quick/``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_grad_cache import Setup, make_inputs, plain_step  # noqa: E402
from timing import interleaved_wall_and_cpu, warm_up, write_results  # noqa: E402

from contrastive_losses import GradCache  # noqa: E402


def load_baseline(path: str) -> type:
    """``GradCache`` of another ``grad_cache.py``, loaded inside the package (its relative
    imports resolve)."""
    name = "contrastive_losses._grad_cache_baseline"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.GradCache


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def check_cost(b: int, chunk: int, rounds: int, warmup: float, baseline: str | None) -> dict:
    s = Setup()
    wave, tokens = make_inputs(b)
    caches = {
        "checked": GradCache(s.loss_fn, chunk),
        "unchecked": GradCache(s.loss_fn, chunk, check_replay=False),
    }
    if baseline is not None:
        caches["baseline"] = load_baseline(baseline)(s.loss_fn, chunk)

    def step(cache: Any) -> Any:
        def fn() -> None:
            s.zero()
            cache(s.audio, wave, s.text, tokens, logit_scale=s.log_scale.exp())

        return fn

    warm_up(warmup)
    wall, cpu = interleaved_wall_and_cpu({n: step(c) for n, c in caches.items()}, rounds)
    out: dict[str, Any] = {"b": b, "chunk": chunk, "rounds": rounds}
    out["cpu_s"] = {n: spread(v) for n, v in cpu.items()}
    pairs = [("checked", "unchecked")]
    if "baseline" in caches:
        pairs += [("checked", "baseline"), ("unchecked", "baseline")]
    for num, den in pairs:
        ratios = [x / y for x, y in zip(cpu[num], cpu[den], strict=True)]
        out[f"{num}/{den}"] = spread(ratios)
        wall_ratios = [x / y for x, y in zip(wall[num], wall[den], strict=True)]
        out[f"{num}/{den} wall"] = spread(wall_ratios)
    return out


def _encoder_grad(s: Setup) -> Tensor:
    return torch.cat([g.flatten() for g in s.grads()[:-1]])  # the log-scale left out


def _chunked_plain(s: Setup, wave: Tensor, tokens: dict[str, Tensor], chunk: int) -> None:
    n = wave.shape[0]
    u = torch.cat([s.audio(wave[i : i + chunk]) for i in range(0, n, chunk)])
    v = torch.cat(
        [s.text(**{k: x[i : i + chunk] for k, x in tokens.items()}) for i in range(0, n, chunk)]
    )
    s.loss_fn(u, v, logit_scale=s.log_scale.exp()).backward()


def dropout_distance(b: int, chunk: int, p: float, seeds: int) -> dict[str, Any]:
    s = Setup(dropout=p)
    wave, tokens = make_inputs(b)

    def grad(kind: str, seed: int) -> Tensor:
        s.zero()
        torch.manual_seed(seed)
        if kind == "grad_cache":
            GradCache(s.loss_fn, chunk)(
                s.audio, wave, s.text, tokens, logit_scale=s.log_scale.exp()
            )
        elif kind == "chunked":
            _chunked_plain(s, wave, tokens, chunk)
        else:
            plain_step(s, wave, tokens, chunk)
        return _encoder_grad(s)

    def rel(g: Tensor, ref: Tensor) -> float:
        return float((g - ref).norm() / ref.norm())

    same_chunks, full_batch, two_draws = [], [], []
    for seed in range(seeds):
        cached = grad("grad_cache", seed)
        same_chunks.append(rel(cached, grad("chunked", seed)))
        full = grad("full", seed)
        full_batch.append(rel(cached, full))
        two_draws.append(rel(grad("full", 1000 + seed), full))
    return {
        "b": b, "chunk": chunk, "dropout": p, "seeds": seeds,
        "grad_cache_vs_plain_same_chunks": spread(same_chunks),
        "grad_cache_vs_full_batch": spread(full_batch),
        "full_batch_vs_full_batch_other_seed": spread(two_draws),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--b", type=int, default=256)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--runs", type=int, default=3, help="interleaved runs, each warmed up")
    p.add_argument("--baseline", default=None)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--dropout-b", type=int, default=64)
    p.add_argument("--dropout-chunk", type=int, default=16)
    p.add_argument("--seeds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    b, rounds, seeds = (64, 3, 2) if args.quick else (args.b, args.rounds, args.seeds)
    chunk = 16 if args.quick else args.chunk
    dropout = dropout_distance(args.dropout_b, args.dropout_chunk, args.dropout, seeds)
    print(json.dumps(dropout, indent=1), flush=True)
    runs = []
    for _ in range(1 if args.quick else args.runs):
        runs.append(check_cost(b, chunk, rounds, 1.0 if args.quick else 3.0, args.baseline))
        print(json.dumps(runs[-1], indent=1), flush=True)
    ratios = [k for k in runs[0] if "/" in k and not k.endswith("wall")]
    summary = {k: spread([r[k]["median"] for r in runs]) for k in ratios}
    print("median CPU-time ratio of each run:", json.dumps(summary, indent=1))
    payload = {"cost_summary": summary, "cost_runs": runs, "dropout": dropout}
    write_results("grad_cache_checks", payload, quick=args.quick)


if __name__ == "__main__":
    main()
