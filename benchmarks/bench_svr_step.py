"""SupportVectorRegularizer cost in a whole training step of the example trainer's model
(CED-Base audio tower + SONAR-size text tower, ML-CLAP heads, KCL, Adam), as ratios to
the same step without SVR. Compare SupCLAP App. E.11 Table 14 (+0.04 to +0.48 % GPU
memory, -1.7 to +2.3 % time per run).

    python benchmarks/bench_svr_step.py [--pairs 6] [--memory-repeats 2] [--quick]

One step is what ``examples/clap_example/train.py`` does per batch: ``zero_grad``, both
towers forward, the loss with ``return_terms=True`` (its terms read as floats, as the
trainer logs them), backward, gradient clipping at 1.0, ``Adam.step``. Random weights,
random waveforms and token ids, CPU, float32, ``B = 8`` clips with ``K = 8`` captions
each (the trainer's default KCL loss), ``torch.set_num_threads(1)``.

Time: one process holds the model and both losses (``KCLLoss`` and the default
``SupportVectorRegularizer(KCLLoss)``: dynamic radius, both directions) and alternates
whole steps (base, svr, svr, base, ...) after a warm-up; the ratio is the median of the
per-pair ratios. Memory: CPU tensors have no allocator statistics, so every
configuration runs in a fresh process of its own (alternating base, svr, svr, base...)
that builds the model, runs two steps (Adam's state exists from the first) and reports
its peak resident set size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``); the ratio is
of the medians. Peak RSS is what a GPU's peak-memory figure is on CPU: weights, grads,
Adam state, activations and the runtime.

Size: the full model with Adam (SONAR's 256k-token embedding and 24 layers of width
1024, ~0.8 G parameters, x4 for weights, grads and Adam's two moments) needs > 13 GB;
the machine this ran on is shared. So the text tower keeps SONAR's width (d_model 1024,
16 heads, FFN 8192) with fewer layers and a smaller vocabulary, and clips are shorter
than the trainer's 10 s crop (``--text-layers``, ``--vocab``, ``--seconds``). This is a
conservative bound: the SVR's cost depends only on ``B``, ``K`` and the embedding size
(1024, unchanged), not on the towers, so every cut shrinks the denominator and makes
both ratios *larger* than at full size. ``--quick`` (tiny towers, 1 s clips, one pair)
only checks that the script runs and writes ``results/quick/svr_step.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
from timing import markdown_table, paired_times, write_results  # noqa: E402

from contrastive_losses import KCLLoss, SupportVectorRegularizer  # noqa: E402

SAMPLE_RATE = 16_000


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The example trainer's ``ClapModel`` at the benchmark's size, and one random batch."""
    from clap_example.ced import CEDAudioEncoder, CEDConfig
    from clap_example.model import ClapModel
    from clap_example.sonar import SonarTextEncoder, sonar_config
    from transformers.models.m2m_100.modeling_m2m_100 import M2M100Encoder

    torch.manual_seed(0)
    audio = CEDAudioEncoder(CEDConfig.from_dict({"size": args.ced_size}))
    overrides: dict[str, Any] = {"encoder_layers": args.text_layers, "vocab_size": args.vocab}
    if args.text_width:
        overrides.update(
            d_model=args.text_width,
            encoder_ffn_dim=4 * args.text_width,
            encoder_attention_heads=max(1, args.text_width // 64),
        )
    text = SonarTextEncoder(M2M100Encoder(sonar_config(**overrides)), tokenizer=None)
    model = ClapModel(audio, text, embed_dim=1024)
    g = torch.Generator().manual_seed(1)
    n_text = args.batch * args.languages
    lengths = torch.randint(args.tokens // 2, args.tokens + 1, (n_text,), generator=g)
    mask = (torch.arange(args.tokens)[None, :] < lengths[:, None]).long()
    ids = torch.randint(4, args.vocab, (n_text, args.tokens), generator=g) * mask + (1 - mask)
    batch = {
        "waveform": 0.1 * torch.randn(args.batch, int(args.seconds * SAMPLE_RATE), generator=g),
        "input_ids": ids,
        "attention_mask": mask,
    }
    return model, batch


def make_step(
    model: torch.nn.Module,
    loss_fn: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    batch: dict[str, torch.Tensor],
    languages: int,
) -> Any:
    """One training step as ``examples/clap_example/train.py`` runs it."""

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        audio, text = model(batch["waveform"], None, batch["input_ids"], batch["attention_mask"])
        text = text.view(audio.shape[0], languages, -1)  # KCL: (B, K, E), clip-major
        loss, terms = loss_fn(audio, text, return_terms=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        logged = [float(v) for v in terms.values() if v.numel() == 1]  # the trainer logs these
        return float(loss.detach()) + 0.0 * sum(logged)

    return step


def losses(args: argparse.Namespace) -> dict[str, torch.nn.Module]:
    base = KCLLoss(temperature=0.07)
    return {"base": base, "svr": SupportVectorRegularizer(base, radius=args.radius)}


def child_memory(args: argparse.Namespace) -> None:
    """One configuration in this fresh process: two steps, then print the peak RSS."""
    model, batch = build(args)
    loss_fn = losses(args)[args.child]
    params = [p for m in (model, loss_fn) for p in m.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=5e-5)
    step = make_step(model, loss_fn, optimizer, params, batch, args.languages)
    for _ in range(2):
        step()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({"config": args.child, "peak_rss_mb": peak_kib / 1024}))


def child_time(args: argparse.Namespace) -> None:
    """Both losses on one model: whole steps alternated (base, svr, svr, base, ...), wall
    and CPU time of each; then the two losses alone on the model's embeddings."""
    model, batch = build(args)
    fns = losses(args)
    params = [p for m in (model, fns["svr"]) for p in m.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=5e-5)
    steps = {
        k: make_step(model, f, optimizer, params, batch, args.languages) for k, f in fns.items()
    }
    for _ in range(args.warmup_steps):  # Adam's state, allocator and kernel caches
        steps["base"]()
        steps["svr"]()
    wall: dict[str, list[float]] = {"base": [], "svr": []}
    cpu: dict[str, list[float]] = {"base": [], "svr": []}
    for i in range(args.pairs):
        for name in ("base", "svr") if i % 2 == 0 else ("svr", "base"):
            w0, c0 = time.perf_counter(), time.process_time()
            steps[name]()
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    # The loss alone, on this model's embeddings: the only work SVR adds to a step (its
    # predictor's ~6k parameters in Adam aside). Many short repeats: a precise figure.
    with torch.no_grad():
        audio, text = model(batch["waveform"], None, batch["input_ids"], batch["attention_mask"])
    audio = audio.detach().requires_grad_()
    text = text.detach().view(audio.shape[0], args.languages, -1).requires_grad_()

    def loss_step(loss_fn: torch.nn.Module) -> Any:
        def run() -> None:
            audio.grad = text.grad = None
            loss, terms = loss_fn(audio, text, return_terms=True)
            loss.backward()
            [float(v) for v in terms.values() if v.numel() == 1]

        return run

    t_base, t_svr = paired_times(
        loss_step(fns["base"]), loss_step(fns["svr"]), args.warmup, args.loss_runs
    )
    print(json.dumps({"wall": wall, "cpu": cpu, "loss_base": t_base, "loss_svr": t_svr}))


def run_child(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--child", mode, *args.passthrough]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    out = subprocess.run(argv, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=8, help="timed (base, svr) step pairs")
    parser.add_argument("--warmup-steps", type=int, default=1, help="untimed pairs first")
    parser.add_argument("--loss-runs", type=int, default=200, help="loss-only timed pairs")
    parser.add_argument("--memory-repeats", type=int, default=3, help="processes per config")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of warm-up steps")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--languages", type=int, default=8, help="captions per clip (KCL)")
    parser.add_argument("--seconds", type=float, default=4.0, help="clip length")
    parser.add_argument("--tokens", type=int, default=32, help="longest caption, in tokens")
    parser.add_argument("--ced-size", default="base")
    parser.add_argument("--text-layers", type=int, default=6, help="SONAR has 24")
    parser.add_argument("--text-width", type=int, default=0, help="0: SONAR's 1024")
    parser.add_argument("--vocab", type=int, default=32_000, help="SONAR has 256206")
    parser.add_argument("--radius", default="dynamic", help="SVR radius mode")
    parser.add_argument("--quick", action="store_true", help="tiny towers; results/quick/")
    parser.add_argument("--child", choices=("base", "svr", "time"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.pairs, args.memory_repeats, args.warmup, args.loss_runs = 2, 1, 0.0, 5
        args.seconds, args.ced_size, args.text_layers = 1.0, "tiny", 1
        args.text_width, args.vocab, args.tokens = 64, 1000, 16
    torch.set_num_threads(args.threads)
    if args.child == "time":
        return child_time(args)
    if args.child is not None:
        return child_memory(args)

    keys = ("warmup", "batch", "languages", "seconds", "tokens", "ced_size", "text_layers")
    keys += ("text_width", "vocab", "radius", "pairs", "warmup_steps", "loss_runs")
    args.passthrough = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    peaks: dict[str, list[float]] = {"base": [], "svr": []}
    for i in range(args.memory_repeats):
        for config in ("base", "svr") if i % 2 == 0 else ("svr", "base"):
            peaks[config].append(run_child(args, config)["peak_rss_mb"])
            print(f"peak RSS {config}: {peaks[config][-1]:.0f} MB", flush=True)
    times = run_child(args, "time")
    cpu_ratios = [s / b for s, b in zip(times["cpu"]["svr"], times["cpu"]["base"], strict=True)]
    wall_ratios = [s / b for s, b in zip(times["wall"]["svr"], times["wall"]["base"], strict=True)]
    base_cpu = statistics.median(times["cpu"]["base"])
    loss_extra = statistics.median(times["loss_svr"]) - statistics.median(times["loss_base"])
    base_rss, svr_rss = statistics.median(peaks["base"]), statistics.median(peaks["svr"])
    row = {
        "loss": f"kcl_k{args.languages}",
        "variant": f"{args.radius}_bi",
        "batch": args.batch,
        "base_step_cpu_s": base_cpu,
        "svr_step_cpu_s": statistics.median(times["cpu"]["svr"]),
        "time_ratio": statistics.median(cpu_ratios),
        "time_ratio_quartiles": [
            statistics.quantiles(cpu_ratios, n=4)[0],
            statistics.quantiles(cpu_ratios, n=4)[2],
        ]
        if len(cpu_ratios) > 1
        else cpu_ratios * 2,
        "time_ratio_wall": statistics.median(wall_ratios),
        "base_step_wall_s": statistics.median(times["wall"]["base"]),
        "loss_base_ms": 1e3 * statistics.median(times["loss_base"]),
        "loss_svr_ms": 1e3 * statistics.median(times["loss_svr"]),
        "time_ratio_from_loss": 1 + loss_extra / base_cpu,
        "base_peak_rss_mb": base_rss,
        "svr_peak_rss_mb": svr_rss,
        "memory_ratio": svr_rss / base_rss,
        "peak_rss_mb_all": peaks,
        "step_times": times["cpu"],
        "step_wall_times": times["wall"],
    }
    table = markdown_table(
        [
            "loss",
            "SVR",
            "B",
            "step CPU (s)",
            "time ratio",
            "wall",
            "from loss",
            "target",
            "peak RSS (MB)",
            "memory ratio",
            "target",
        ],
        [
            [
                row["loss"],
                row["variant"],
                args.batch,
                f"{base_cpu:.1f}",
                f"{row['time_ratio']:.3f}",
                f"{row['time_ratio_wall']:.3f}",
                f"{row['time_ratio_from_loss']:.4f}",
                "1.03",
                f"{base_rss:.0f}",
                f"{row['memory_ratio']:.4f}",
                "1.01",
            ]
        ],
    )
    print(table)
    timing = ("warmup", "pairs", "warmup_steps", "loss_runs")
    size = {k: getattr(args, k) for k in keys if k not in timing}
    path = write_results(
        "svr_step",
        {
            "what": "whole training step of the example model, with / without SVR, CPU",
            "size": size,
            "threads": args.threads,
            "pairs": args.pairs,
            "memory_repeats": args.memory_repeats,
            "load_average_1min_before": load_before,
            "wall_s": time.perf_counter() - start,
            "quick": args.quick,
            "rows": [row],
            "table": table,
        },
        quick=args.quick,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
