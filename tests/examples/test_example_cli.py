"""The trainer as a newcomer meets it (issue 18, items 5, 7 and 9): the CPU demo learns, command
line errors are one line with exit code 2, a second Ctrl-C says what it does, ``--help``
shows each default once."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from clap_example.config import build_parser
from clap_example.train import Trainer
from test_example_reliability import help_blocks, run

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "finetune_ced_sonar.py"


def cli(
    *argv: str, timeout: float = 600, threads: int | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "examples")])}
    if threads:  # under pytest -n 2 another worker holds the second core
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return subprocess.run(
        [sys.executable, str(SCRIPT), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


def children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's finished children so far: what a
    subprocess cost, whatever else the machine runs (a wall clock counts the waiting)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# --- 5. the demo ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(3100)
def test_the_demo_learns_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    before = children_cpu_seconds()
    # the timeout only ends a hung run: 24 min were measured at a load of 15 (README)
    result = cli("--demo", "--output-dir", str(out), threads=1, timeout=3000)
    cpu = children_cpu_seconds() - before
    assert result.returncode == 0, result.stderr[-3000:]
    # its cost in CPU time, which a loaded machine does not stretch (the wall time it does:
    # 378 s seen under load) and no more than examples/README.md's loaded figure (119
    # CPU-seconds, median of 3 runs at a load of 9-11, with torch's default threads; 29
    # measured with this one thread, which does not spin while waiting for a core)
    assert cpu < 120, f"{cpu:.0f} CPU-seconds"
    lines = result.stdout.strip().splitlines()
    tail = lines[-10:]  # the closing block says what happened
    closing = lines[[i for i, line in enumerate(lines) if line.startswith("demo finished")][-1] :]
    assert closing == tail[-len(closing) :] and len(closing) <= 10, tail
    text = "\n".join(closing)
    assert "training loss" in text and "chance 0.10" in text, text
    assert str(out / "run" / "plots" / "summary.png") in text, text
    epoch_lines = [line for line in lines if line.startswith("epoch ")]
    assert len(epoch_lines) == 30, epoch_lines  # one line per epoch, no tables
    assert not any(line.startswith("|") for line in lines)
    epochs = [
        json.loads(line) for line in (out / "run" / "epoch_log.jsonl").read_text().splitlines()
    ]
    first, final = epochs[0]["train_loss"], epochs[-1]["train_loss"]
    assert final <= 0.7 * first, (first, final)
    metrics = epochs[-1]["metrics"]
    t2a = [v for k, v in metrics.items() if k.endswith("/t2a/R@1") and "per_language" in k]
    assert len(t2a) == 3 and sum(t2a) / len(t2a) >= 0.4, t2a
    assert (out / "run" / "plots" / "summary.png").is_file()


def test_the_demo_is_the_command_after_the_install_in_the_readme() -> None:
    readme = (REPO / "README.md").read_text()
    demo = readme.split("## Try it: the CPU demo", 1)[1].split("\n## ", 1)[0]
    assert "python examples/finetune_ced_sonar.py --demo --output-dir" in demo
    assert '(`pip install -e ".[examples]"`)' in demo  # the install it needs


# --- 7. errors on the command line ------------------------------------------------------------


def one_line_error(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.fixture
def config_file(tmp_path: Path, base_config: dict[str, Any]) -> Path:
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps({**base_config, "test_manifest": None, "val_manifest": None, "max_steps": 1})
    )
    return path


def test_cli_errors_are_one_line_with_exit_code_2(tmp_path: Path, config_file: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "something").write_text("x")
    one_line_error(cli("--config", str(config_file), "--output-dir", str(out)), "not empty")
    one_line_error(
        cli("--config", str(config_file), "--output-dir", str(out), "--resume", "auto",
            "--overwrite"),
        "--overwrite",
    )  # fmt: skip
    one_line_error(
        cli("--config", str(config_file), "--output-dir", str(tmp_path / "o2"), "--batch-size",
            "100"),
        "--batch-size",
    )  # fmt: skip
    one_line_error(cli("--config", str(config_file), "--loss", "nope"), "--loss")
    for bad in (["--loss-chunk-size", "0"], ["--loss", "ask", "--loss-chunk-size", "64"]):
        one_line_error(
            cli("--config", str(config_file), "--output-dir", str(tmp_path / "o2"), *bad),
            "--loss-chunk-size",
        )
    assert not (tmp_path / "o2").exists()


def test_debug_shows_the_traceback(tmp_path: Path, config_file: Path) -> None:
    result = cli(
        "--config", str(config_file), "--output-dir", str(tmp_path / "o"), "--batch-size", "100",
        "--debug",
    )  # fmt: skip
    assert result.returncode != 0
    assert "Traceback" in result.stderr


# --- 9. a second Ctrl-C, --help ---------------------------------------------------------------


def test_a_second_ctrl_c_says_it_stops_without_saving_and_where_a_resume_restarts(
    tmp_path: Path,
    base_config: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def not_handled(*_: Any) -> None:
        raise RuntimeError("the trainer did not handle the signal")

    previous = signal.signal(signal.SIGINT, not_handled)
    original = Trainer.train_step

    def twice(self: Trainer, batch: Any) -> Any:
        record = original(self, batch)
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return record

    try:
        monkeypatch.setattr(Trainer, "train_step", twice)
        with pytest.raises(SystemExit) as info:
            run(tmp_path / "run", base_config, loss="infonce", save_every_steps=2,
                test_manifest=None, val_manifest=None)  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, previous)
    assert info.value.code == 130
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert "without saving" in text
    assert "step-00000002" in text and "step 2" in text


def test_help_shows_each_default_once() -> None:
    blocks = help_blocks(build_parser().format_help())
    twice = {name: block for name, block in blocks.items() if block.count("(default") > 1}
    assert not twice, twice
