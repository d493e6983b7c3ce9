"""Paired comparison of trainer runs: seed by seed against a baseline, with a t-interval.

``python examples/compare_runs.py runs/* --baseline mlclap`` reads each run folder's
``config.json`` (its ``--loss``, ``--svr`` and ``--seed``) and ``summary.json`` (the validation
value that chose ``best/``, ``selection["value"]``: mean R@1 over languages and directions by
default), pairs every other arm with the baseline run of the same seed and prints, per arm, the
mean paired difference in points with its 95 % t-interval and the seeds in which the arm is
ahead. Runs whose ``config.json`` differ in anything but the loss (the trainer's "loss" options),
the seed and where the run is written (:func:`free_options`) are refused, naming the options that
differ: a paired difference is the loss's only when everything else is the same. The docs page
"Which loss should I use?" quotes the studies' numbers in this form
(:func:`paired_difference` is also what its test recomputes them with).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PairedDifference:
    """Seed-paired differences ``arm - baseline`` summarised: ``mean``, sample ``sd``, the 95 %
    t-interval ``(low, high)`` of the mean (``n - 1`` degrees of freedom), ``ahead`` (seeds
    with a positive difference) of ``n``."""

    mean: float
    sd: float
    low: float
    high: float
    ahead: int
    n: int

    def text(self, digits: int = 2) -> str:
        """``+0.40 [-0.64, +1.44] (4/5 seeds ahead)``."""
        f = f"{{:+.{digits}f}}"
        return (
            f"{f.format(self.mean)} [{f.format(self.low)}, {f.format(self.high)}] "
            f"({self.ahead}/{self.n} seeds ahead)"
        )


def paired_difference(differences: Sequence[float], level: float = 0.95) -> PairedDifference:
    """Mean, sd and ``level`` t-interval of seed-paired ``differences`` (at least 2)."""
    from scipy import stats

    n = len(differences)
    if n < 2:
        raise ValueError(f"differences: a t-interval needs >= 2 paired seeds, got {n}")
    mean, sd = statistics.fmean(differences), statistics.stdev(differences)
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    ahead = sum(d > 0 for d in differences)
    return PairedDifference(mean, sd, mean - half, mean + half, ahead, n)


def arm_of(config: dict[str, object]) -> str:
    """A run's arm: its ``--loss``, with ``+svr-<mode>`` when SVR is on."""
    svr = config.get("svr", "none")
    return str(config["loss"]) + ("" if svr in (None, "none") else f"+svr-{svr}")


def free_options() -> frozenset[str]:
    """The ``config.json`` keys paired runs may differ in: the trainer's "loss" option group,
    ``seed``, and the options that say where and how a run is written or read rather than what
    it learns (its "output" group but ``select_metric``, ``config``, ``demo``, ``workers``,
    ``e5_cache``, ``eval_batch_size``)."""
    from .config import build_parser

    groups = {g.title: {a.dest for a in g._group_actions} for g in build_parser()._action_groups}
    output = groups["output"] - {"select_metric"}
    return frozenset(groups["loss"] | output | {"seed", "config", "demo", "workers", "e5_cache",
                                                 "eval_batch_size"})  # fmt: skip


def check_paired(configs: dict[Path, dict[str, object]]) -> None:
    """ValueError naming the options in which a run's config differs from the first run's,
    beyond :func:`free_options` (e.g. a CNN baseline beside a Whisper candidate)."""
    free = free_options()
    items = list(configs.items())
    for folder, options in items[1:]:
        first, reference = items[0]
        keys = sorted(k for k in (set(options) | set(reference)) - free
                      if options.get(k, "<absent>") != reference.get(k, "<absent>"))  # fmt: skip
        if keys:
            shown = "; ".join(f"{k}: {reference.get(k)!r} vs {options.get(k)!r}" for k in keys)
            raise ValueError(
                f"{first} and {folder} differ in more than the loss and seed ({shown}): "
                "not a paired comparison; compare runs of one config"
            )


def read_runs(folders: Sequence[str | Path]) -> dict[str, dict[int, tuple[float, Path]]]:
    """``{arm: {seed: (validation value, folder)}}`` of the finished runs among ``folders``
    (a folder without ``summary.json`` or without a validation choice is skipped, said so);
    ValueError when their configs differ in more than the loss and seed (:func:`check_paired`)."""
    runs: dict[str, dict[int, tuple[float, Path]]] = {}
    configs: dict[Path, dict[str, object]] = {}
    for folder in map(Path, folders):
        summary, config = folder / "summary.json", folder / "config.json"
        if not (summary.is_file() and config.is_file()):
            print(f"[compare] {folder}: no summary.json or config.json (unfinished?), skipped")
            continue
        options = json.loads(config.read_text())
        value = (json.loads(summary.read_text()).get("selection") or {}).get("value")
        if value is None:
            print(f"[compare] {folder}: no validation value (run without --val-manifest), skipped")
            continue
        arm, seed = arm_of(options), int(options["seed"])
        if seed in runs.setdefault(arm, {}):
            raise ValueError(
                f"{folder} and {runs[arm][seed][1]}: two runs of arm {arm} with seed {seed}"
            )
        runs[arm][seed] = (float(value), folder)
        configs[folder] = options
    check_paired(configs)
    return runs


def compare(runs: dict[str, dict[int, tuple[float, Path]]], baseline: str) -> list[str]:
    """One line per arm: its paired difference with ``baseline`` in points (x 100)."""
    if baseline not in runs:
        raise ValueError(f"--baseline {baseline}: no finished run of it among {sorted(runs)}")
    lines = []
    for arm in sorted(set(runs) - {baseline}):
        seeds = sorted(set(runs[arm]) & set(runs[baseline]))
        if len(seeds) < 2:
            lines.append(f"{arm}: {len(seeds)} seed(s) paired with {baseline}; run >= 3")
            continue
        diffs = [100 * (runs[arm][s][0] - runs[baseline][s][0]) for s in seeds]
        lines.append(f"{arm} - {baseline}: {paired_difference(diffs).text()} points, seeds {seeds}")
    return lines


def cli(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="compare_runs.py",
        description="Seed-paired differences of finished trainer runs against a baseline arm: "
        "mean, 95 %% t-interval and seeds ahead, on the validation value that chose best/.",
    )
    p.add_argument("folders", nargs="+", help="run folders (the trainer's --output-dir)")
    p.add_argument("--baseline", default="mlclap", help="the arm the others are compared with")
    args = p.parse_args(argv)
    try:
        for line in compare(read_runs(args.folders), args.baseline):
            print(line)
    except ValueError as err:
        p.exit(2, f"compare_runs.py: error: {err}\n")
    return 0
