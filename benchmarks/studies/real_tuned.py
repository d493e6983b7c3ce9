r"""Each loss at its best: an equal-budget search on validation, then test seeds at each
arm's choice (issue 47), on ``real_pretrained.py``'s data, audio side and evaluation.

Two modes, each resumable from a partial file in ``--cache`` (JSON lines, one per finished
run: a killed or sharded invocation loses at most its runs in flight; the same command
runs only what is missing), so the trial can run in parts:

* ``--tune`` -- for every arm in ``ARMS`` (the baseline ``random`` among them, re-tuned in
  the same search) ``--trials`` settings (default ``TRIALS``), each trained on the training
  split and evaluated on the **validation** galleries only (``train_one(test=False)``: no
  test-split evaluation is ever made) for ``--tune-seeds`` seeds (``TUNE_SEED_BASE`` + i,
  apart from the test seeds). Trial 0 of every arm is its default setting (the study's
  and the library's: ``knobs.defaults``); trials 1 .. n-1 are drawn by a seeded random
  search (:func:`sample`: a numpy ``Generator`` seeded from ``--base-seed`` and the arm's
  name; log-uniform for rates, the temperature and the loss weights, uniform for dropout,
  uniformly among listed values for counts) over the arm's space (:func:`space`: the
  shared knobs' ranges are the same for every arm; the loss's own knobs span about a
  decade or more on each side of the library's default). The chosen setting is the trial
  with the highest validation T2A R@1 (mean over the tune seeds; ties: the lower trial).
  By default the text side trains (``text=adapter``: ``knobs.py`` states its size) and
  ``text_lr`` is searched; ``--text frozen`` searches with e5 frozen.
* ``--from-tuned FILE`` -- the ``--tune`` JSON's chosen settings, fixed before any test
  number exists, trained on ``--seeds`` paired seeds with the text adapter and
  ``--frozen-seeds`` with e5 frozen (the same setting, ``text_lr`` unused), and
  ``--default-seeds`` at the default setting with the adapter (what tuning bought); test
  galleries as ``real_pretrained``; paired 95 % t-intervals against ``random`` of the
  same variant, seeds ahead, Holm over the family.

Why an adapter and not e5's own top layer (``e5_layer``): the layer runs every caption of
a step through a transformer layer in float32; ``real_text_layer.py`` could afford 32 such
steps per run on this CPU, where one tuned run here is 60 epochs of ~19 steps with up to
B x K = 3,072 captions a step (KCL, all-pairs), for 7 arms x 12 trials.

    PYTHONPATH=src:examples python benchmarks/studies/real_tuned.py --manifests DIR \
        --cache CACHE --tune [--arms random,kcl] [--shard 0/2]        # in parts
    PYTHONPATH=src:examples python benchmarks/studies/real_tuned.py --manifests DIR \
        --cache CACHE --from-tuned benchmarks/results/studies/real_tuned.json

Writes ``real_tuned.{md,json}`` into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import common
import knobs
import numpy as np
import real_multilingual as rm
import real_pretrained as rp
from real_data import RealData

NAME = "real_tuned"
ARMS = ("random", "kcl", "pairs_all", "cacl", "svr_static", "svr_dynamic", "ask")
TRIALS = 12
TUNE_SEEDS = 1
TUNE_SEED_BASE = 1000  # validation seeds apart from the test seeds 0 .. n-1
SEEDS, FROZEN_SEEDS, DEFAULT_SEEDS = 10, 5, 0
#: The search space: knob -> ("log", low, high) | ("uniform", low, high) | ("choice", values).
SHARED_SPACE: dict[str, tuple] = {
    "lr": ("log", 1e-4, 1e-2),
    "dropout": ("uniform", 0.0, 0.6),
    "temperature": ("log", 0.01, 0.3),
}
TEXT_SPACE: dict[str, tuple] = {"text_lr": ("log", 0.01, 1.0)}
TEMPERATURE_SPACE: dict[str, tuple] = {"learn_temperature": ("choice", (False, True))}
SVR_SPACE: dict[str, tuple] = {
    "svr.alpha": ("log", 0.01, 10.0),
    "svr.beta": ("log", 0.01, 100.0),
    "svr.radius_init": ("log", 0.01, 1.0),
}
ASK_SPACE: dict[str, tuple] = {
    "ask.injection_ratio": ("log", 0.005, 0.5),
    "ask.ot_weight": ("log", 0.005, 0.5),
    "ask.lambda_fine": ("log", 0.01, 1.0),
    "ask.lambda_coarse": ("log", 0.01, 1.0),
    "ask.k": ("choice", (5, 10, 20)),
    "ask.prototypes": ("choice", (16, 64, 256)),
    "ask.refresh": ("choice", (5, 15, 30)),
}
SELECTION = "highest mean validation T2A R@1 over the tune seeds; ties: the lower trial"


# ----------------------------------------------------------------------- the search


def space(arm: str, text: str = "adapter") -> dict[str, tuple]:
    """``arm``'s search space (see the module doc); ``text_lr`` only with the adapter."""
    out = dict(SHARED_SPACE) | (TEXT_SPACE if text == "adapter" else {})
    if arm == "ask":
        return out | ASK_SPACE  # ASKLoss has no learnable temperature
    return out | TEMPERATURE_SPACE | (SVR_SPACE if arm.startswith("svr_") else {})


