"""Model selection of the example trainer: ``--val-manifest`` chooses ``best/`` every epoch and
``--test-manifest`` is read and evaluated once, after the training, on the chosen model."""

from __future__ import annotations

import builtins
import io
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from clap_example import evaluation
from clap_example.config import parse_args
from test_example_reliability import rows, run

#: The test manifest's copy: a name no other file of the run has, so every open of it counts.
TEST_NAME = "held-out-test-set.jsonl"


@pytest.fixture
def test_copy(tmp_path: Path, synthetic_data: dict[str, Path]) -> Iterator[Path]:
    """The synthetic test set under a unique name, beside its audio (relative paths hold)."""
    path = synthetic_data["test"].parent / f"{tmp_path.name}-{TEST_NAME}"
    shutil.copyfile(synthetic_data["test"], path)
    yield path
    path.unlink()


@pytest.fixture
def opens(monkeypatch: pytest.MonkeyPatch, test_copy: Path, tmp_path: Path) -> list[int]:
    """Every open of the test manifest (``open``, ``io.open``/``Path.open``, ``os.open``,
    whatever the reader uses), recorded as the number of epoch rows the run had written."""
    seen: list[int] = []
    epoch_log = tmp_path / "run" / "epoch_log.jsonl"
    real_open, real_os_open = io.open, os.open

    def closed_epochs() -> int:
        if not os.path.exists(epoch_log):
            return 0
        with real_open(epoch_log, encoding="utf-8") as f:
            return sum(1 for line in f if line.strip())

    def watch(opener: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(file: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(file, (str, bytes, os.PathLike)) and os.fsdecode(file).endswith(
                test_copy.name
            ):
                seen.append(closed_epochs())
            return opener(file, *args, **kwargs)

        return wrapped

    monkeypatch.setattr(builtins, "open", watch(real_open))
    monkeypatch.setattr(io, "open", watch(real_open))
    monkeypatch.setattr(os, "open", watch(real_os_open))
    return seen


@pytest.fixture
def evaluations(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """``(manifest, weights)`` of every evaluation, in order."""
    calls: list[tuple[str, dict[str, torch.Tensor]]] = []
    real = evaluation.Evaluator.evaluate

    def recording(self: Any, clips: Any = None, manifest: Any = None) -> Any:
        weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        calls.append((str(manifest or self.args.val_manifest), weights))
        return real(self, clips, manifest)

    monkeypatch.setattr(evaluation.Evaluator, "evaluate", recording)
    return calls


def scripted_selection(monkeypatch: pytest.MonkeyPatch, values: list[float]) -> None:
    """The selection metric of epoch i is ``values[i]`` (whatever the tiny model learns)."""
    queue = iter(values)
    monkeypatch.setattr(evaluation.Evaluator, "select_value", lambda self, metrics: next(queue))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_best_is_chosen_on_val_and_the_test_set_is_read_only_at_the_end(
    tmp_path: Path,
    base_config: dict[str, Any],
    test_copy: Path,
    opens: list[int],
    evaluations: list[tuple[str, dict[str, torch.Tensor]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scripted_selection(monkeypatch, [0.2, 0.9, 0.1])  # epoch 2 is the best on val
    out = tmp_path / "run"
    result = run(out, base_config, loss="infonce", epochs=3, test_manifest=str(test_copy))
    epochs = rows(out / "epoch_log.jsonl")
    assert [r["select"] for r in epochs] == [0.2, 0.9, 0.1]
    assert [bool(r.get("best")) for r in epochs] == [True, True, False]
    # The test manifest: opened only once all 3 epochs were closed, and opened then.
    assert opens and set(opens) == {3}, opens
    # 3 validation evaluations, then one on the test set with best/'s weights (epoch 2).
    manifests = [m for m, _ in evaluations]
    assert manifests == [base_config["val_manifest"]] * 3 + [str(test_copy)]
    best = torch.load(out / "best" / "state.pt", weights_only=True)
    assert (best["step"], best["epoch"]) == (epochs[1]["step"], 2)
    assert same(evaluations[-1][1], best["model"])
    assert not same(evaluations[-1][1], evaluations[-2][1])  # not the last epoch's weights
    assert json.loads((out / "best" / "metrics.json").read_text()) == epochs[1]["metrics"]
    # The summary says which manifest chose best/ and holds the test set's metrics.
    summary = json.loads((out / "summary.json").read_text())
    assert summary["selection"] == {
        "manifest": base_config["val_manifest"],
        "metric": "mean_r1",
        "value": 0.9,
        "epoch": 2,
        "step": epochs[1]["step"],
    }
    test = summary["test"]
    assert (test["manifest"], test["model"], test["epoch"], test["step"], test["clips"]) == (
        str(test_copy), "best/", 2, epochs[1]["step"], 8
    )  # fmt: skip
    assert any(k.endswith("/t2a/R@1") for k in test["metrics"])
    assert Path(test["table"]) == out / "eval" / f"test-step-{epochs[1]['step']:08d}.md"
    assert result["test"] == test


def test_without_val_nothing_is_selected_and_the_last_epoch_is_tested(
    tmp_path: Path,
    base_config: dict[str, Any],
    test_copy: Path,
    opens: list[int],
    evaluations: list[tuple[str, dict[str, torch.Tensor]]],
) -> None:
    out = tmp_path / "run"
    result = run(
        out, base_config, loss="infonce", epochs=2, val_manifest=None,
        test_manifest=str(test_copy),
    )  # fmt: skip
    epochs = rows(out / "epoch_log.jsonl")
    assert len(epochs) == 2 and not any("metrics" in r or "best" in r for r in epochs)
    assert not (out / "best" / "state.pt").exists()
    assert opens and set(opens) == {2}, opens
    assert [m for m, _ in evaluations] == [str(test_copy)]
    final = torch.load(out / "checkpoints" / "step-00000008" / "state.pt", weights_only=True)
    assert same(evaluations[0][1], final["model"])
    assert result["selection"]["manifest"] is None
    assert "no --val-manifest" in result["selection"]["rule"]
    assert (result["test"]["model"], result["test"]["step"]) == ("last epoch", 8)


def test_a_bad_test_set_fails_at_the_end_and_resume_repeats_only_the_test(
    tmp_path: Path, base_config: dict[str, Any], test_copy: Path
) -> None:
    """The test set is not read before the end, so a broken one fails there: the checkpoints
    and best/ stay, no summary is written, and --resume auto after the fix trains no step."""
    good = test_copy.read_text()
    broken = [json.loads(line) for line in good.splitlines()]
    broken = [r for r in broken if not (r["audio_id"] == broken[0]["audio_id"] and
                                        r["language"] == "deu_Latn")]  # fmt: skip
    test_copy.write_text("".join(json.dumps(r) + "\n" for r in broken))
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="needs a caption in every language"):
        run(out, base_config, loss="infonce", epochs=1, test_manifest=str(test_copy))
    steps = rows(out / "train_log.jsonl")
    assert len(steps) == 4 and (out / "best" / "state.pt").is_file()
    assert not (out / "summary.json").exists()
    test_copy.write_text(good)
    result = run(
        out, base_config, loss="infonce", epochs=1, test_manifest=str(test_copy), resume="auto"
    )
    assert rows(out / "train_log.jsonl") == steps  # no step trained again
    assert result["test"]["model"] == "best/" and result["test"]["step"] == 4
    assert json.loads((out / "summary.json").read_text())["test"] == result["test"]


def test_a_best_model_of_another_step_is_refused(
    tmp_path: Path, base_config: dict[str, Any], test_copy: Path
) -> None:
    """The test set is evaluated on best/ only when best/ holds the step the run chose."""
    out = tmp_path / "run"
    run(out, base_config, loss="infonce", epochs=1, test_manifest=str(test_copy))
    state = torch.load(out / "best" / "state.pt", weights_only=True)
    torch.save({**state, "step": 99}, out / "best" / "state.pt")
    (out / "summary.json").unlink()  # the run looks killed in its test evaluation
    with pytest.raises(ValueError, match="holds step 99, but the run's history chose step 4"):
        run(out, base_config, loss="infonce", epochs=1, test_manifest=str(test_copy),
            resume="auto")  # fmt: skip


def test_the_test_manifest_is_checked_to_exist_and_differ_from_val(
    tmp_path: Path, base_config: dict[str, Any]
) -> None:
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"--test-manifest .*no such file"):
        run(out, base_config, test_manifest=str(tmp_path / "missing.jsonl"))
    assert not out.exists()  # refused before the output directory was created
    config = tmp_path / "same.json"
    config.write_text(json.dumps({**base_config, "output_dir": str(out),
                                  "test_manifest": base_config["val_manifest"]}))  # fmt: skip
    with pytest.raises(ValueError, match="are the same file: best/ would be chosen on the test"):
        parse_args(["--config", str(config)])


def test_help_lists_val_manifest(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--val-manifest VAL_MANIFEST" in text
    assert "evaluated once, at the end, on the chosen model" in text
