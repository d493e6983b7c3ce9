"""Crash consistency and bad inputs of the example trainer (issue 11, items 1-9).

Kills are simulated in-process by raising :class:`SimulatedKill` (a ``BaseException`` nothing
catches) at a chosen point; what the "dead" process left on disk is then resumed with
``--resume auto``. ``kill_loop.py`` does the same with real SIGKILLs in subprocesses.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import math
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
import torch
from clap_example import train as train_mod
from clap_example.config import build_parser
from clap_example.data import ManifestError, read_manifest
from clap_example.train import Trainer, main


class SimulatedKill(BaseException):
    """The process "dies" here: nothing after this point runs."""


def run(out: Path, base: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    values = {**base, "output_dir": str(out), **overrides}
    values = {k: v for k, v in values.items() if v is not None}
    config = out.parent / f"{out.name}-{len(list(out.parent.glob('*.json')))}.json"
    config.write_text(json.dumps(values))
    return main(["--config", str(config)])


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def latest_dir(out: Path) -> Path:
    return out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()


def load_state(directory: Path) -> dict[str, Any]:
    return torch.load(directory / "state.pt", map_location="cpu", weights_only=True)


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


DETERMINISTIC = ("step_time", "epoch_time_s", "peak_memory_mb")


def strip(rows_: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in DETERMINISTIC} for r in rows_]


@pytest.fixture
def cfg(base_config: dict[str, Any]) -> dict[str, Any]:
    """8 steps over 2 epochs with evaluation, a checkpoint every step."""
    return {
        **base_config,
        "loss": "infonce",
        "epochs": 2,
        "save_every_steps": 1,
        "keep_checkpoints": 3,
    }


@pytest.fixture
def reference(tmp_path_factory: pytest.TempPathFactory, cfg: dict[str, Any]) -> Path:
    out = tmp_path_factory.mktemp("reference") / "run"
    run(out, cfg)
    return out


def assert_same_run(out: Path, ref: Path) -> None:
    """Bit-identical weights, metrics and logs (timings aside); no duplicate or lost rows."""
    assert same_weights(load_state(latest_dir(out))["model"], load_state(latest_dir(ref))["model"])
    assert load_state(out / "best")["step"] == load_state(ref / "best")["step"]
    assert strip(rows(out / "epoch_log.jsonl")) == strip(rows(ref / "epoch_log.jsonl"))
    steps = rows(out / "train_log.jsonl")
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    assert strip(steps) == strip(rows(ref / "train_log.jsonl"))


# --- 1. weights_only ------------------------------------------------------------------------------


class _Payload:
    """Unpickling this runs ``Path.touch(marker)``: what a crafted checkpoint could do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("file", ["state.pt", "rng-rank0.pt"])
def test_resume_never_unpickles_code(tmp_path: Path, cfg: dict[str, Any], file: str) -> None:
    out = tmp_path / "run"
    run(out, cfg, epochs=1, max_steps=2)
    target = latest_dir(out) / file
    state = torch.load(target, weights_only=False)
    marker = tmp_path / "pwned"
    state["extra"] = _Payload(marker)
    torch.save(state, target)
    # The manifest rewritten to match (else the checkpoint is skipped as damaged, issue 18).
    manifest_path = target.parent / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    data = target.read_bytes()
    manifest["files"][file] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    manifest_path.write_text(json.dumps(manifest))
    # Named explicitly it is refused; with --resume auto a resume falls back (issue 22).
    with pytest.raises(ValueError, match=r"Unsupported global.*refused|refused.*Unsupported"):
        run(out, cfg, epochs=1, resume=str(target.parent))
    assert not marker.exists(), "torch.load ran code from a crafted checkpoint"


# --- 2. atomic writes -----------------------------------------------------------------------------


