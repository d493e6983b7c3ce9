"""The run folder's one rule and loading what was verified (issue 29, items 1-3).

Everything the trainer reads or writes under ``--output-dir`` is a real file or directory inside
it: a symbolic link, a FIFO or a device is refused by name (or named in a warning and replaced,
where that loses nothing), every read is size-capped, a checkpoint file is read once and loaded
from the bytes that were hashed, and deep or hostile JSON is an error naming the file (and line)
or the documented skip/fall-back, never a ``RecursionError``, a ``MemoryError`` or a hang.
"""

# The paused run's fixtures are test_example_checkpoints' (imported, then named as arguments).
# ruff: noqa: F811

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_example_checkpoints import (  # noqa: F401 - fixtures
    CFG,
    NEWEST,
    OLDEST,
    assert_fell_back,
    cfg,
    ckpt,
    copy_run,
    outside,
    paused,
    paused_once,
    resume,
    resumed_from,
)
from test_example_reliability import latest_dir, load_state, rows, run

#: Every test here must end in seconds: a FIFO that blocked would hang it.
pytestmark = pytest.mark.timeout(120)

DEEP_ARRAY = "[" * 100_000 + "]" * 100_000  # 200 KB: RecursionError in json.loads
DEEP_OBJECT_DEPTH = 3_000


def deep_object(depth: int = DEEP_OBJECT_DEPTH) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def deep_json(depth: int = DEEP_OBJECT_DEPTH) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