def _draw(rng: np.random.Generator, spec: tuple) -> Any:
    kind = spec[0]
    if kind == "log":
        return float(f"{math.exp(rng.uniform(math.log(spec[1]), math.log(spec[2]))):.4g}")
    if kind == "uniform":
        return float(f"{rng.uniform(spec[1], spec[2]):.3g}")
    if kind == "choice":
        return spec[1][int(rng.integers(len(spec[1])))]
    raise ValueError(f"space: unknown kind {kind!r}")


def arm_seed(arm: str, base_seed: int) -> list[int]:
    """The sampler's seed: ``base_seed`` and a stable number from the arm's name."""
    return [base_seed, int.from_bytes(hashlib.sha256(arm.encode()).digest()[:4], "little")]


def sample(arm: str, trials: int, base_seed: int, study: dict, text: str) -> list[dict]:
    """``trials`` whole settings of ``arm`` (``knobs.effective``): trial 0 the defaults
    (with ``text``), the others drawn in order from the arm's seeded generator, each knob
    of :func:`space` in sorted order."""
    base = knobs.effective(arm, {"text": text}, study)
    rng = np.random.default_rng(arm_seed(arm, base_seed))
    grid = space(arm, text)
    out = [base]
    for _ in range(trials - 1):
        out.append(base | {k: _draw(rng, grid[k]) for k in sorted(grid)})
    return out


def spec_json(spec: tuple) -> dict[str, Any]:
    if spec[0] == "choice":
        return {"kind": "choice", "values": list(spec[1])}
    return {"kind": spec[0], "low": spec[1], "high": spec[2]}


def digest(setting: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(setting, sort_keys=True).encode()).hexdigest()[:12]


# ----------------------------------------------------------------------- jobs


def _run(arm: str, seed: int, setting: dict, device: str, test: bool) -> dict[str, Any]:
    """One run of ``arm`` at ``setting`` on the worker's data (``rm._DATA``); with ``test``
    False only validation is evaluated (``rm.train_one``)."""
    assert rm._DATA is not None
    rp.KNOBS = setting  # here, not in the parent: spawned workers start from the module's
    rp.configure()
    started = time.time()
    out = rm.train_one(arm, seed, setting["epochs"], rm._DATA, device, test=test)
    out |= {"setting": setting, "setting_key": digest(setting)}
    out["started_at"], out["finished_at"] = started, time.time()
    val = f"val {100 * out['val_t2a_R@1']:.2f}"
    tail = f" test {100 * out['t2a_R@1']:.2f}" if test else ""
    print(f"{arm:<12} seed {seed} {val}{tail} ({out['seconds']:.0f} s)", flush=True)
    return out


