"""Verified checkpoints, no silent restart, clear errors, config changes on resume (issue 18,
items 1-3, 6 and 8), and the tamper suite: each way a checkpoint directory can be damaged and
what a ``--resume auto`` does about it.

A "paused" run is one epoch of 4 steps stopped after step 3 with ``--max-steps 3``, a checkpoint
every step and 3 kept: ``step-00000002``, ``step-00000003`` and ``step-00000003.1`` (the save
that closes the stopped epoch at the same step), ``latest`` naming the last.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from test_example_reliability import latest_dir, load_state, rows, run

#: 4 steps in one epoch, no evaluation, a checkpoint every step, 3 kept.
CFG = {
    "loss": "infonce",
    "epochs": 1,
    "test_manifest": None,
    "val_manifest": None,
    "save_every_steps": 1,
    "keep_checkpoints": 3,
}


@pytest.fixture
def cfg(base_config: dict[str, Any]) -> dict[str, Any]:
    return {**base_config, **CFG}


#: The paused run's checkpoints, newest first.
NEWEST, MIDDLE, OLDEST = "step-00000003.1", "step-00000003", "step-00000002"


def ckpt(out: Path, name: str) -> Path:
    return out / "checkpoints" / name


@pytest.fixture(scope="module")
def paused_once(tmp_path_factory: pytest.TempPathFactory, base_config: dict[str, Any]) -> Path:
    """The paused run, trained once per module (each test gets a copy)."""
    out = tmp_path_factory.mktemp("paused") / "run"
    run(out, {**base_config, **CFG}, max_steps=3)
    assert latest_dir(out) == ckpt(out, NEWEST)
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == [OLDEST, MIDDLE, NEWEST]
    return out


def copy_run(once: Path, tmp_path: Path) -> Path:
    """A test's own copy of a run trained once per module."""
    out = tmp_path / "run"
    shutil.copytree(once, out, symlinks=True)
    return out


@pytest.fixture
def paused(tmp_path: Path, paused_once: Path) -> Path:
    return copy_run(paused_once, tmp_path)


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


def _crafted_pickle(out: Path, name: str = NEWEST, file: str = "state.pt") -> str:
    """A pickle whose loading would create ``out/pwned``."""
    path = ckpt(out, name) / file
    state = torch.load(path, weights_only=False)
    state["extra"] = _Payload(out / "pwned")
    torch.save(state, path)
    return f"{name}/{file}"


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def _forged(damage: Any) -> Any:
    """``damage``, then the manifest rewritten to match (a forged manifest)."""

    def apply(out: Path) -> str:
        named = damage(out)
        rewrite_manifest(ckpt(out, NEWEST))
        return str(named)

    return apply


def outside(out: Path) -> Path:
    """A folder outside the run folder."""
    path = out.parent / "outside"
    path.mkdir(exist_ok=True)
    return path


def add_entry(directory: Path, entry: str, file: Path) -> None:
    """List ``entry`` in the manifest with ``file``'s true digest (a forged manifest)."""
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    data = file.read_bytes()
    manifest["files"][entry] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    path.write_text(json.dumps(manifest))


def _traversal_entry(out: Path) -> str:
    entry = "../../../../outside/s.txt"
    target = Path(os.path.normpath(ckpt(out, NEWEST) / entry))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(b"not the run's")
    add_entry(ckpt(out, NEWEST), entry, target)
    return entry


def _absolute_entry(out: Path) -> str:
    target = outside(out) / "s.txt"
    target.write_bytes(b"not the run's")
    add_entry(ckpt(out, NEWEST), str(target), target)
    return str(target)


def _symlinked_state(out: Path) -> str:
    path = ckpt(out, NEWEST) / "state.pt"
    target = outside(out) / "state.pt"
    shutil.move(path, target)
    path.symlink_to(target)
    return f"{NEWEST}/state.pt: a symbolic link"


def _symlinked_folder(out: Path) -> str:
    path = ckpt(out, NEWEST)
    target = outside(out) / NEWEST
    shutil.move(path, target)
    path.symlink_to(target, target_is_directory=True)
    return f"{NEWEST}: a symbolic link"


def _state_lacking_a_key(out: Path) -> str:
    path = ckpt(out, NEWEST) / "state.pt"
    state = torch.load(path, weights_only=True)
    del state["optimizer"]
    torch.save(state, path)
    return f"{NEWEST}/state.pt lacks 'optimizer'"


def _garbage_state(out: Path) -> str:
    (ckpt(out, NEWEST) / "state.pt").write_bytes(b"this is not a checkpoint" * 10)
    return f"{NEWEST}/state.pt"