def files_under(directory: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Where every file the run folder *read* was, resolved when it was read (a read it
    refused is not one): a read through a link would resolve outside the run."""
    from clap_example import run_folder

    seen: list[str] = []
    read = run_folder.RunFolder.read_bytes

    def spy(self: Any, path: Path, *args: Any, **kwargs: Any) -> bytes | None:
        where = os.path.realpath(path)
        data = read(self, path, *args, **kwargs)
        if data is not None:
            seen.append(where)
        return data

    monkeypatch.setattr(run_folder.RunFolder, "read_bytes", spy)
    return seen


def assert_inside(reads: list[str], out: Path) -> None:
    """Every file read was in the run folder when it was read."""
    root = os.path.realpath(out) + os.sep
    outside_reads = [where for where in reads if not where.startswith(root)]
    assert not outside_reads, outside_reads


def warnings_of(err: str) -> str:
    return "\n".join(line for line in err.splitlines() if line.startswith("[warning]"))


# --- the run folder, unit by unit ---------------------------------------------------------------


def test_the_run_folder_reads_only_regular_files_under_their_cap(tmp_path: Path) -> None:
    from clap_example.run_folder import RunFolder, RunFolderError

    root = tmp_path / "run"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.txt").write_bytes(b"12345")
    (tmp_path / "secret").write_bytes(b"outside")
    (root / "link").symlink_to(tmp_path / "secret")
    (root / "linked-dir").symlink_to(root / "sub", target_is_directory=True)
    os.mkfifo(root / "fifo")
    (root / "zero").symlink_to("/dev/zero")
    folder = RunFolder(root)
    assert folder.read_bytes(root / "sub" / "a.txt", 5) == b"12345"
    assert folder.read_bytes(root / "absent", 5) is None
    refused = {
        root / "link": "a symbolic link",
        root / "linked-dir" / "a.txt": "a symbolic link",
        root / "fifo": "a FIFO",
        root / "zero": "a symbolic link",
        root / "sub" / "a.txt": "5 bytes, more than the 4",
    }
    for path, what in refused.items():
        with pytest.raises(RunFolderError, match=what) as info:
            folder.read_bytes(path, 4)
        named = root / "linked-dir" if "linked-dir" in str(path) else path
        assert str(named) in str(info.value)
    with pytest.raises(RunFolderError, match="outside the run folder"):
        folder.read_bytes(tmp_path / "secret", 100)
    with pytest.raises(RunFolderError, match=r"linked-dir: a symbolic link"):
        folder.dir(root / "linked-dir", create=True)
    assert (tmp_path / "secret").read_bytes() == b"outside"


def test_a_device_node_in_the_run_folder_is_refused_by_name(tmp_path: Path) -> None:
    import stat

    from clap_example.checkpoint import read_summary
    from clap_example.run_folder import RunFolder, RunFolderError

    root = tmp_path / "run"
    root.mkdir()
    zero = root / "summary.json"
    try:
        os.mknod(zero, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # what /dev/zero is
    except (PermissionError, AttributeError):
        pytest.skip("creating a device node needs root (CAP_MKNOD) on Linux")
    with pytest.raises(RunFolderError, match=rf"{zero}: a device"):
        RunFolder(root).read_bytes(zero, 1 << 20)
    assert read_summary(root) == {}  # named in a warning, never read


def test_the_run_folder_replaces_a_link_it_writes_and_never_follows_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from clap_example.run_folder import RunFolder, RunFolderError

    root = tmp_path / "run"
    root.mkdir()
    secret = tmp_path / "secret"
    secret.write_bytes(b"outside")
    (root / "summary.json").symlink_to(secret)
    os.mkfifo(root / "config.json")
    folder = RunFolder(root)
    folder.write_text(root / "summary.json", "{}")
    folder.write_text(root / "config.json", "{}")
    err = capsys.readouterr().err
    assert f"{root / 'summary.json'}: a symbolic link" in err
    assert f"{root / 'config.json'}: a FIFO" in err
    assert secret.read_bytes() == b"outside"
    assert (root / "summary.json").read_text() == "{}" and not (root / "summary.json").is_symlink()
    (root / "log.jsonl").symlink_to(secret)
    with pytest.raises(OSError, match=r"log\.jsonl"):
        folder.append(root / "log.jsonl", "{}\n")  # an append never follows a link
    (root / "eval").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(RunFolderError, match=r"eval: a symbolic link"):
        folder.write_text(root / "eval" / "step-00000001.md", "table")
    assert secret.read_bytes() == b"outside" and not (tmp_path / "step-00000001.md").exists()


def test_safe_json_names_the_source_and_never_recurses() -> None:
    from clap_example import safe_json

    for text in (DEEP_ARRAY, deep_json()):
        with pytest.raises(ValueError, match=r"^f\.json:3: JSON nested"):
            safe_json.loads(text, "f.json:3")
    with pytest.raises(ValueError, match=r"nested more than 64"):
        safe_json.loads("[" * 500 + "]" * 500, "f.json")  # parses, too deep to use
    with pytest.raises(ValueError, match=r"^f\.json: not valid JSON"):
        safe_json.loads('{"a": ', "f.json")
    assert safe_json.loads('{"a": [1, {"b": 2}]}', "f.json") == {"a": [1, {"b": 2}]}


# --- 1. load what was verified ------------------------------------------------------------------


def _swap_same_size(path: Path, out: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.unlink()
    path.write_bytes(bytes(data))  # another file of the same size


def _swap_other(path: Path, out: Path) -> None:
    shutil.copy(ckpt(out, OLDEST) / "state.pt", path)


def _symlink(path: Path, out: Path) -> None:
    target = outside(out) / path.name
    shutil.copy(path, target)  # the very bytes: a followed link would load and verify them
    path.unlink()
    path.symlink_to(target)


def _fifo(path: Path, out: Path) -> None:
    path.unlink()
    os.mkfifo(path)


SWAPS: dict[str, Callable[[Path, Path], None]] = {
    "swapped for a file of the same size": _swap_same_size,
    "swapped for an older checkpoint's state.pt": _swap_other,
    "a symlink to its own bytes outside": _symlink,
    "a FIFO": _fifo,
}


@pytest.mark.parametrize("file", ["state.pt", "rng-rank0.pt"])
@pytest.mark.parametrize("swap", list(SWAPS))
def test_a_file_swapped_between_verification_and_load_is_refused_and_the_resume_falls_back(
    paused: Path,
    cfg: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    reads: list[str],
    swap: str,
    file: str,
) -> None:
    from clap_example import checkpoint

    verify = checkpoint.verify

    def verify_then_swap(directory: Path) -> dict[str, Any]:
        manifest = verify(directory)  # the listing, types and sizes checked ...
        if directory.name == NEWEST and not os.path.islink(directory / file):
            if not (directory / file).is_fifo():
                SWAPS[swap](directory / file, paused)  # ... then the file changes
        return manifest

    monkeypatch.setattr(checkpoint, "verify", verify_then_swap)
    err = assert_fell_back(paused, cfg, capsys, f"{NEWEST}/{file}")
    assert f"{ckpt(paused, NEWEST) / file}:" in warnings_of(err)
    assert_inside(reads, paused)  # the link was not followed, the FIFO not waited on


@pytest.mark.parametrize("swap", list(SWAPS))
def test_a_file_swapped_after_verification_is_never_read_again(
    paused: Path,
    cfg: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    reads: list[str],
    swap: str,
) -> None:
    """Verification and load are one read: rank 0 resumes from the bytes it hashed, whatever
    happens to the files afterwards (here while the models are built)."""
    from clap_example import checkpoint, train

    state_path = ckpt(paused, NEWEST) / "state.pt"
    where = os.path.realpath(state_path)  # before the swap
    expected = json.loads((ckpt(paused, NEWEST) / "manifest.json").read_text())["files"]
    loaded: list[str] = []
    load_bytes, check_clips = checkpoint.load_bytes, train.check_clips

    def spy_load(data: bytes, path: Path, *args: Any) -> dict[str, Any]:
        assert hashlib.sha256(data).hexdigest() == expected[path.name]["sha256"]
        loaded.append(str(path))
        return load_bytes(data, path, *args)

    def swap_then_check(*args: Any) -> None:
        for name in ("state.pt", "rng-rank0.pt"):
            SWAPS[swap](ckpt(paused, NEWEST) / name, paused)
        check_clips(*args)

    monkeypatch.setattr(checkpoint, "load_bytes", spy_load)
    monkeypatch.setattr(train, "check_clips", swap_then_check)
    capsys.readouterr()
    resume(paused, cfg)
    err = capsys.readouterr().err
    assert f"from {ckpt(paused, NEWEST)}:" in err and resumed_from(err) == 3
    assert loaded == [str(state_path), str(state_path.with_name("rng-rank0.pt"))]
    assert reads.count(where) == 1  # read once, before the swap; never again
    assert_inside(reads, paused)
    assert [r["step"] for r in rows(paused / "train_log.jsonl")] == [1, 2, 3, 4]


# --- 2. one rule for the whole run folder -------------------------------------------------------


@pytest.mark.parametrize("name", ["checkpoints", "best", "eval", "plots", "tensorboard"])
def test_a_symlinked_run_directory_is_refused_by_name_and_nothing_outside_is_touched(
    paused: Path, cfg: dict[str, Any], reads: list[str], name: str
) -> None:
    elsewhere = outside(paused)
    target = elsewhere / name
    if (paused / name).exists():
        shutil.move(paused / name, target)
    else:
        target.mkdir()
    (paused / name).symlink_to(target, target_is_directory=True)
    before = files_under(elsewhere)
    with pytest.raises((ValueError, OSError), match=rf"{paused / name}: a symbolic link") as info:
        resume(paused, cfg)
    assert "/outside" in str(info.value)  # where the link points, named
    assert files_under(elsewhere) == before
    assert_inside(reads, paused)


LOGS = ["train_log.jsonl", "train_log.csv", "epoch_log.jsonl"]


def _link_outside(path: Path, out: Path) -> Path:
    target = outside(out) / f"{path.name}.target"
    shutil.move(path, target)
    path.symlink_to(target)
    return target


def _link_passwd(path: Path, out: Path) -> Path:
    path.unlink()
    path.symlink_to("/etc/passwd")
    return Path("/etc/passwd")


def _link_zero(path: Path, out: Path) -> Path:
    path.unlink()
    path.symlink_to("/dev/zero")
    return Path("/dev/zero")


def _make_fifo(path: Path, out: Path) -> Path:
    path.unlink()
    os.mkfifo(path)
    return path


def _sparse(path: Path, out: Path) -> Path:
    os.truncate(path, 16 << 30)  # 16 GiB of holes: over the cap, never read
    return path


HOSTILE = {
    "a link outside": (_link_outside, "a symbolic link"),
    "a link to /etc/passwd": (_link_passwd, "a symbolic link"),
    "a link to /dev/zero": (_link_zero, "a symbolic link"),
    "a FIFO": (_make_fifo, "a FIFO"),
    "a 16 GiB sparse file": (_sparse, "17179869184 bytes, more than"),
}


@pytest.mark.parametrize("log", LOGS)
@pytest.mark.parametrize("hostile", list(HOSTILE))
def test_a_hostile_log_is_named_never_read_and_recreated_from_the_checkpoint(
    paused: Path,
    cfg: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    reads: list[str],
    log: str,
    hostile: str,
) -> None:
    path = paused / log
    if log == "epoch_log.jsonl" and not path.exists():
        path.write_text("")
    make, what = HOSTILE[hostile]
    make(path, paused)
    before = files_under(outside(paused))
    capsys.readouterr()
    resume(paused, cfg)
    err = capsys.readouterr().err
    assert f"{path}: {what}" in warnings_of(err), err
    assert_inside(reads, paused)
    assert files_under(outside(paused)) == before
    assert path.is_file() and not path.is_symlink() and path.stat().st_size < 1 << 20
    assert [r["step"] for r in rows(paused / "train_log.jsonl")] == [1, 2, 3, 4]


@pytest.fixture(scope="module")
def finished_once(tmp_path_factory: pytest.TempPathFactory, base_config: dict[str, Any]) -> Path:
    """A run of 4 steps trained to its end, with its summary (each test gets a copy)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    run(out, {**base_config, **CFG})
    return out


@pytest.fixture
def finished(tmp_path: Path, finished_once: Path) -> Path:
    return copy_run(finished_once, tmp_path)


def _deep_summary(path: Path, out: Path) -> Path:
    path.write_text(deep_json())
    return path


def _array_summary(path: Path, out: Path) -> Path:
    path.write_text(DEEP_ARRAY)
    return path


SUMMARIES = {
    **HOSTILE,
    "3,000-deep JSON": (_deep_summary, "JSON nested"),
    "100k brackets": (_array_summary, "JSON nested"),
}


@pytest.mark.parametrize("hostile", list(SUMMARIES))
def test_a_hostile_summary_of_a_finished_run_is_named_and_written_afresh(
    finished: Path,
    cfg: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    reads: list[str],
    hostile: str,
) -> None:
    path = finished / "summary.json"
    expected = json.loads(path.read_text())
    make, what = SUMMARIES[hostile]
    make(path, finished)
    before = files_under(outside(finished))
    capsys.readouterr()
    result = resume(finished, cfg)
    err = capsys.readouterr().err
    assert f"{path}: {what}" in warnings_of(err), err
    assert_inside(reads, finished)
    assert files_under(outside(finished)) == before
    assert path.is_file() and not path.is_symlink()
    assert json.loads(path.read_text())["step"] == expected["step"] == result["step"] == 4
    assert load_state(latest_dir(finished))["step"] == 4


def test_an_intact_finished_run_still_says_already_complete(
    finished: Path, cfg: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    resume(finished, cfg)
    captured = capsys.readouterr()
    assert "already complete" in captured.out and "[warning]" not in captured.err


# --- 3. deep or hostile JSON --------------------------------------------------------------------


def _manifest_of_brackets(directory: Path) -> None:
    (directory / "manifest.json").write_text(DEEP_ARRAY)


def _deep_args(directory: Path) -> None:
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    text = json.dumps(manifest)
    # 3,000 levels inside "args" (json.dumps itself would recurse too deeply to write it)
    path.write_text(text.replace('"args": {', '"args": {"deep": ' + deep_json() + ", ", 1))


@pytest.mark.parametrize("damage", [_manifest_of_brackets, _deep_args])
def test_a_deep_manifest_falls_back_to_the_intact_older_checkpoint(
    paused: Path, cfg: dict[str, Any], capsys: pytest.CaptureFixture[str], damage: Any
) -> None:
    damage(ckpt(paused, NEWEST))
    err = assert_fell_back(paused, cfg, capsys, f"{NEWEST}/manifest.json")
    assert "JSON nested" in warnings_of(err)
    assert "RecursionError" not in err


def test_a_deep_manifest_named_explicitly_is_an_error_naming_it(
    paused: Path, cfg: dict[str, Any]
) -> None:
    _deep_args(ckpt(paused, NEWEST))
    with pytest.raises(ValueError, match=rf"{NEWEST}/manifest\.json.*JSON nested"):
        run(paused, cfg, resume=str(ckpt(paused, NEWEST)))


def test_a_deeply_nested_last_log_line_is_skipped_as_documented(
    paused: Path, cfg: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    log = paused / "train_log.jsonl"
    with log.open("a") as f:
        f.write(deep_json() + "\n")
    capsys.readouterr()
    resume(paused, cfg)
    err = capsys.readouterr().err
    assert f"{log}:4: skipping a truncated last line" in err
    assert [r["step"] for r in rows(log)] == [1, 2, 3, 4]


@pytest.mark.parametrize("text", [DEEP_ARRAY, deep_json()])
def test_a_deep_log_line_before_the_last_names_the_file_and_line(
    paused: Path, cfg: dict[str, Any], text: str
) -> None:
    log = paused / "train_log.jsonl"
    lines = log.read_text().splitlines()
    lines.insert(1, text)
    log.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"{log}:2: not a JSON object \(JSON nested"):
        resume(paused, cfg)


def test_a_deep_config_file_and_json_option_name_themselves(tmp_path: Path) -> None:
    from clap_example.config import load_config_file, parse_args

    config = tmp_path / "c.json"
    for text in (DEEP_ARRAY, deep_json()):
        config.write_text(text)
        with pytest.raises(ValueError, match=rf"--config {config}: JSON nested"):
            load_config_file(config)
    pytest.importorskip("yaml", reason="YAML configs need PyYAML")
    nested = tmp_path / "c.yaml"
    nested.write_text("a: " + "[" * 3000 + "]" * 3000 + "\n")
    with pytest.raises(ValueError, match=rf"--config {nested}: nested"):
        load_config_file(nested)
    with pytest.raises(SystemExit):
        parse_args(["--ced-config", deep_json(), "--train-manifest", "m", "--sonar", "s"])


def test_a_deep_data_manifest_row_names_the_file_and_line(tmp_path: Path) -> None:
    from clap_example.data import ManifestError, read_manifest

    manifest = tmp_path / "m.jsonl"
    row = {"audio_path": "a.wav", "audio_id": "a", "caption": "x", "language": "eng_Latn"}
    manifest.write_text(json.dumps(row) + "\n" + DEEP_ARRAY + "\n")
    with pytest.raises(ManifestError, match=rf"{manifest}:2: JSON nested"):
        read_manifest(manifest, ["eng_Latn"], check_files=False)


def test_a_deep_epoch_log_is_named_and_rewritten_from_the_checkpoint(
    paused: Path, cfg: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    epoch_log = paused / "epoch_log.jsonl"
    epoch_log.write_text(deep_json() + "\n" + deep_json() + "\n")
    capsys.readouterr()
    resume(paused, cfg)
    err = capsys.readouterr().err
    assert f"{epoch_log}:1:" in warnings_of(err)
    assert rows(epoch_log) == load_state(latest_dir(paused))["history"]