def run_jobs(
    data: RealData, jobs: list[dict], args: argparse.Namespace, partial: Path, test: bool
) -> list[dict]:
    """Each job (``arm``, ``seed``, ``setting`` and labels) run unless the partial file
    holds it (same labels, seed and setting); results appended as they finish."""

    def key(r: dict) -> tuple:
        return (
            r.get("stage"),
            r.get("variant"),
            r.get("trial"),
            r["arm"],
            r["seed"],
            r["setting_key"],
        )

    done = {key(r): r for r in rm.read_partial(partial)}
    for j in jobs:
        j["setting_key"] = digest(j["setting"])
    index, count = (int(x) for x in args.shard.split("/"))
    todo = [] if args.collect else [j for j in jobs[index::count] if key(j) not in done]

    def keep(j: dict, r: dict) -> None:
        r = {**j, "method": j["arm"], **r}
        done[key(r)] = r
        rm.append_partial(partial, r)

    calls = [(j["arm"], j["seed"], j["setting"], args.device, test) for j in todo]
    if args.workers <= 1 or not todo:
        rm._init_worker(data, args.device)
        for j, c in zip(todo, calls, strict=True):
            keep(j, _run(*c))
    else:
        context = get_context("fork" if args.device == "cpu" else "spawn")
        with ProcessPoolExecutor(
            args.workers,
            mp_context=context,
            initializer=rm._init_worker,
            initargs=(data, args.device),
        ) as pool:
            futures = {pool.submit(_run, *c): j for j, c in zip(todo, calls, strict=True)}
            for f in as_completed(futures):
                keep(futures[f], f.result())
    return [done[key(j)] for j in jobs if key(j) in done]


def tune_jobs(args: argparse.Namespace, arms: tuple[str, ...], study: dict) -> list[dict]:
    """Trial by trial, every arm: a run cut short leaves the arms at equal budgets."""
    settings = {a: sample(a, args.trials, args.base_seed, study, args.text) for a in arms}
    seeds = [TUNE_SEED_BASE + i for i in range(args.tune_seeds)]
    return [
        {"stage": "tune", "arm": a, "trial": t, "seed": s, "setting": settings[a][t]}
        for t in range(args.trials)
        for s in seeds
        for a in arms
    ]


def summarise(runs: list[dict], args: argparse.Namespace, arms: tuple[str, ...]) -> dict:
    """Per arm: its space, every trial (setting, validation per seed, mean), the complete
    trials' count and the chosen one (:data:`SELECTION`, among complete trials)."""
    seeds = [TUNE_SEED_BASE + i for i in range(args.tune_seeds)]
    out: dict[str, Any] = {}
    for a in arms:
        trials = []
        for t in range(args.trials):
            mine = {r["seed"]: r for r in runs if r["arm"] == a and r["trial"] == t}
            if not mine:
                continue
            val = {str(s): mine[s]["val_t2a_R@1"] for s in seeds if s in mine}
            trials.append(
                {
                    "trial": t,
                    "setting": next(iter(mine.values()))["setting"],
                    "val_t2a_R@1": val,
                    "complete": len(val) == len(seeds),
                    "mean": statistics.fmean(val.values()),
                    "seconds": sum(r["seconds"] for r in mine.values()),
                }
            )
        complete = [t for t in trials if t["complete"]]
        best = max(complete, key=lambda t: (t["mean"], -t["trial"]), default=None)
        out[a] = {
            "space": {k: spec_json(v) for k, v in space(a, args.text).items()},
            "trials": trials,
            "n_trials": len(complete),
            "chosen": None if best is None else {k: best[k] for k in ("trial", "setting", "mean")},
        }
    return out


# ----------------------------------------------------------------------- test seeds


def chosen_settings(path: Path, arms: tuple[str, ...]) -> tuple[dict[str, dict], dict]:
    """Each arm's chosen setting from a ``--tune`` JSON (refused unless every arm's search
    is complete: all of them at the same number of trials) and that JSON's tuning part."""
    tuning = json.loads(path.read_text())["tuning"]
    want = tuning["trials"]
    short = [a for a in arms if tuning["arms"].get(a, {}).get("n_trials") != want]
    if short:
        raise SystemExit(
            f"--from-tuned {path}: the search of {short} is not complete "
            f"({want} trials each); run --tune on"
        )
    return {a: tuning["arms"][a]["chosen"]["setting"] for a in arms}, tuning


def test_jobs(args: argparse.Namespace, chosen: dict[str, dict], study: dict) -> list[dict]:
    """Seed by seed, every arm: tuned with the adapter, tuned with e5 frozen, defaults."""
    variants = (
        ("tuned_text", args.seeds, lambda a: chosen[a] | {"text": "adapter"}),
        ("tuned_frozen", args.frozen_seeds, lambda a: chosen[a] | {"text": "frozen"}),
        (
            "default_text",
            args.default_seeds,
            lambda a: knobs.effective(a, {"text": "adapter"}, study),
        ),
    )
    return [
        {"stage": "test", "variant": v, "arm": a, "seed": s, "setting": make(a)}
        for v, n, make in variants
        for s in range(n)
        for a in chosen
    ]


