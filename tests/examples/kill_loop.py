#!/usr/bin/env python
"""Kill-during-save loop for the example trainer: SIGKILL at random moments, resume, compare.

Runs the tiny synthetic training (``clap_example.synthetic``: 16 clips, a 2-block CED, a
2-layer SONAR-shaped encoder; KCL with dropout, 3 epochs x 4 steps, a checkpoint every 2 steps,
evaluation and best model every epoch) once without interruption as the reference, then again
and again with ``--resume auto``, killing each attempt with SIGKILL:

* most kills land on a file operation: the child counts its ``os.open``/``write``/``fsync``/
  ``replace``/``rename``/``unlink``/``rmdir`` calls inside the output directory and SIGKILLs
  itself just before or just after the k-th (k random), so kills fall where the files are
  written -- checkpoints, ``latest``, the logs, the best model;
* the rest come from the parent after a random delay (wherever the run happens to be).

Every attempt must either be killed or finish (exit 0): a resume that fails is a failure. After
each finished run (an "episode") the final weights, optimizer state, best model, epoch rows and
step rows (timings aside) must equal the reference bit for bit, with no duplicate or missing
step. Episodes repeat until ``--kills`` kills have happened.

    PYTHONPATH=src:examples python tests/examples/kill_loop.py --kills 60

``tests/examples/test_example_kill_loop.py`` runs a reduced version (a few kills).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCRIPT = REPO / "examples" / "finetune_ced_sonar.py"

# --- the child side: count file operations in the output directory, die at the k-th --------


def install_hook() -> None:
    """Patch ``os`` file operations (called in the child before the trainer runs)."""
    kill_at = int(os.environ.get("KILL_AT_OP", "0"))
    report = os.environ.get("KILL_REPORT", "")
    out = os.path.realpath(os.environ["KILL_OUT"])
    after = os.environ.get("KILL_AFTER") == "1"
    meta_only = os.environ.get("KILL_META") == "1"  # count only opens, syncs, renames, deletes
    count = [0, 0]  # all operations, operations other than writes
    real = {name: getattr(os, name) for name in OPS}
    real_write, real_open, real_close = os.write, os.open, os.close

    def target(name: str, args: tuple[Any, ...]) -> str | None:
        first = args[0]
        if name in ("write", "fsync"):
            try:
                path = os.readlink(f"/proc/self/fd/{first}")
            except OSError:
                return None
        elif isinstance(first, (str, os.PathLike)):
            path = os.path.realpath(os.fspath(first))
        else:
            return None  # an operation relative to a directory descriptor (rmtree)
        return path if path.startswith(out) else None

    def die(name: str, path: str) -> None:
        if report:
            fd = real_open(report, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            line = json.dumps({"op": name, "path": path, "after": after, "n": count[0]})
            real_write(fd, (line + "\n").encode())
            real_close(fd)
        os.kill(os.getpid(), signal.SIGKILL)

    def wrap(name: str) -> Any:
        fn = real[name]

        def patched(*args: Any, **kwargs: Any) -> Any:
            path = target(name, args) if kill_at else None
            if path is None:
                return fn(*args, **kwargs)
            if name == "open" and not (args[1] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)):
                return fn(*args, **kwargs)  # reads are harmless
            count[0] += 1
            count[1] += name != "write"
            if meta_only and name == "write":
                return fn(*args, **kwargs)
            n = count[1] if meta_only else count[0]
            if n == kill_at and not after:
                die(name, path)
            result = fn(*args, **kwargs)
            if n == kill_at and after:
                die(name, path)
            return result

        return patched

    for name in OPS:
        setattr(os, name, wrap(name))
    count_to = os.environ.get("KILL_COUNT_TO")
    if count_to:  # a counting-only run: how many operations a whole run makes
        import atexit

        atexit.register(lambda: Path(count_to).write_text(f"{count[0]} {count[1]}"))


OPS = ("open", "write", "fsync", "replace", "rename", "unlink", "rmdir")

BOOT = """
import runpy, sys
sys.path.insert(0, {here!r})
import kill_loop
kill_loop.install_hook()
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


# --- the parent side ----------------------------------------------------------------------------


def make_config(workdir: Path) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "examples"))
    from clap_example.synthetic import make_dataset, make_sonar_dir, tiny_run_config

    data = make_dataset(workdir / "data", n_train=16, n_test=8, n_val=8)
    return {**tiny_run_config(data, make_sonar_dir(workdir / "sonar")), **LOOP_SETTINGS}


