"""``finetune_ced_sonar.py --demo --output-dir DIR``: a run a newcomer can start on a laptop CPU
and watch learn in about a minute.

``DIR/data`` gets a small synthetic set whose captions, in English, French and German, name what
is heard (5 sounds x loud/quiet, :func:`~clap_example.synthetic.make_demo_dataset`);
``DIR/sonar`` a 2-layer SONAR-shaped text encoder with a tokenizer trained on those captions;
``DIR/run`` the run itself (logs, checkpoints, plots). Both towers start from random weights,
so whatever the run retrieves it learned. The last line printed says how far the loss fell,
the test set's text-to-audio R@1 and where the plots and logs are.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .synthetic import LANGUAGES3, demo_corpus, make_demo_dataset, make_sonar_dir

#: The demo's options (any option given on the command line or in --config wins).
DEMO_OPTIONS: dict[str, Any] = {
    "languages": list(LANGUAGES3),
    "loss": "infonce",
    "pair_language": "random",
    "ced_config": {"embed_dim": 64, "depth": 2, "num_heads": 2},
    "embed_dim": 64,
    "text_max_length": 32,
    "max_seconds": 1.0,
    "batch_size": 32,
    "eval_batch_size": 32,
    "epochs": 30,
    "lr": 3e-3,
    "warmup_steps": 10,
    "progress": False,
    "plots": True,
}


def demo_defaults(output_dir: str) -> dict[str, Any]:
    root = Path(output_dir)
    return {
        **DEMO_OPTIONS,
        "train_manifest": str(root / "data" / "train.csv"),
        "test_manifest": str(root / "data" / "test.jsonl"),
        "sonar": str(root / "sonar"),
    }


def prepare_demo(args: argparse.Namespace) -> None:
    """Write the demo's data and text encoder under --output-dir (once; they are the same on
    every call), and send the run itself to ``--output-dir/run``."""
    root = Path(args.output_dir)
    data, sonar = root / "data", root / "sonar"
    ready = root / ".demo-ready"
    if not ready.is_file():
        print(f"[demo] writing the synthetic set to {data} and a tiny text encoder to {sonar}")
        make_demo_dataset(data)
        make_sonar_dir(sonar, lines=demo_corpus(), d_model=64, layers=2, heads=2, ffn=128)
        ready.write_text("ok\n")
    args.output_dir = str(root / "run")


def done_line(run: Path, seconds: float) -> str:
    """``done in ...``: the loss's fall, the test T2A R@1, and where the plots and logs are."""
    rows = [json.loads(line) for line in (run / "epoch_log.jsonl").read_text().splitlines()]
    losses = [r["train_loss"] for r in rows if r.get("train_loss") is not None]
    metrics = rows[-1].get("metrics", {}) if rows else {}
    r1 = [v for k, v in metrics.items() if k.startswith("per_language/") and k.endswith("/t2a/R@1")]
    parts = [f"done in {seconds:.0f} s"]
    if losses:
        fall = 100 * (1 - losses[-1] / losses[0]) if losses[0] else 0.0
        parts.append(f"train loss {losses[0]:.3f} -> {losses[-1]:.3f} ({fall:.0f}% lower)")
    if r1:
        parts.append(f"test T2A R@1 {sum(r1) / len(r1):.2f} (chance 0.10)")
    parts.append(f"plots in {run / 'plots'}, logs in {run / 'train_log.csv'}")
    parts.append(f"{run / 'epoch_log.jsonl'}")
    return "; ".join(parts[:-1]) + ", " + parts[-1]