def contrasts_of(runs: list[dict], arms: tuple[str, ...]) -> list[dict]:
    """Every arm against ``random`` of its variant, one Holm family."""
    out = []
    for v in sorted({r["variant"] for r in runs}):
        mine = [r for r in runs if r["variant"] == v]
        out += [
            rp.paired_contrast(mine, a, "random") | {"variant": v} for a in arms if a != "random"
        ]
    return rp.holm(out)


def cost(runs: list[dict]) -> dict[str, Any]:
    """Per stage: runs, their seconds in all and the median run (one worker)."""
    out = {}
    for stage in sorted({r["stage"] for r in runs}):
        sec = [r["seconds"] for r in runs if r["stage"] == stage]
        out[stage] = {"runs": len(sec), "seconds": sum(sec), "median_run": statistics.median(sec)}
    return out


# ----------------------------------------------------------------------- report


def tuning_table(tuning: dict[str, Any]) -> str:
    header = [
        "arm",
        "trials",
        "val R@1 % default (trial 0)",
        "chosen trial",
        "val R@1 % chosen",
        "chosen knobs that differ from the default",
    ]
    rows = []
    for a, t in tuning["arms"].items():
        first = next((x for x in t["trials"] if x["trial"] == 0 and x["complete"]), None)
        c = t["chosen"]
        moved = (
            {}
            if c is None or first is None
            else {k: v for k, v in c["setting"].items() if first["setting"].get(k) != v}
        )
        rows.append(
            [
                a,
                t["n_trials"],
                "–" if first is None else f"{100 * first['mean']:.2f}",
                "–" if c is None else c["trial"],
                "–" if c is None else f"{100 * c['mean']:.2f}",
                ", ".join(f"{k}={v}" for k, v in moved.items()) or "–",
            ]
        )
    return common.table(header, rows)


def test_table(runs: list[dict], contrasts: list[dict], arms: tuple[str, ...]) -> str:
    header = [
        "variant",
        "arm",
        "seeds",
        "test T2A R@1 % [95 % CI]",
        "− random (points)",
        "95 % CI",
        "ahead",
        "survives Holm",
    ]
    by = {(c["variant"], c["arm"]): c for c in contrasts}
    rows = []
    for v in ("tuned_text", "tuned_frozen", "default_text"):
        for a in arms:
            vals = rm.values([r for r in runs if r["variant"] == v], a, "t2a_R@1")
            if not vals:
                continue
            c = by.get((v, a), {})
            diff = (
                ["–", "–", "–", "–"]
                if "p" not in c
                else [
                    f"{100 * c['mean']:+.2f}",
                    f"[{100 * c['low']:+.2f}, {100 * c['high']:+.2f}]",
                    f"{c['ahead']}/{c['n']}",
                    "yes" if c["survives_holm"] else "no",
                ]
            )
            rows.append([v, a, len(vals), rp.mean_ci(vals), *diff])
    return common.table(header, rows)


def markdown(payload: dict[str, Any]) -> str:
    tuning, runs = payload["tuning"], payload.get("runs", [])
    arms = tuple(tuning["arms"])
    lines = [
        "# Each loss at its best: an equal-budget search on validation, then test seeds",
        "",
        f"Whisper base (frozen) + head, as `real_pretrained`; {tuning['trials']} trials per "
        f"arm (trial 0 the defaults, the rest a seeded random search, base seed "
        f"{tuning['base_seed']}), text side `{tuning['text']}`, validation seeds "
        f"{tuning['tune_seeds']}; chosen: {SELECTION}. No test number enters a choice.",
        "",
        "## The search (validation T2A R@1)",
        "",
        tuning_table(tuning),
    ]
    if runs:
        lines += [
            "",
            "## Test seeds at the chosen settings (paired with `random` of the same "
            "variant; Holm over the family)",
            "",
            test_table(runs, payload["contrasts"], arms),
        ]
    rows = [
        [s, c["runs"], f"{c['seconds'] / 3600:.2f}", f"{c['median_run']:.0f}"]
        for s, c in payload["cost"].items()
    ]
    lines += [
        "",
        "## Cost (one worker's seconds)",
        "",
        common.table(["stage", "runs", "worker-hours", "median run (s)"], rows),
    ]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------- main