#: What the loop's runs use on top of the tiny models and data: dropout on (the RNG states
#: must be restored), 3 epochs of 4 steps, a checkpoint every 2 steps (an epoch's last step is
#: checkpointed twice: before and after its evaluation), 2 checkpoints kept.
LOOP_SETTINGS: dict[str, Any] = {
    "loss": "kcl",
    "ced_config": {"embed_dim": 32, "depth": 2, "num_heads": 2, "drop_rate": 0.1},
    "sonar_config": {"dropout": 0.1, "activation_dropout": 0.1},
    "epochs": 3,
    "save_every_steps": 2,
    "keep_checkpoints": 2,
    "progress": False,
    "plots": False,
    "seed": 0,
}


def child_env(
    out: Path,
    kill_at: int = 0,
    after: bool = False,
    report: Path | None = None,
    meta: bool = False,
) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(REPO / "src"), str(REPO / "examples"), os.environ.get("PYTHONPATH", "")]
        ),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "KILL_OUT": str(out),
        "KILL_AT_OP": str(kill_at),
        "KILL_AFTER": "1" if after else "0",
        "KILL_REPORT": str(report or ""),
        "KILL_META": "1" if meta else "0",
    }


def launch(config: Path, out: Path, env: dict[str, str], resume: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-c", BOOT.format(here=str(HERE), script=str(SCRIPT))]
    cmd += ["--config", str(config), "--output-dir", str(out)]
    if resume:
        cmd += ["--resume", "auto"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def load(path: Path) -> dict[str, Any]:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


TIMINGS = ("step_time", "epoch_time_s", "peak_memory_mb")


def strip(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows]


def same_tensors(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(same_tensors(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tensors(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def compare(out: Path, ref: Path) -> list[str]:
    """Differences between a finished run and the reference (empty: identical)."""
    problems = []
    latest = [(d / "checkpoints" / (d / "checkpoints" / "latest").read_text()) for d in (out, ref)]
    a, b = load(latest[0] / "state.pt"), load(latest[1] / "state.pt")
    for key in ("model", "loss", "optimizer", "scheduler", "step", "epoch", "best"):
        if not same_tensors(a[key], b[key]):
            problems.append(f"final checkpoint: {key} differs")
    a, b = load(out / "best" / "state.pt"), load(ref / "best" / "state.pt")
    for key in ("model", "loss", "step", "epoch", "metrics"):  # not "args": other paths
        if not same_tensors(a[key], b[key]):
            problems.append(f"best/state.pt: {key} differs")
    if (out / "best" / "metrics.json").read_text() != (ref / "best" / "metrics.json").read_text():
        problems.append("best/metrics.json differs")
    steps = jsonl(out / "train_log.jsonl")
    numbers = [r["step"] for r in steps]
    if numbers != list(range(1, len(numbers) + 1)):
        problems.append(f"train_log steps {numbers}")
    if strip(steps) != strip(jsonl(ref / "train_log.jsonl")):
        problems.append("train_log rows differ")
    csv_lines = (out / "train_log.csv").read_text().splitlines()
    if len(csv_lines) != len(steps) + 1:
        problems.append(f"train_log.csv has {len(csv_lines) - 1} rows for {len(steps)} steps")
    if strip(jsonl(out / "epoch_log.jsonl")) != strip(jsonl(ref / "epoch_log.jsonl")):
        problems.append("epoch_log rows differ")
    summary, reference = (json.loads((d / "summary.json").read_text()) for d in (out, ref))
    if (summary["step"], summary["best"]) != (reference["step"], reference["best"]):
        problems.append("summary.json differs")
    return problems


def run_loop(
    kills: int,
    workdir: Path,
    seed: int = 0,
    timer_share: float = 0.25,
    meta_share: float = 0.5,
    log: Any = print,
    config_values: dict[str, Any] | None = None,
) -> dict[str, Any]:
    rng = random.Random(seed)
    workdir.mkdir(parents=True, exist_ok=True)
    values = config_values or make_config(workdir)
    config = workdir / "config.json"
    config.write_text(json.dumps(values))

    started = time.time()
    ref = workdir / "reference"
    shutil.rmtree(ref, ignore_errors=True)
    t0 = time.time()
    count_file = workdir / "ops.txt"
    count_file.unlink(missing_ok=True)
    # The reference run counts its file operations (KILL_AT_OP=huge: never reached).
    env = {**child_env(ref, kill_at=10**9), "KILL_COUNT_TO": str(count_file)}
    proc = launch(config, ref, env, resume=False)
    _, stderr = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"reference run failed:\n{stderr[-3000:]}")
    ref_seconds = time.time() - t0
    total_ops, meta_ops = map(int, count_file.read_text().split())
    log(
        f"reference run: {ref_seconds:.1f} s, {total_ops} file operations in the output dir "
        f"({meta_ops} opens/syncs/renames/deletes, the rest writes)"
    )

    stats: dict[str, Any] = {
        "kills": 0,
        "io_kills": 0,
        "timer_kills": 0,
        "kills_in_checkpoint_saves": 0,
        "kills_in_latest": 0,
        "kills_in_logs": 0,
        "kills_in_best": 0,
        "kills_other": 0,
        "attempts": 0,
        "episodes": 0,
        "failures": [],
    }
    episode = 0
    while stats["kills"] < kills:
        episode += 1
        out = workdir / f"episode-{episode:03d}"
        shutil.rmtree(out, ignore_errors=True)
        report = workdir / f"episode-{episode:03d}.kills.jsonl"
        report.unlink(missing_ok=True)
        first = True
        while True:
            stats["attempts"] += 1
            use_timer = stats["kills"] >= kills or rng.random() < timer_share
            if stats["kills"] >= kills:
                env = child_env(out)  # enough kills: let this episode finish
            elif use_timer:
                env = child_env(out)
            else:
                # Half the kills at a uniformly drawn operation of any kind (mostly the
                # writes of checkpoint files), half at a metadata operation (between files,
                # at renames and at `latest`), each just before or just after it.
                meta = rng.random() < meta_share
                k = rng.randint(1, meta_ops if meta else total_ops)
                env = child_env(out, k, rng.random() < 0.5, report, meta)
            proc = launch(config, out, env, resume=not first)
            first = False
            killed_by_timer = False
            if use_timer and stats["kills"] < kills:
                try:
                    proc.wait(timeout=rng.uniform(0.5, ref_seconds))
                except subprocess.TimeoutExpired:
                    proc.send_signal(signal.SIGKILL)
                    killed_by_timer = True
            _, stderr = proc.communicate()
            if proc.returncode == 0:
                break
            if proc.returncode != -signal.SIGKILL:
                stats["failures"].append(f"{out}: exit {proc.returncode}: {stderr[-2000:]}")
                log(f"FAILED attempt in {out}: exit {proc.returncode}\n{stderr[-2000:]}")
                return finish(stats, started, log)
            stats["kills"] += 1
            if killed_by_timer:
                stats["timer_kills"] += 1
            else:
                stats["io_kills"] += 1
                where = jsonl(report)[-1]["path"]
                name = os.path.basename(where)
                if "/checkpoints/" in where and "latest" in name:
                    stats["kills_in_latest"] += 1
                elif "/checkpoints/" in where:
                    stats["kills_in_checkpoint_saves"] += 1
                elif "_log." in name:
                    stats["kills_in_logs"] += 1
                elif "/best/" in where or name == "best":
                    stats["kills_in_best"] += 1
                else:
                    stats["kills_other"] += 1
        problems = compare(out, ref)
        stats["episodes"] += 1
        log(
            f"episode {episode}: finished after {stats['kills']} kills in total; "
            + ("identical to the reference" if not problems else "; ".join(problems))
        )
        if problems:
            stats["failures"].append(f"{out}: " + "; ".join(problems))
            break
    return finish(stats, started, log)


def finish(stats: dict[str, Any], started: float, log: Any) -> dict[str, Any]:
    stats["seconds"] = round(time.time() - started, 1)
    log(json.dumps(stats, indent=2))
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=50, help="SIGKILLs in total (default 50)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    parser.add_argument(
        "--timer-share", type=float, default=0.25, help="share of kills after a random delay"
    )
    parser.add_argument("--workdir", help="keep the runs here (default: a temp dir, deleted)")
    args = parser.parse_args(argv)
    if args.workdir:
        stats = run_loop(args.kills, Path(args.workdir), args.seed, args.timer_share)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            stats = run_loop(args.kills, Path(tmp), args.seed, args.timer_share)
    return 1 if stats["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