@contextmanager
def kill_at_open(name_part: str, nth: int) -> Iterator[list[str]]:
    """Raise SimulatedKill right after the ``nth`` open for writing of a file whose name
    contains ``name_part`` (``open(..., "w")`` has truncated it by then)."""
    seen: list[str] = []
    real_io_open, real_os_open = io.open, os.open

    def check(path: Any, writing: bool) -> None:
        if writing and name_part in os.path.basename(os.fspath(path)):
            seen.append(os.fspath(path))
            if len(seen) == nth:
                raise SimulatedKill(os.fspath(path))

    def fake_io_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = real_io_open(file, mode, *args, **kwargs)
        if isinstance(file, (str, os.PathLike)):
            try:
                check(file, any(c in mode for c in "wax+"))
            except SimulatedKill:
                handle.close()
                raise
        return handle

    def fake_os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd = real_os_open(path, flags, *args, **kwargs)
        try:
            check(path, bool(flags & (os.O_WRONLY | os.O_RDWR)))
        except SimulatedKill:
            os.close(fd)
            raise
        return fd

    mp = pytest.MonkeyPatch()
    mp.setattr(io, "open", fake_io_open)
    mp.setattr(os, "open", fake_os_open)
    try:
        yield seen
    finally:
        mp.undo()


def test_kill_while_writing_latest_leaves_a_resumable_run(
    tmp_path: Path, cfg: dict[str, Any], reference: Path
) -> None:
    out = tmp_path / "run"
    with kill_at_open("latest", 3), pytest.raises(SimulatedKill):
        run(out, cfg)
    run(out, cfg, resume="auto")
    assert_same_run(out, reference)


