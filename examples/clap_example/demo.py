"""``finetune_ced_sonar.py --demo --output-dir DIR``: a run a newcomer can start on a laptop CPU
and watch learn (about 120 CPU-seconds).

``DIR/data`` gets a small synthetic set whose captions, in English, French and German, name what
is heard (5 sounds x loud/quiet, :func:`~clap_example.synthetic.make_demo_dataset`);
``DIR/sonar`` a 2-layer SONAR-shaped text encoder with a tokenizer trained on those captions;
``DIR/run`` the run itself (logs, checkpoints, plots). Both towers start from random weights,
so whatever the run retrieves it learned. Every option is checked (:func:`check_demo`) before
anything is written; the closing lines say how far the loss fell, the validation set's R@1
per epoch and the test set's R@1 (once, on ``best/``) against chance and where
``summary.png`` and the logs are.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from .startup import check_sources, output_dir_problem
from .synthetic import (
    DEMO_LEVELS,
    DEMO_SOUNDS,
    LANGUAGES3,
    demo_corpus,
    make_demo_dataset,
    make_sonar_dir,
)

#: Training clips per class of the demo's set (10 classes: 5 sounds x loud/quiet).
DEMO_PER_CLASS = 16

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
    "progress": True,
    "plots": True,
}


def demo_defaults(output_dir: str) -> dict[str, Any]:
    root = Path(output_dir)
    return {
        **DEMO_OPTIONS,
        "train_manifest": str(root / "data" / "train.csv"),
        "val_manifest": str(root / "data" / "val.jsonl"),
        "test_manifest": str(root / "data" / "test.jsonl"),
        "sonar": str(root / "sonar"),
    }


def check_demo(args: argparse.Namespace) -> None:
    """Every check that can fail, before the demo writes its data: errors name the
    ``--output-dir`` typed (not its ``run/`` folder) and the options as given."""
    root = Path(args.output_dir)
    data, sonar = root / "data", root / "sonar"
    check_sources(args, generated=(str(sonar),))
    if root.exists() and not root.is_dir():
        raise FileExistsError(f"--output-dir {args.output_dir} is a file, not a directory")
    if root.is_dir() and not (root / ".demo-ready").is_file():
        others = sorted(p.name for p in root.iterdir() if p.name not in ("data", "sonar", "run"))
        if others:
            shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
            raise FileExistsError(
                f"--output-dir {args.output_dir} is not empty ({shown}) and holds no demo: "
                "choose a new or empty folder for the demo"
            )
    problem = output_dir_problem(
        root / "run", args, label=f"--output-dir {args.output_dir} (its run/ folder)"
    )
    if problem:
        raise FileExistsError(problem)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    clips = DEMO_PER_CLASS * len(DEMO_SOUNDS) * len(DEMO_LEVELS)
    uses_demo_set = args.train_manifest == str(data / "train.csv")
    if uses_demo_set and args.batch_size * world > clips:
        raise ValueError(
            f"--batch-size {args.batch_size}: the demo's training set has {clips} clips, fewer "
            f"than one full batch per process ({world} process(es)); use at most {clips // world}"
        )


def prepare_demo(args: argparse.Namespace) -> None:
    """Check every option (:func:`check_demo`), then write the demo's data and text encoder
    under --output-dir (once; they are the same on every call) and send the run itself to
    ``--output-dir/run``."""
    check_demo(args)
    root = Path(args.output_dir)
    data, sonar = root / "data", root / "sonar"
    ready = root / ".demo-ready"
    if not ready.is_file() or not (data / "val.jsonl").is_file():  # older demos had no val
        print(f"[demo] writing the synthetic set to {data} and a tiny text encoder to {sonar}")
        make_demo_dataset(data, per_class_train=DEMO_PER_CLASS)
        make_sonar_dir(sonar, lines=demo_corpus(), d_model=64, layers=2, heads=2, ffn=128)
        ready.write_text("ok\n")
    args.output_dir = str(root / "run")