def _older_state(out: Path) -> str:
    shutil.copy(ckpt(out, OLDEST) / "state.pt", ckpt(out, NEWEST) / "state.pt")
    return f"{NEWEST}/state.pt: at step 2, its manifest says 3"


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
    # issue 22: a manifest names only files of its own folder
    "manifest lists ../../../../outside/s.txt": _traversal_entry,
    "manifest lists an absolute path": _absolute_entry,
    "state.pt a symlink to a file outside": _symlinked_state,
    "step folder a symlink to a folder outside": _symlinked_folder,
    # issue 22: a forged (re-hashed) manifest over a file that does not load
    "crafted pickle in state.pt, forged manifest": _forged(_crafted_pickle),
    "crafted pickle in rng-rank0.pt, forged manifest": _forged(
        lambda out: _crafted_pickle(out, NEWEST, "rng-rank0.pt")
    ),
    "state.pt lacking a key, forged manifest": _forged(_state_lacking_a_key),
    "garbage state.pt, forged manifest": _forged(_garbage_state),
    "an older state.pt, forged manifest": _forged(_older_state),
}


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every file a resume reads (to hash and load it, or as its manifest), spied on at the
    one place that reads the run folder's files."""
    from clap_example import run_folder

    seen: list[str] = []
    read = run_folder.RunFolder.read_bytes

    def spy(self: Any, path: Path, *args: Any, **kwargs: Any) -> bytes | None:
        seen.append(str(path))
        return read(self, path, *args, **kwargs)

    monkeypatch.setattr(run_folder.RunFolder, "read_bytes", spy)
    return seen


def assert_inside(paths: list[str], out: Path) -> None:
    """Each path is a file of the run folder, reached without a symbolic link."""
    root = os.path.realpath(out) + os.sep
    for path in paths:
        assert os.path.realpath(path) == os.path.abspath(path), f"read through a link: {path}"
        assert os.path.abspath(path).startswith(root), f"read outside the run: {path}"


def assert_fell_back(
    out: Path, cfg: dict[str, Any], capsys: pytest.CaptureFixture[str], named: str
) -> str:
    """Resume: a warning naming ``named``, then the run goes on from MIDDLE to the end."""
    capsys.readouterr()
    resume(out, cfg)
    err = capsys.readouterr().err
    warning = "\n".join(line for line in err.splitlines() if line.startswith("[warning]"))
    assert named in warning, err
    assert resumed_from(err) == 3 and f"from {ckpt(out, MIDDLE)}:" in err
    assert not (out / "pwned").exists()
    assert [r["step"] for r in rows(out / "train_log.jsonl")] == [1, 2, 3, 4]
    assert load_state(latest_dir(out))["step"] == 4
    return err


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact_one(
    paused: Path,
    cfg: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    reads: list[str],
    damage: str,
) -> None:
    named = DAMAGE[damage](paused)
    elsewhere = [outside(paused), paused.parents[1] / "outside"]  # what the links point at
    before = {p: p.read_bytes() for d in elsewhere for p in sorted(d.rglob("*")) if p.is_file()}
    assert_fell_back(paused, cfg, capsys, named)
    assert_inside(reads, paused)
    after = {p: p.read_bytes() for d in elsewhere for p in sorted(d.rglob("*")) if p.is_file()}
    assert after == before  # nothing outside the run was changed or deleted through a link


def _set(key: str, value: Any) -> Any:
    return lambda manifest: {**manifest, key: value}


def _entry(value: Any) -> Any:
    return lambda manifest: {**manifest, "files": {**manifest["files"], "state.pt": value}}


def _entry_with(**changes: Any) -> Any:
    def change(manifest: dict[str, Any]) -> dict[str, Any]:
        entry = {**manifest["files"]["state.pt"], **changes}
        return _entry({k: v for k, v in entry.items() if v is not None})(manifest)

    return change


#: Malformed manifests: each makes the checkpoint invalid (a warning, a fall-back).
MALFORMED = {
    "entry a str": _entry("abc"),
    "entry a list": _entry(["abc", 3]),
    "entry an int": _entry(3),
    "entry null": _entry(None),
    "entry without keys": _entry({}),
    "size missing": _entry_with(size=None),
    "size a str": _entry_with(size="1234"),
    "size a bool": _entry_with(size=True),
    "size negative": _entry_with(size=-1),
    "size a float": _entry_with(size=1.5),
    "sha256 missing": _entry_with(sha256=None),
    "sha256 an int": _entry_with(sha256=7),
    "sha256 a list": _entry_with(sha256=["a"]),
    "files a list": lambda m: {**m, "files": list(m["files"])},
    "files a str": _set("files", "state.pt"),
    "files without state.pt": lambda m: {
        **m,
        "files": {"rng-rank0.pt": m["files"]["rng-rank0.pt"]},
    },
    "name an int": _set("name", 3),
    "step a str": _set("step", "3"),
    "step null": _set("step", None),
    "epoch a list": _set("epoch", [0]),
    "args a list": _set("args", ["--lr"]),
    "manifest a list": lambda m: [m],
    "manifest a str": lambda m: "step-00000003.1",
    "manifest a number": lambda m: 3,
    "manifest null": lambda m: None,
}


