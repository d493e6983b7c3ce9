"""Verified checkpoints, no silent restart, clear errors, config changes on resume (issue 18,
items 1-3, 6 and 8), and the tamper suite: each way a checkpoint directory can be damaged and
what a ``--resume auto`` does about it.

A "paused" run is one epoch of 4 steps stopped after step 3 with ``--max-steps 3``, a checkpoint
every step and 3 kept: ``step-00000002``, ``step-00000003`` and ``step-00000003.1`` (the save
that closes the stopped epoch at the same step), ``latest`` naming the last.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from test_example_reliability import latest_dir, load_state, rows, run


@pytest.fixture
def cfg(base_config: dict[str, Any]) -> dict[str, Any]:
    """4 steps in one epoch, no evaluation, a checkpoint every step, 3 kept."""
    return {
        **base_config,
        "loss": "infonce",
        "epochs": 1,
        "test_manifest": None,
        "save_every_steps": 1,
        "keep_checkpoints": 3,
    }


#: The paused run's checkpoints, newest first.
NEWEST, MIDDLE, OLDEST = "step-00000003.1", "step-00000003", "step-00000002"


def ckpt(out: Path, name: str) -> Path:
    return out / "checkpoints" / name


@pytest.fixture
def paused(tmp_path: Path, cfg: dict[str, Any]) -> Path:
    out = tmp_path / "run"
    run(out, cfg, max_steps=3)
    assert latest_dir(out) == ckpt(out, NEWEST)
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == [OLDEST, MIDDLE, NEWEST]
    return out


def resume(out: Path, cfg: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    return run(out, cfg, resume="auto", **overrides)


def flip_byte(path: Path, where: float = 0.6) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x01
    path.write_bytes(bytes(data))


def rewrite_manifest(directory: Path) -> None:
    """Make ``manifest.json`` match the files again (a damaged file that verifies)."""
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    for name in manifest["files"]:
        data = (directory / name).read_bytes()
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    path.write_text(json.dumps(manifest))


def snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def resumed_from(err: str) -> int:
    """The step the ``[resume] from ...: step N`` line names."""
    line = next(line for line in err.splitlines() if "[resume] from" in line)
    return int(line.split("step ")[1].split(",")[0])


# --- 1. manifests -----------------------------------------------------------------------------


def test_every_checkpoint_holds_a_manifest_of_its_files(paused: Path) -> None:
    for name in (OLDEST, MIDDLE, NEWEST):
        directory = ckpt(paused, name)
        manifest = json.loads((directory / "manifest.json").read_text())
        files = sorted(p.name for p in directory.iterdir() if p.name != "manifest.json")
        assert sorted(manifest["files"]) == files == ["rng-rank0.pt", "state.pt"]
        for name, entry in manifest["files"].items():
            data = (directory / name).read_bytes()
            assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def test_at_least_two_checkpoints_are_kept_by_default() -> None:
    from clap_example.config import build_parser

    assert build_parser().get_default("keep_checkpoints") >= 2


# --- the tamper suite: damage -> fall back to the newest intact checkpoint, with a warning ------


def _flip_state(out: Path) -> str:
    flip_byte(ckpt(out, NEWEST) / "state.pt")
    return f"{NEWEST}/state.pt"


def _flip_rng(out: Path) -> str:
    flip_byte(ckpt(out, NEWEST) / "rng-rank0.pt")
    return f"{NEWEST}/rng-rank0.pt"


def _truncate_state(out: Path) -> str:
    path = ckpt(out, NEWEST) / "state.pt"
    path.write_bytes(path.read_bytes()[:-100])
    return f"{NEWEST}/state.pt"


def _delete_rng(out: Path) -> str:
    (ckpt(out, NEWEST) / "rng-rank0.pt").unlink()
    return f"{NEWEST}/rng-rank0.pt"


def _garble_manifest(out: Path) -> str:
    (ckpt(out, NEWEST) / "manifest.json").write_bytes(b'{"files": {"state.pt": ')
    return f"{NEWEST}/manifest.json"


def _delete_manifest(out: Path) -> str:
    (ckpt(out, NEWEST) / "manifest.json").unlink()
    return f"{NEWEST}/manifest.json"


def _swap_state_files(out: Path) -> str:
    shutil.copy(ckpt(out, MIDDLE) / "state.pt", ckpt(out, NEWEST) / "state.pt")
    return f"{NEWEST}/state.pt"


def _swap_manifests(out: Path) -> str:
    shutil.copy(ckpt(out, MIDDLE) / "manifest.json", ckpt(out, NEWEST) / "manifest.json")
    return f"{NEWEST}/manifest.json"


def _crafted_pickle(out: Path) -> str:
    path = ckpt(out, NEWEST) / "state.pt"
    state = torch.load(path, weights_only=False)
    state["extra"] = _Payload(out / "pwned")
    torch.save(state, path)
    return f"{NEWEST}/state.pt"


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


DAMAGE = {
    "flipped byte in state.pt": _flip_state,
    "flipped byte in rng-rank0.pt": _flip_rng,
    "truncated state.pt": _truncate_state,
    "deleted rng-rank0.pt": _delete_rng,
    "garbled manifest.json": _garble_manifest,
    "deleted manifest.json": _delete_manifest,
    "state.pt swapped with the previous checkpoint's": _swap_state_files,
    "manifest.json swapped with the previous checkpoint's": _swap_manifests,
    "crafted pickle in state.pt": _crafted_pickle,
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact_one(
    paused: Path, cfg: dict[str, Any], capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    named = DAMAGE[damage](paused)
    capsys.readouterr()
    resume(paused, cfg)
    err = capsys.readouterr().err
    assert named in err and "[warning]" in err, err
    assert resumed_from(err) == 3 and f"from {ckpt(paused, MIDDLE)}:" in err
    assert not (paused / "pwned").exists()
    assert [r["step"] for r in rows(paused / "train_log.jsonl")] == [1, 2, 3, 4]
    assert load_state(latest_dir(paused))["step"] == 4


def test_every_damaged_checkpoint_is_a_clear_error_and_nothing_is_deleted(
    paused: Path, cfg: dict[str, Any]
) -> None:
    for name in (OLDEST, MIDDLE, NEWEST):
        flip_byte(ckpt(paused, name) / "state.pt")
    before = snapshot(paused)
    with pytest.raises(ValueError, match=r"no intact checkpoint.*step-00000003\.1/state\.pt"):
        resume(paused, cfg)
    assert snapshot(paused) == before


def test_an_explicit_damaged_checkpoint_is_an_error_naming_the_file(
    paused: Path, cfg: dict[str, Any]
) -> None:
    flip_byte(ckpt(paused, NEWEST) / "state.pt")
    with pytest.raises(ValueError, match=r"step-00000003\.1/state\.pt.*sha256"):
        run(paused, cfg, resume=str(ckpt(paused, NEWEST)))


def test_a_crafted_pickle_with_a_matching_manifest_is_refused_without_running_it(
    paused: Path, cfg: dict[str, Any]
) -> None:
    _crafted_pickle(paused)
    rewrite_manifest(ckpt(paused, NEWEST))
    with pytest.raises(ValueError, match=r"state\.pt") as info:
        resume(paused, cfg)
    assert not (paused / "pwned").exists()
    assert "weights_only=False" not in str(info.value)
    assert "will likely succeed" not in str(info.value)


# --- 2. `latest` deleted or garbled -----------------------------------------------------------


def test_deleted_latest_resumes_from_the_newest_complete_checkpoint(
    paused: Path, cfg: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    first_rows = rows(paused / "train_log.jsonl")
    (paused / "checkpoints" / "latest").unlink()
    capsys.readouterr()
    resume(paused, cfg)
    err = capsys.readouterr().err
    assert "latest" in err and NEWEST in err
    assert resumed_from(err) == 3
    log = rows(paused / "train_log.jsonl")
    assert log[:3] == first_rows  # not restarted: the first rows (timings too) are the same
    assert [r["step"] for r in log] == [1, 2, 3, 4]


def test_deleted_latest_and_only_damaged_checkpoints_is_an_error_that_deletes_nothing(
    paused: Path, cfg: dict[str, Any]
) -> None:
    (paused / "checkpoints" / "latest").unlink()
    for name in (OLDEST, MIDDLE, NEWEST):
        (ckpt(paused, name) / "rng-rank0.pt").unlink()
    before = snapshot(paused)
    with pytest.raises(ValueError, match=r"no intact checkpoint"):
        resume(paused, cfg)
    assert snapshot(paused) == before


@pytest.mark.parametrize(
    "content", [b"\xff\xfe\x00garbage", b"step-00000099\n", b"../../etc\n", b""]
)
def test_garbled_latest_names_the_file_and_falls_back(
    paused: Path, cfg: dict[str, Any], capsys: pytest.CaptureFixture[str], content: bytes
) -> None:
    (paused / "checkpoints" / "latest").write_bytes(content)
    capsys.readouterr()
    resume(paused, cfg)
    err = capsys.readouterr().err
    assert str(paused / "checkpoints" / "latest") in err
    assert resumed_from(err) == 3


def test_garbled_latest_without_a_checkpoint_is_an_error_naming_it(
    paused: Path, cfg: dict[str, Any]
) -> None:
    for name in (OLDEST, MIDDLE, NEWEST):
        shutil.rmtree(ckpt(paused, name))
    (paused / "checkpoints" / "latest").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match=r"checkpoints/latest.*UTF-8"):
        resume(paused, cfg)


# --- 3. clear errors naming the file ----------------------------------------------------------


@pytest.mark.parametrize("value", ["one", None, 2.5, [3]])
def test_a_log_row_with_a_bad_step_names_the_file_and_line(
    paused: Path, cfg: dict[str, Any], value: Any
) -> None:
    log = paused / "train_log.jsonl"
    lines = log.read_text().splitlines()
    row = json.loads(lines[1])
    row["step"] = value
    lines[1] = json.dumps(row)
    log.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"{log}:2: .*step"):
        resume(paused, cfg)


@pytest.mark.parametrize("key", ["optimizer", "model", "step"])
def test_a_state_missing_a_key_names_the_file_and_the_key(
    paused: Path, cfg: dict[str, Any], key: str
) -> None:
    path = ckpt(paused, NEWEST) / "state.pt"
    state = torch.load(path, weights_only=True)
    del state[key]
    torch.save(state, path)
    rewrite_manifest(ckpt(paused, NEWEST))
    with pytest.raises(ValueError, match=rf"{path}.*{key!r}"):
        resume(paused, cfg)


@pytest.mark.parametrize("file", ["state.pt", "rng-rank0.pt"])
def test_garbage_in_a_checkpoint_file_names_it_and_never_suggests_weights_only_false(
    paused: Path, cfg: dict[str, Any], file: str
) -> None:
    path = ckpt(paused, NEWEST) / file
    path.write_bytes(b"this is not a checkpoint" * 10)
    rewrite_manifest(ckpt(paused, NEWEST))
    with pytest.raises(ValueError, match=rf"{path}") as info:
        resume(paused, cfg)
    message = str(info.value)
    assert "weights_only=False" not in message and "will likely succeed" not in message


# --- 6. nothing is created before the whole config is validated -------------------------------


@pytest.mark.parametrize(
    "bad",
    [{"batch_size": 100}, {"ced_config": {"no_such_key": 1}}, {"sonar": "/nonexistent/sonar"}],
    ids=["batch-larger-than-the-set", "bad-ced-config", "missing-sonar"],
)
def test_a_failed_start_leaves_nothing_behind(
    tmp_path: Path, cfg: dict[str, Any], bad: dict[str, Any]
) -> None:
    out = tmp_path / "run"
    with pytest.raises((ValueError, OSError)):
        run(out, cfg, **bad)
    assert not out.exists()
    run(out, cfg, max_steps=1)  # the corrected rerun needs no --overwrite
    assert [r["step"] for r in rows(out / "train_log.jsonl")] == [1]


# --- 8. resume with changed options -----------------------------------------------------------


def test_a_changed_option_is_refused_naming_it_and_its_consequence(
    paused: Path, cfg: dict[str, Any]
) -> None:
    before = snapshot(paused)
    with pytest.raises(ValueError, match=r"--lr.*0\.001.*0\.01.*--allow-config-change"):
        resume(paused, cfg, lr=0.01)
    assert snapshot(paused) == before


def test_allow_config_change_warns_naming_each_option(
    paused: Path, cfg: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    resume(paused, cfg, lr=0.01, weight_decay=0.1, allow_config_change=True)
    err = capsys.readouterr().err
    assert "--lr" in err and "--weight-decay" in err
    assert [r["step"] for r in rows(paused / "train_log.jsonl")] == [1, 2, 3, 4]


def test_more_epochs_recompute_the_schedule_without_a_jump(
    tmp_path: Path, cfg: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    run(out, cfg)  # 4 steps, cosine to 0
    capsys.readouterr()
    resume(out, cfg, epochs=2)
    err = capsys.readouterr().err
    assert "--epochs" in err and "schedule" in err
    lrs = [r["lr"] for r in rows(out / "train_log.jsonl")]
    assert len(lrs) == 8
    assert lrs[4] > 0  # today: step 5 trains at the old schedule's final lr of 0
    factor = [0.5 * (1 + math.cos(math.pi * s / 8)) for s in range(4, 8)]
    assert lrs[4:] == pytest.approx([cfg["lr"] * f for f in factor])


def test_resuming_a_finished_run_says_already_complete_and_changes_nothing(
    tmp_path: Path, cfg: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    run(out, cfg)
    before = snapshot(out)
    capsys.readouterr()
    resume(out, cfg)
    captured = capsys.readouterr()
    assert "already complete" in captured.out + captured.err
    assert snapshot(out) == before