def tuning_of(runs: list[dict], args: argparse.Namespace, arms: tuple[str, ...]) -> dict:
    return {
        "trials": args.trials,
        "tune_seeds": [TUNE_SEED_BASE + i for i in range(args.tune_seeds)],
        "base_seed": args.base_seed,
        "text": args.text,
        "selection": SELECTION,
        "arms": summarise(runs, args, arms),
    }


def partial_file(args: argparse.Namespace, digest_: str, stage: str) -> Path:
    """The partial file of a stage: named by the study's settings and the states' key."""
    return args.cache / f"{NAME}-{stage}-{rp.settings_key(digest_)}.jsonl"


def study(
    args: argparse.Namespace, loaded: tuple[RealData, list, str] | None = None
) -> dict[str, Any]:
    """``--tune``, ``--from-tuned`` or ``--render``; writes ``real_tuned.{md,json}``."""
    arms = tuple(a for a in args.arms.split(",") if a)
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; choose from {ARMS}")
    if args.render:
        payload = json.loads((args.out_dir / f"{NAME}.json").read_text())
        common.write(args.out_dir, NAME, markdown(payload), payload)
        return payload
    if not (args.tune or args.from_tuned):
        raise SystemExit("choose --tune, --from-tuned FILE or --render")
    rp.KNOBS = {}  # the study's own settings name the partial files (each run sets its own)
    rp.configure()
    study_ = rp.study_settings() | {"epochs": args.epochs}
    data, _, states = loaded or rp.load_data(args)
    partial = partial_file(args, states, "tune" if args.tune else "test")
    setup = {
        "arms": list(arms),
        "epochs": args.epochs,
        "states_cache": states,
        "study": study_,
        "versions": rm.versions(),
        "workers": args.workers,
        "device": args.device,
    }
    if args.tune:
        jobs = tune_jobs(args, arms, study_)
        runs = run_jobs(data, jobs, args, partial, test=False)
        spent = cost(runs)
        payload = {
            "setup": setup,
            "tuning": tuning_of(runs, args, arms) | {"cost": spent},
            "cost": spent,
        }
    else:
        chosen, tuning = chosen_settings(args.from_tuned, arms)
        jobs = test_jobs(args, chosen, study_)
        runs = run_jobs(data, jobs, args, partial, test=True)
        seeds = {k: getattr(args, k) for k in ("seeds", "frozen_seeds", "default_seeds")}
        payload = {
            "setup": setup | seeds,
            "tuning": tuning,
            "runs": runs,
            "contrasts": contrasts_of(runs, arms),
            "cost": tuning.get("cost", {}) | cost(runs),
        }
    rp.KNOBS = {}  # the last run's knobs left in-process: back to the study's
    rp.configure()
    md = markdown(payload)
    print(md)
    common.write(args.out_dir, NAME, md, payload)
    return payload


def extra_arguments(parser: argparse.ArgumentParser) -> None:
    rp.run_arguments(parser)
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms")
    parser.add_argument("--shard", default="0/1", help="i/n: every n-th job from the i-th")
    parser.add_argument("--collect", action="store_true", help="no training: the partial file")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--tune", action="store_true", help="the search, validation only")
    mode.add_argument(
        "--from-tuned",
        type=Path,
        metavar="JSON",
        help="test seeds at the chosen settings of a --tune JSON",
    )
    parser.add_argument("--trials", type=int, default=TRIALS, help="trials per arm (all equal)")
    parser.add_argument(
        "--tune-seeds", type=int, default=TUNE_SEEDS, help="validation seeds per trial"
    )
    parser.add_argument("--base-seed", type=int, default=0, help="the search's seed")
    parser.add_argument(
        "--text", choices=knobs.TEXT_KINDS, default="adapter", help="the text side of the search"
    )
    parser.add_argument(
        "--frozen-seeds",
        type=int,
        default=FROZEN_SEEDS,
        help="--from-tuned: seeds with e5 frozen at the chosen settings",
    )
    parser.add_argument(
        "--default-seeds",
        type=int,
        default=DEFAULT_SEEDS,
        help="--from-tuned: seeds at the defaults, text adapter",
    )


def main() -> None:
    args = common.parse_args(
        __doc__,
        epochs=rp.EPOCHS,
        seeds=SEEDS,
        quick_epochs=rp.QUICK_EPOCHS,
        extra=extra_arguments,
    )
    study(args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
