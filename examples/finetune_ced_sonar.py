#!/usr/bin/env python
"""Fine-tune a CED audio encoder + SONAR multilingual text encoder with any contrastive_losses loss.

A first run on CPU, on generated data (about 120 CPU-seconds; see the README)::

    python examples/finetune_ced_sonar.py --demo --output-dir /tmp/clap-demo

Single process::

    python examples/finetune_ced_sonar.py --config my_run.json

Several GPUs (DDP; the losses all-gather embeddings across ranks)::

    torchrun --nproc_per_node=8 examples/finetune_ced_sonar.py --config my_run.json

See ``examples/README.md`` ("Fine-tune CED + SONAR") for the manifest format, the checkpoints to
download and the options; ``--help`` lists every option. Errors are one line (exit code 2 for
bad options or inputs); ``--debug`` shows the traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from clap_example.train import cli

if __name__ == "__main__":
    sys.exit(cli())
