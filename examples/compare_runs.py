#!/usr/bin/env python
"""Seed-paired comparison of finished trainer runs against a baseline arm.

    python examples/compare_runs.py runs/* --baseline mlclap

prints, for every other arm (``--loss``, plus ``+svr-<mode>``), the mean paired difference of
the validation value that chose ``best/`` (points of mean R@1), its 95 % t-interval and the
seeds in which the arm is ahead (``clap_example/compare.py``; docs "Which loss should I use?").
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from clap_example.compare import cli

if __name__ == "__main__":
    sys.exit(cli())
