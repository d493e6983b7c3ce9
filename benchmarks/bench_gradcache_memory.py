"""Peak memory of KCL with and without ``--grad-cache`` against the ML-CLAP random-language
baseline, at the same batch, on CPU (peak RSS of a fresh process per configuration).

Not a test: run it by hand, it takes a few minutes on 2 cores::

    PYTHONPATH=src python benchmarks/bench_gradcache_memory.py [--batch-size 8] [--steps 2]
    PYTHONPATH=src python benchmarks/bench_gradcache_memory.py --quick   # tiny models: a check

The models are "small but not tiny" stand-ins with the real architectures: a CED of width 256
and depth 8 on 10 s clips (248 patches) and a SONAR-shaped M2M100 encoder of width 384, depth 8,
FFN 3072, on 8 languages with captions of 32 tokens -- the text side weighs as much relative to
the audio side as SONAR (24 x 1024, FFN 8192) does against CED-Base. Every configuration trains
``--steps`` steps (Adam state included) and is measured in its own process; ``setup`` is a run
that builds everything and trains 0 steps, so "activations" = peak - setup.

``--quick`` (what ``run_all.py --quick`` passes; it keeps the output in
``results/quick/gradcache_memory.json``) uses B = 2, one step and width-64, depth-2 encoders:
it checks that every configuration trains, it is not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
sys.path.insert(0, str(EXAMPLES))

from clap_example.sonar import PAPER_LANGUAGES  # noqa: E402
from clap_example.synthetic import SOUNDS, corpus, make_dataset, make_sonar_dir  # noqa: E402


def write_manifest(data_dir: Path, n_clips: int, seed: int = 0) -> Path:
    """Captions in all 8 paper languages for every clip (K = 8), long enough to be truncated
    to exactly ``--text-max-length`` tokens."""
    rng = random.Random(seed)
    words = sorted({w for line in corpus() for w in line.split()})
    manifest = data_dir / "train8.jsonl"
    kinds = list(SOUNDS)
    with manifest.open("w", encoding="utf-8") as f:
        for i in range(n_clips):
            audio_id = f"train_{i:03d}_{kinds[i % len(kinds)]}"
            for lang in PAPER_LANGUAGES:
                text = " ".join(rng.choice(words) for _ in range(40))
                row = {"audio_path": f"audio/{audio_id}.wav", "audio_id": audio_id,
                       "caption": text, "language": lang}  # fmt: skip
                f.write(json.dumps(row) + "\n")
    return manifest


def run(config: dict[str, object], work: Path, name: str) -> float:
    """Peak RSS in MiB of one training process (its own ``ru_maxrss``, from summary.json)."""
    path = work / f"{name}.json"
    path.write_text(json.dumps({**config, "output_dir": str(work / name)}))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "finetune_ced_sonar.py"), "--config", str(path)],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads((work / name / "summary.json").read_text())
    return float(summary["peak_memory_mb"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--text-tokens", type=int, default=32)
    parser.add_argument("--text-width", type=int, default=384)
    parser.add_argument("--text-depth", type=int, default=8)
    parser.add_argument("--text-heads", type=int, default=6)
    parser.add_argument("--text-ffn", type=int, default=3072)
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("--quick", action="store_true", help="tiny models, B = 2, one step")
    args = parser.parse_args()
    ced_config = {"embed_dim": 256, "depth": 8, "num_heads": 4}
    if args.quick:
        vars(args).update(batch_size=2, steps=1, text_tokens=8, text_width=64, text_depth=2,
                          text_heads=2, text_ffn=128)  # fmt: skip
        ced_config = {"embed_dim": 64, "depth": 2, "num_heads": 2}

    work = Path(tempfile.mkdtemp(prefix="bench_gradcache_"))
    data = make_dataset(work / "data", n_train=2 * args.batch_size, n_test=0, seconds=(10.0,),
                        drop_language_every=0)  # fmt: skip
    manifest = write_manifest(work / "data", 2 * args.batch_size)
    sonar = make_sonar_dir(
        work / "sonar",
        d_model=args.text_width,
        layers=args.text_depth,
        heads=args.text_heads,
        ffn=args.text_ffn,
    )
    del data
    base = {
        "train_manifest": str(manifest),
        "sonar": str(sonar),
        "languages": list(PAPER_LANGUAGES),
        "ced_config": ced_config,
        "embed_dim": 512,
        "batch_size": args.batch_size,
        "epochs": 1,
        "max_steps": args.steps,
        "max_seconds": 10.0,
        "text_max_length": args.text_tokens,
        "progress": False,
        "plots": False,
        "lr": 1e-4,
    }
    runs = {
        "setup (0 steps)": {**base, "loss": "mlclap", "max_steps": 0},
        "ML-CLAP random language (baseline)": {**base, "loss": "mlclap"},
        "KCL, all K captions": {**base, "loss": "kcl"},
        "KCL + --grad-cache": {**base, "loss": "kcl", "grad_cache": True},
    }
    peaks: dict[str, float] = {}
    for i, (name, config) in enumerate(runs.items()):
        peaks[name] = run(config, work, f"run{i}")
        print(f"measured {name}: {peaks[name]:.0f} MiB", flush=True)
    setup = peaks.pop("setup (0 steps)")
    baseline = peaks["ML-CLAP random language (baseline)"]
    b, k = args.batch_size, len(PAPER_LANGUAGES)
    print()
    print(
        f"B = {b}, K = {k}, captions of {args.text_tokens} tokens, 10 s clips, "
        f"{args.steps} steps; text encoder {args.text_width} x {args.text_depth} "
        f"(FFN {args.text_ffn}); setup (process, models, data) = {setup:.0f} MiB"
    )
    print(
        "| configuration | captions encoded / step | peak RSS (MiB) | ratio "
        "| peak - setup (MiB) | ratio |"
    )
    print("|---|---|---|---|---|---|")
    for name, peak in peaks.items():
        captions = b if "baseline" in name else b * k
        print(f"| {name} | {captions} | {peak:.0f} | {peak / baseline:.2f}x | {peak - setup:.0f} | "
              f"{(peak - setup) / (baseline - setup):.2f}x |")  # fmt: skip
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"\nkept {work}")


if __name__ == "__main__":
    main()