def malform(out: Path, case: str) -> Path:
    path = ckpt(out, NEWEST) / "manifest.json"
    path.write_text(json.dumps(MALFORMED[case](json.loads(path.read_text()))))
    return path


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_manifest_entry_is_named_and_the_newest_intact_checkpoint_chosen(
    paused: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    from clap_example.checkpoint import find_resume_point

    path = malform(paused, case)
    capsys.readouterr()
    point = find_resume_point(paused / "checkpoints", "auto")
    err = capsys.readouterr().err
    assert point is not None and point.directory == ckpt(paused, MIDDLE)
    assert f"[warning] {path}:" in err, err


def test_a_str_entry_falls_back_in_a_full_resume(
    paused: Path, cfg: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    path = malform(paused, "entry a str")  # the case: 'str' has no attribute 'get'
    err = assert_fell_back(
        paused, cfg, capsys, f"{path}: the entry of 'state.pt' is \"abc\", not an object"
    )
    assert "attribute" not in err


def test_a_latest_symlink_is_named_and_never_followed(
    paused: Path, cfg: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    latest = paused / "checkpoints" / "latest"
    target = outside(paused) / "latest"
    target.write_text(OLDEST)  # would resume from step 2 if followed
    latest.unlink()
    latest.symlink_to(target)
    capsys.readouterr()
    resume(paused, cfg)
    err = capsys.readouterr().err
    assert f"[warning] {latest}: a symbolic link" in err, err
    assert f"from {ckpt(paused, NEWEST)}:" in err and resumed_from(err) == 3
    assert target.read_text() == OLDEST and not latest.is_symlink()  # replaced, not written


def test_a_64_gib_sparse_state_is_refused_in_seconds(
    paused: Path, cfg: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    path = ckpt(paused, NEWEST) / "state.pt"
    size = 64 << 30
    os.truncate(path, size)
    if os.stat(path).st_blocks * 512 > 1 << 30:
        pytest.skip(f"the file system of {path.parent} does not keep files sparse")
    before = bytes_read()
    assert_fell_back(paused, cfg, capsys, f"{NEWEST}/state.pt: {size} bytes")
    read = bytes_read() - before
    # refused by its size, unread (hashing it takes minutes): counted in bytes, not seconds,
    # so that a loaded machine cannot fail it; the resumed run reads a few MB
    assert read < 1 << 30, f"{read} bytes read: the file was read"


def bytes_read() -> int:
    """Bytes this process has read so far, from disk, cache or a sparse file's holes
    (Linux: ``rchar`` of ``/proc/self/io``)."""
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        pytest.skip("counts the bytes read through /proc/self/io (Linux)")
    return int(re.search(r"^rchar: (\d+)$", text, re.M).group(1))


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


def test_crafted_pickles_in_every_checkpoint_are_a_clear_error_and_never_run(
    paused: Path, cfg: dict[str, Any]
) -> None:
    for name in (OLDEST, MIDDLE, NEWEST):
        _crafted_pickle(paused, name)
        rewrite_manifest(ckpt(paused, name))
    with pytest.raises(ValueError, match=r"no intact checkpoint.*state\.pt.*refused") as info:
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
        run(paused, cfg, resume=str(ckpt(paused, NEWEST)))


@pytest.mark.parametrize("file", ["state.pt", "rng-rank0.pt"])
def test_garbage_in_a_checkpoint_file_names_it_and_never_suggests_weights_only_false(
    paused: Path, cfg: dict[str, Any], file: str
) -> None:
    path = ckpt(paused, NEWEST) / file
    path.write_bytes(b"this is not a checkpoint" * 10)
    rewrite_manifest(ckpt(paused, NEWEST))
    with pytest.raises(ValueError, match=rf"{path}") as info:
        run(paused, cfg, resume=str(ckpt(paused, NEWEST)))
    message = str(info.value)
    assert "weights_only=False" not in message and "will likely succeed" not in message


# --- issue 22: logs shorter than the checkpoint are said and recreated ------------------------


def _keep_lines(path: Path, keep: slice) -> None:
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[keep]))


#: Ways to lose rows of the step log before a resume: (what, how many of steps 1-3 remain).
STEP_LOG_LOSSES = {
    "deleted": (lambda p: p.unlink(), "missing"),
    "emptied": (lambda p: p.write_text(""), "shorter"),
    "first row only": (lambda p: _keep_lines(p, slice(0, 1)), "shorter"),
    "middle row gone": (lambda p: _keep_lines(p, slice(0, 3, 2)), "shorter"),
}


@pytest.mark.parametrize("loss", list(STEP_LOG_LOSSES))
def test_lost_step_log_rows_are_named_and_recreated_from_the_checkpoint(
    paused: Path, cfg: dict[str, Any], capsys: pytest.CaptureFixture[str], loss: str
) -> None:
    log = paused / "train_log.jsonl"
    before = rows(log)
    lose, found = STEP_LOG_LOSSES[loss]
    lose(log)
    missing = 3 - (len(rows(log)) if log.exists() else 0)
    capsys.readouterr()
    resume(paused, cfg)
    err = capsys.readouterr().err
    assert f"[warning] {log}: {found}" in err, err
    assert f"{missing} of the 3 rows of steps 1-3 missing; {missing} recreated" in err
    after = rows(log)
    assert after[:3] == before  # every value back, bit for bit (timings included)
    assert [r["step"] for r in after] == [1, 2, 3, 4]
    with (paused / "train_log.csv").open() as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [1, 2, 3, 4]


def test_a_deleted_csv_log_is_named_and_rewritten(
    paused: Path, cfg: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    path = paused / "train_log.csv"
    path.unlink()
    capsys.readouterr()
    resume(paused, cfg)
    assert f"[warning] {path}: missing; rewritten from train_log.jsonl (3 rows)" in (
        capsys.readouterr().err
    )
    with path.open() as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [1, 2, 3, 4]


@pytest.mark.parametrize("loss", ["deleted", "emptied"])
def test_a_lost_epoch_log_is_named_and_recreated_from_the_checkpoint(
    paused: Path, cfg: dict[str, Any], capsys: pytest.CaptureFixture[str], loss: str
) -> None:
    path = paused / "epoch_log.jsonl"
    before = rows(path)
    assert len(before) == 1
    path.unlink() if loss == "deleted" else path.write_text("")
    capsys.readouterr()
    resume(paused, cfg)
    err = capsys.readouterr().err
    found = "missing" if loss == "deleted" else "shorter"
    assert f"[warning] {path}: {found}" in err and "1 of the 1 rows up to step 3" in err, err
    assert rows(path)[:1] == before


def test_lost_rows_a_checkpoint_cannot_recreate_are_counted_never_silent(
    paused: Path, cfg: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint without a step history (an older trainer's): the rows are lost, said."""
    path = ckpt(paused, NEWEST) / "state.pt"
    state = torch.load(path, weights_only=True)
    del state["step_log"]
    torch.save(state, path)
    rewrite_manifest(ckpt(paused, NEWEST))
    (paused / "train_log.jsonl").unlink()
    capsys.readouterr()
    resume(paused, cfg)
    err = capsys.readouterr().err
    assert "3 of the 3 rows of steps 1-3 missing; 0 recreated" in err
    assert "3 cannot be: the checkpoint holds no step history" in err
    assert [r["step"] for r in rows(paused / "train_log.jsonl")] == [4]


def test_an_intact_log_resumes_without_a_log_warning(
    paused: Path, cfg: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    resume(paused, cfg)
    err = capsys.readouterr().err
    assert "_log." not in "\n".join(l for l in err.splitlines() if l.startswith("[warning]"))


def test_the_step_history_keeps_every_value_exactly(tmp_path: Path) -> None:
    from clap_example.log_history import StepHistory

    logged = [
        {"step": 1, "loss": 0.1 + 0.2, "grad_norm": float("nan"), "skipped": 1},
        {"step": 2, "loss": float("inf"), "terms/x": -1e-300, "skipped": 0},
        {"step": 3, "loss": 2.0**60 + 1.0, "note": "text", "flag": True, "skipped": 0},
    ]
    history = StepHistory()
    for row in logged:
        history.append(row)
    torch.save(history.state_dict(), tmp_path / "h.pt")
    loaded = StepHistory.from_state(torch.load(tmp_path / "h.pt", weights_only=True))
    back = loaded.by_step()
    assert list(back) == [1, 2, 3]
    for row in logged:
        numbers = {k: v for k, v in row.items() if k not in ("note", "flag")}
        assert json.dumps(back[row["step"]], sort_keys=True) == json.dumps(numbers, sort_keys=True)
    with pytest.raises(ValueError, match="do not fit"):
        StepHistory.from_state({**history.state_dict(), "columns": ["step"]})


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