def test_the_checkpoint_latest_points_at_is_never_rewritten(
    tmp_path: Path, cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An epoch ending on a --save-every-steps step saves twice at the same step."""
    out = tmp_path / "run"
    original = Trainer.save_checkpoint
    published: dict[Path, dict[str, bytes]] = {}

    def digest(directory: Path) -> dict[str, bytes]:
        return {p.name: hashlib.sha256(p.read_bytes()).digest() for p in directory.iterdir()}

    def checked_save(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        for directory, files in published.items():
            if directory.is_dir():
                assert digest(directory) == files, f"{directory} changed after publication"
        current = latest_dir(out)
        published[current] = digest(current)
        return result

    monkeypatch.setattr(Trainer, "save_checkpoint", checked_save)
    run(out, cfg, save_every_steps=4, keep_checkpoints=10)
    assert len(published) >= 4  # two epochs x (step save + epoch-end save)


# --- 3. the step log ------------------------------------------------------------------------------


def test_truncated_last_log_line_is_skipped_with_a_warning(
    tmp_path: Path, cfg: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    run(out, cfg, epochs=1, max_steps=3)
    log = out / "train_log.jsonl"
    with log.open("a") as f:
        f.write('{"step": 4, "epoch": 1, "loss": 2.3')  # a kill mid-row
    capsys.readouterr()
    run(out, cfg, epochs=1, resume="auto")
    assert str(log) in capsys.readouterr().err
    assert [r["step"] for r in rows(log)] == [1, 2, 3, 4]


def test_garbled_log_line_before_the_last_names_file_and_line(
    tmp_path: Path, cfg: dict[str, Any]
) -> None:
    out = tmp_path / "run"
    run(out, cfg, epochs=1, max_steps=3)
    log = out / "train_log.jsonl"
    lines = log.read_text().splitlines()
    lines[1] = lines[1][:10]
    log.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"{log}:2:"):
        run(out, cfg, epochs=1, resume="auto")


def test_kill_during_log_rewrite_on_resume_loses_no_rows(
    tmp_path: Path, cfg: dict[str, Any], reference: Path
) -> None:
    out = tmp_path / "run"
    with kill_at_open("latest", 4), pytest.raises(SimulatedKill):
        run(out, cfg)  # killed while publishing step 4: step 3 is the latest
    with kill_at_open("train_log", 1), pytest.raises(SimulatedKill):
        run(out, cfg, resume="auto")  # killed while rewriting the log
    run(out, cfg, resume="auto")
    assert_same_run(out, reference)


# --- 4. kill between the last step's checkpoint and the evaluation --------------------------------


def die_then_resume(
    out: Path, cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch, method: str, dying: Any
) -> None:
    """Run with ``Trainer.<method>`` replaced by ``dying(original, self)`` until it raises
    SimulatedKill, then resume the output directory with the real method."""
    original = getattr(Trainer, method)
    monkeypatch.setattr(Trainer, method, lambda self: dying(original, self))
    with pytest.raises(SimulatedKill):
        run(out, cfg)
    monkeypatch.setattr(Trainer, method, original)
    run(out, cfg, resume="auto")


@pytest.mark.parametrize("epoch", [1, 2])
def test_resume_finishes_the_epoch_evaluation(
    tmp_path: Path,
    cfg: dict[str, Any],
    reference: Path,
    monkeypatch: pytest.MonkeyPatch,
    epoch: int,
) -> None:
    out = tmp_path / "run"
    calls = {"n": 0}

    def dying_evaluate(original: Any, self: Trainer) -> Any:
        calls["n"] += 1
        if calls["n"] == epoch:
            raise SimulatedKill("evaluation")
        return original(self)

    die_then_resume(out, cfg, monkeypatch, "evaluate", dying_evaluate)
    assert_same_run(out, reference)
    assert [r["epoch"] for r in rows(out / "epoch_log.jsonl")] == [1, 2]


def test_kill_after_the_epoch_row_writes_no_duplicate_row(
    tmp_path: Path, cfg: dict[str, Any], reference: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"

    def dying_save(original: Any, self: Trainer) -> Any:
        if self.history and self.step == 4 and self.epoch == 1:  # the epoch-end save
            raise SimulatedKill("epoch-end checkpoint")
        return original(self)

    die_then_resume(out, cfg, monkeypatch, "save_checkpoint", dying_save)
    assert_same_run(out, reference)


# --- 5. NaN/Inf losses ----------------------------------------------------------------------------


def nan_at(monkeypatch: pytest.MonkeyPatch, bad_steps: set[int]) -> None:
    original = train_mod._Trainable.compute_loss
    calls = {"n": 0}

    def compute_loss(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        loss, terms = original(self, *args, **kwargs)
        if calls["n"] in bad_steps:
            loss = loss * float("nan")
        return loss, terms

    monkeypatch.setattr(train_mod._Trainable, "compute_loss", compute_loss)


def test_a_nan_loss_skips_the_step(
    tmp_path: Path, cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    nan_at(monkeypatch, {2})
    out = tmp_path / "run"
    run(out, cfg, epochs=1, test_manifest=None, val_manifest=None, keep_checkpoints=10)
    log = rows(out / "train_log.jsonl")
    assert [r["skipped"] for r in log] == [0, 1, 0, 0]
    assert log[-1]["nonfinite_steps"] == 1
    ckpt = out / "checkpoints"
    step1 = load_state(ckpt / "step-00000001")["model"]
    assert same_weights(step1, load_state(ckpt / "step-00000002")["model"])  # no update
    final = load_state(latest_dir(out))["model"]
    assert all(torch.isfinite(v).all() for v in final.values() if v.is_floating_point())
    assert not same_weights(step1, final)  # later steps trained
    epoch = rows(out / "epoch_log.jsonl")[0]
    assert math.isfinite(epoch["train_loss"])


def test_consecutive_nan_losses_stop_with_a_clear_error(
    tmp_path: Path, cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    nan_at(monkeypatch, set(range(2, 100)))
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match=r"3 steps in a row.*--max-nonfinite-steps"):
        run(out, cfg, test_manifest=None, val_manifest=None, max_nonfinite_steps=3)
    final = load_state(latest_dir(out))["model"]
    assert all(torch.isfinite(v).all() for v in final.values() if v.is_floating_point())


def test_nan_weights_are_never_saved(tmp_path: Path, cfg: dict[str, Any]) -> None:
    out = tmp_path / "run"
    run(out, cfg, epochs=1, max_steps=1, test_manifest=None, val_manifest=None)
    before = (out / "checkpoints" / "latest").read_text()
    values = {
        **cfg,
        "output_dir": str(out),
        "resume": "auto",
        "test_manifest": None,
        "val_manifest": None,
    }
    config = tmp_path / "nan.json"
    config.write_text(json.dumps(values))
    trainer = Trainer(train_mod.parse_args(["--config", str(config)]))
    with torch.no_grad():
        next(trainer.model.parameters()).fill_(float("nan"))
    trainer.step += 1
    with pytest.raises(RuntimeError, match="non-finite"):
        trainer.save_checkpoint()
    assert (out / "checkpoints" / "latest").read_text() == before


# --- 6. a non-empty output directory --------------------------------------------------------------


def test_non_empty_output_dir_needs_resume_or_overwrite(
    tmp_path: Path, cfg: dict[str, Any]
) -> None:
    out = tmp_path / "run"
    run(out, cfg, epochs=1, max_steps=2, test_manifest=None, val_manifest=None)
    log_before = (out / "train_log.jsonl").read_bytes()
    with pytest.raises(FileExistsError, match=r"--resume auto.*--overwrite"):
        run(out, cfg, epochs=1, max_steps=1, test_manifest=None, val_manifest=None)
    assert (out / "train_log.jsonl").read_bytes() == log_before
    assert (latest_dir(out) / "state.pt").is_file()
    run(
        out,
        cfg,
        epochs=1,
        max_steps=1,
        test_manifest=None,
        val_manifest=None,
        overwrite=True,
        save_every_steps=0,
    )
    assert [r["step"] for r in rows(out / "train_log.jsonl")] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-00000001"]


# --- 7. SIGINT / SIGTERM --------------------------------------------------------------------------


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_saves_a_checkpoint_and_prints_the_resume_command(
    tmp_path: Path,
    cfg: dict[str, Any],
    reference: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    signum: int,
    code: int,
) -> None:
    def not_handled(*_: Any) -> None:
        raise RuntimeError("the trainer did not handle the signal")

    previous = signal.signal(signum, not_handled)  # the default would end pytest
    original = Trainer.train_step

    def signalled_step(self: Trainer, batch: Any) -> Any:
        record = original(self, batch)
        if self.step == 2:  # the counter is incremented after train_step: this is step 3
            os.kill(os.getpid(), signum)
        return record

    out = tmp_path / "run"
    try:
        monkeypatch.setattr(Trainer, "train_step", signalled_step)
        with pytest.raises(SystemExit) as info:
            run(out, cfg, save_every_steps=0)
    finally:
        signal.signal(signum, previous)
    assert info.value.code == code
    printed = capsys.readouterr().out
    assert "--config" in printed and "--resume auto" in printed
    assert load_state(latest_dir(out))["step"] == 3
    monkeypatch.setattr(Trainer, "train_step", original)
    run(out, cfg, resume="auto")
    assert same_weights(
        load_state(latest_dir(out))["model"], load_state(latest_dir(reference))["model"]
    )
    assert strip(rows(out / "train_log.jsonl")) == strip(rows(reference / "train_log.jsonl"))


# --- 8. audio and manifests -----------------------------------------------------------------------


def copy_manifest_with(src: Path, dst: Path, line: int, audio: Path) -> Path:
    """``src`` (JSONL) with the audio of manifest line ``line`` replaced by ``audio``."""
    lines = src.read_text().splitlines()
    row = json.loads(lines[line - 1])
    clip = row["audio_id"]
    for i, text in enumerate(lines):
        r = json.loads(text)
        r["audio_path"] = str(audio if r["audio_id"] == clip else src.parent / r["audio_path"])
        lines[i] = json.dumps(r)
    dst.write_text("\n".join(lines) + "\n")
    return dst


def bad_audio(directory: Path, kind: str) -> Path:
    """An audio file that cannot be used: ``garbage``, ``truncated`` (the header intact,
    decoding fails half-way) or ``nan`` (a non-finite sample)."""
    bad = directory / ("bad.flac" if kind == "truncated" else "bad.wav")
    if kind == "garbage":
        bad.write_bytes(b"RIFF" + os.urandom(2000))
    elif kind == "truncated":
        noise = np.random.default_rng(0).standard_normal(64000).astype(np.float32) * 0.1
        sf.write(str(bad), noise, 16000)
        bad.write_bytes(bad.read_bytes()[:50000])
    else:
        wave = np.zeros(16000, dtype=np.float32)
        wave[100] = np.nan
        sf.write(str(bad), wave, 16000, subtype="FLOAT")
    return bad


def manifest_line(manifest: Path, audio: Path) -> int:
    return next(
        i
        for i, text in enumerate(manifest.read_text().splitlines(), start=1)
        if json.loads(text)["audio_path"] == str(audio)
    )


@pytest.mark.parametrize("kind", ["garbage", "truncated", "nan"])
def test_bad_validation_audio_fails_before_training(
    tmp_path: Path, cfg: dict[str, Any], synthetic_data: dict[str, Path], kind: str
) -> None:
    bad = bad_audio(tmp_path, kind)
    manifest = copy_manifest_with(synthetic_data["val"], tmp_path / "val.jsonl", 5, bad)
    line = manifest_line(manifest, bad)
    out = tmp_path / "run"
    with pytest.raises(ManifestError, match=rf"{manifest}:{line}: .*{bad.name}"):
        run(out, cfg, val_manifest=str(manifest))
    assert not (out / "train_log.jsonl").exists()  # before any training step


def test_bad_test_audio_fails_before_the_test_evaluation(
    tmp_path: Path, cfg: dict[str, Any], synthetic_data: dict[str, Path]
) -> None:
    """The test set is read after the training (``final_test``): --check-audio checks its
    clips then, before its one evaluation, naming the line; the run's files stay."""
    bad = bad_audio(tmp_path, "truncated")
    manifest = copy_manifest_with(synthetic_data["test"], tmp_path / "test.jsonl", 5, bad)
    line = manifest_line(manifest, bad)
    out = tmp_path / "run"
    with pytest.raises(ManifestError, match=rf"{manifest}:{line}: .*{bad.name}"):
        run(out, cfg, epochs=1, test_manifest=str(manifest))
    assert len(rows(out / "train_log.jsonl")) == 4 and (out / "best" / "state.pt").is_file()
    assert not (out / "summary.json").exists()


def test_check_audio_off_skips_the_pass(
    tmp_path: Path, cfg: dict[str, Any], synthetic_data: dict[str, Path]
) -> None:
    bad = tmp_path / "bad.wav"
    wave = np.zeros(16000, dtype=np.float32)
    wave[100] = np.inf
    sf.write(str(bad), wave, 16000, subtype="FLOAT")
    manifest = copy_manifest_with(synthetic_data["test"], tmp_path / "test.jsonl", 1, bad)
    with pytest.raises(ManifestError, match=r"non-finite"):
        # Without the pass the evaluation still refuses the clip, naming the manifest line.
        run(tmp_path / "run", cfg, epochs=1, test_manifest=str(manifest), check_audio="off")
    assert (tmp_path / "run" / "train_log.jsonl").is_file()  # it trained first


LANGS = ["eng_Latn", "fra_Latn", "deu_Latn"]
HEADER = b"audio_path,audio_id,caption,language\n"


@pytest.fixture
def wav(tmp_path: Path) -> Path:
    path = tmp_path / "a.wav"
    sf.write(str(path), np.zeros(1600, dtype=np.float32), 16000)
    return path


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_manifest_with_a_utf8_bom_is_read(tmp_path: Path, wav: Path, suffix: str) -> None:
    path = tmp_path / f"m{suffix}"
    if suffix == ".csv":
        body = HEADER + "a.wav,a,un chien é,fr\n".encode()
    else:
        row = {"audio_path": "a.wav", "audio_id": "a", "caption": "un chien é", "language": "fr"}
        body = json.dumps(row, ensure_ascii=False).encode() + b"\n"
    path.write_bytes(b"\xef\xbb\xbf" + body)
    clips = read_manifest(path, LANGS)
    assert clips[0].captions == {"fra_Latn": ["un chien é"]}


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (HEADER + b"a.wav,a,a dog,en\na.wav,a,un chien \xe9,fr\n", r":3: .*UTF-8"),
        (HEADER + b"a.wav,a,a dog,en\na.wav,a,a\x00dog,en\n", r":3: .*NUL"),
        (
            HEADER + b"a.wav,a,a dog,en\na.wav,a," + b"x" * 5000 + b",en\n",
            r": .*line 3: caption.*4096",
        ),
        (HEADER + b"a.wav,a,a dog,en\na.wav,a," + b"x" * 200_000 + b",en\n", r":3: "),
    ],
    ids=["latin1", "nul", "long-caption", "over-csv-limit"],
)
def test_bad_manifest_bytes_name_file_and_line(
    tmp_path: Path, wav: Path, body: bytes, match: str
) -> None:
    path = tmp_path / "m.csv"
    path.write_bytes(body)
    with pytest.raises(ManifestError, match=rf"{path}{match}"):
        read_manifest(path, LANGS)


def test_nul_and_long_fields_in_jsonl(tmp_path: Path, wav: Path) -> None:
    path = tmp_path / "m.jsonl"
    good = {"audio_path": "a.wav", "audio_id": "a", "caption": "a dog", "language": "en"}
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "caption": "a\x00dog"}) + "\n")
    with pytest.raises(ManifestError, match=rf"{path}: .*line 2: NUL"):
        read_manifest(path, LANGS)
    path.write_text(json.dumps({**good, "audio_id": "a" * 5000}) + "\n")
    with pytest.raises(ManifestError, match=rf"{path}: .*line 1: audio_id.*4096"):
        read_manifest(path, LANGS)


def test_audio_paths_can_be_confined_to_the_root(tmp_path: Path) -> None:
    root = tmp_path / "data"
    root.mkdir()
    sf.write(str(root / "in.wav"), np.zeros(1600, dtype=np.float32), 16000)
    sf.write(str(tmp_path / "out.wav"), np.zeros(1600, dtype=np.float32), 16000)
    (root / "link.wav").symlink_to(tmp_path / "out.wav")
    path = root / "m.csv"
    path.write_bytes(HEADER + b"in.wav,a,a dog,en\n../out.wav,b,a cat,en\nlink.wav,c,a cow,en\n")
    assert len(read_manifest(path, LANGS)) == 3  # off by default
    with pytest.raises(ManifestError, match=r"line 3: .*outside.*line 4: .*outside"):
        read_manifest(path, LANGS, contain=True)


# --- 9. disk full ---------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["train_log", "checkpoints"])
def test_disk_full_names_the_path_and_enospc(
    tmp_path: Path, cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    out = tmp_path / "run"
    real_write = os.write

    def full_write(fd: int, data: Any) -> int:
        target = os.readlink(f"/proc/self/fd/{fd}")
        if str(out) in target and where in target:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_write)
    with pytest.raises(OSError, match=rf"{out}/{where}.*ENOSPC") as info:
        run(out, cfg, epochs=1, test_manifest=None, val_manifest=None)
    assert info.value.errno == errno.ENOSPC
    assert not list(out.rglob(".tmp-*"))  # no temp files left behind


# --- --help ---------------------------------------------------------------------------------------


def help_blocks(text: str) -> dict[str, str]:
    """``--option -> its help text`` (wrapped lines joined) of an argparse help page."""
    blocks: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        stripped = line.strip()
        if line.startswith("  -") and stripped.startswith("--"):
            current = stripped.split()[0].rstrip(",")
            blocks[current] = stripped
        elif current is not None and line.startswith("   "):
            blocks[current] += " " + stripped
        else:
            current = None
    return blocks


def test_help_shows_every_default() -> None:
    parser = build_parser()
    blocks = help_blocks(parser.format_help())
    options = [
        a.option_strings[-1]
        for a in parser._actions
        if a.option_strings and a.dest not in ("help", "config")
    ]
    missing = [o for o in options if "(default:" not in blocks.get(o, "")]
    assert not missing, missing


def test_nan_guard_with_the_fp16_grad_scaler(
    tmp_path: Path, cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under --amp fp16 the scaler skips overflowing steps itself (step 1 at the initial scale
    2**16): not counted as non-finite. A NaN loss is skipped before the scaler sees it and
    counted; the scaler keeps working (its next unscale_/step/update run)."""
    nan_at(monkeypatch, {2})
    out = tmp_path / "run"
    run(out, cfg, epochs=1, test_manifest=None, val_manifest=None, amp="fp16", max_steps=3)
    log = rows(out / "train_log.jsonl")
    assert log[1]["skipped"] == 1 and [r["nonfinite_steps"] for r in log] == [0, 1, 1]
    state = load_state(latest_dir(out))
    assert state["scaler"]["scale"] > 0
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
