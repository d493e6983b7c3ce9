"""Files of the example trainer (issue 33, item 3): no write outside the run folder, no read that
blocks, no manifest line held whole in memory.

- Every write of the run folder is relative to directory descriptors opened once with
  ``O_NOFOLLOW``: a directory swapped for a link between the check and the write is never
  written through, and the file is not published (an error naming the directory).
- Data manifests and audio files are opened once with ``O_NONBLOCK`` and checked by ``fstat``:
  a FIFO, socket, device or directory is an error saying what it is; the bytes (and the audio)
  come from that descriptor, so a file swapped for a FIFO after the check is never waited on.
- Manifests are streamed line by line with a cap (``MAX_LINE_BYTES``): an over-long line is an
  error naming the file and the line, in bounded memory, never a ``MemoryError``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
from test_example_reliability import run

#: Every test here must end in seconds: a FIFO that blocked would hang it.
pytestmark = pytest.mark.timeout(120)

LANGS = ["eng_Latn", "fra_Latn", "deu_Latn"]
HEADER = b"audio_path,audio_id,caption,language\n"


def files_under(directory: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path]:
    """A run folder with an ``eval/`` directory and an empty folder outside it."""
    root, outside = tmp_path / "run", tmp_path / "outside"
    (root / "eval").mkdir(parents=True)
    outside.mkdir()
    return root, outside


def swap_for_link(directory: Path, outside: Path) -> None:
    """``directory`` moved aside (inside the run folder) and replaced by a link outside."""
    directory.rename(directory.with_name(directory.name + ".moved"))
    directory.symlink_to(outside, target_is_directory=True)


def swap_before(monkeypatch: pytest.MonkeyPatch, name: str, swap: Callable[[], None]) -> None:
    """Call ``swap()`` once, just before ``durable.<name>`` runs: after the run folder checked
    the directories, before the first byte is written."""
    from clap_example import durable

    original = getattr(durable, name)
    done: list[bool] = []

    def swapped(*args: Any, **kwargs: Any) -> Any:
        if not done:
            done.append(True)
            swap()
        return original(*args, **kwargs)

    monkeypatch.setattr(durable, name, swapped)


# --- writes: never through a link, whenever it appears ------------------------------------------


@pytest.mark.parametrize("write", ["write_text", "torch_save", "write_lines"])
def test_a_directory_swapped_for_a_link_between_check_and_write_is_refused_by_name(
    layout: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, write: str
) -> None:
    from clap_example.run_folder import RunFolder, RunFolderError

    root, outside = layout
    target = root / "eval" / "step-00000001.md"
    swap_before(monkeypatch, "atomic_write", lambda: swap_for_link(root / "eval", outside))
    folder = RunFolder(root)
    calls = {
        "write_text": lambda: folder.write_text(target, "table"),
        "torch_save": lambda: folder.torch_save({"a": 1}, target),
        "write_lines": lambda: folder.write_lines(target, ["a\n"]),
    }
    with pytest.raises(RunFolderError, match=rf"{root / 'eval'}: replaced while a file"):
        calls[write]()
    assert files_under(outside) == {}  # 0 bytes outside
    assert os.listdir(root / "eval.moved") == []  # nothing published, no temporary file left


def test_an_append_after_the_swap_lands_in_the_directory_that_was_checked(
    layout: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from clap_example.run_folder import RunFolder

    root, outside = layout
    swap_before(monkeypatch, "append_line", lambda: swap_for_link(root / "eval", outside))
    RunFolder(root).append(root / "eval" / "log.jsonl", "{}\n")
    assert files_under(outside) == {}
    assert (root / "eval.moved" / "log.jsonl").read_text() == "{}\n"


def test_a_directory_swapped_before_the_write_is_refused_before_any_byte(
    layout: tuple[Path, Path],
) -> None:
    from clap_example.run_folder import RunFolder, RunFolderError

    root, outside = layout
    folder = RunFolder(root)
    folder.write_text(root / "eval" / "a.md", "first")  # the folder in use ...
    swap_for_link(root / "eval", outside)  # ... then a link in its place
    for write in (
        lambda: folder.write_text(root / "eval" / "b.md", "x"),
        lambda: folder.append(root / "eval" / "b.jsonl", "{}\n"),
        lambda: folder.remove(root / "eval" / "a.md"),
        lambda: folder.write_text(root / "eval" / "sub" / "c.md", "x"),
    ):
        with pytest.raises(RunFolderError, match=rf"{root / 'eval'}: a symbolic link"):
            write()
    assert files_under(outside) == {}


def test_the_run_folder_itself_swapped_for_a_link_is_refused(layout: tuple[Path, Path]) -> None:
    from clap_example.run_folder import RunFolder, RunFolderError

    root, outside = layout
    folder = RunFolder(root)
    folder.write_text(root / "config.json", "{}")
    root.rename(root.with_name("run.moved"))
    root.symlink_to(outside, target_is_directory=True)
    with pytest.raises(RunFolderError, match=rf"{root}: replaced by another directory"):
        folder.write_text(root / "summary.json", "{}")
    assert files_under(outside) == {}


def test_a_removal_through_a_swapped_directory_touches_nothing_outside(
    layout: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from clap_example.run_folder import RunFolder

    root, outside = layout
    (outside / "step-00000001").mkdir()
    (outside / "step-00000001" / "state.pt").write_bytes(b"keep")
    (root / "eval" / "step-00000001").mkdir()
    swap_before(monkeypatch, "remove_at", lambda: swap_for_link(root / "eval", outside))
    RunFolder(root).remove(root / "eval" / "step-00000001")
    assert (outside / "step-00000001" / "state.pt").read_bytes() == b"keep"
    assert not (root / "eval.moved" / "step-00000001").exists()  # the one that was checked


@pytest.mark.parametrize(
    ("directory", "write", "extra"),
    [
        ("eval", "atomic_write", {}),  # the retrieval table, at the end of epoch 1
        ("checkpoints", "atomic_write", {"save_every_steps": 1}),  # step 1's rng-rank0.pt
        ("best", "atomic_write", {}),  # the best model
        (
            ".",
            "append_line",
            {"test_manifest": None, "val_manifest": None},
        ),  # the first train_log.jsonl row
    ],
)
def test_a_run_folder_swapped_just_before_a_write_writes_nothing_outside(
    tmp_path: Path,
    base_config: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    directory: str,
    write: str,
    extra: dict[str, Any],
) -> None:
    """The trainer end to end: ``eval/``, ``checkpoints/``, ``best/`` or the run folder itself
    becomes a link outside between the check and the write. The run stops with an error
    naming the directory (it used to exit 0 with the file written outside)."""
    from clap_example.run_folder import RunFolderError

    out, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    swapped = out / directory if directory != "." else out

    def swap() -> None:
        if swapped.is_dir() and not swapped.is_symlink():
            swap_for_link(swapped, outside)

    from clap_example import durable

    original = getattr(durable, write)

    def swap_then_write(dir_fd: int, path: Path, *args: Any, **kwargs: Any) -> Any:
        if swapped in (path.parent, *path.parents[1:]) and not swapped.is_symlink():
            swap()
        return original(dir_fd, path, *args, **kwargs)

    monkeypatch.setattr(durable, write, swap_then_write)
    with pytest.raises(RunFolderError, match=rf"{swapped}[^ ]*: (replaced|a symbolic link)"):
        run(out, {**base_config, "loss": "infonce", "epochs": 1, **extra})
    assert files_under(outside) == {}


# --- reads of data: never a wait, always what it is ---------------------------------------------


def make_fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def make_socket(path: Path) -> Iterator[Path]:
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    try:
        yield path
    finally:
        server.close()


@pytest.fixture
def wav(tmp_path: Path) -> Path:
    path = tmp_path / "a.wav"
    sf.write(str(path), np.linspace(-0.5, 0.5, 1600, dtype=np.float32), 16000)
    return path


@pytest.fixture
def sock(tmp_path: Path) -> Iterator[Path]:
    yield from make_socket(tmp_path / "m.sock")


NOT_FILES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "fifo": (lambda tmp: make_fifo(tmp / "m.csv"), "a FIFO (named pipe)"),
    "device": (lambda tmp: Path(os.devnull), "a device"),
    "link to a device": (
        lambda tmp: (tmp / "z.csv").symlink_to("/dev/zero") or tmp / "z.csv",
        "a device",
    ),
    "directory": (lambda tmp: (tmp / "d.csv").mkdir() or tmp / "d.csv", "a directory"),
}


@pytest.mark.parametrize("case", list(NOT_FILES))
def test_a_manifest_that_is_not_a_regular_file_says_what_it_is(tmp_path: Path, case: str) -> None:
    from clap_example.data import ManifestError, read_manifest

    make, what = NOT_FILES[case]
    path = make(tmp_path)
    with pytest.raises(ManifestError, match=re.escape(f"manifest {path}: {what}, not a regular")):
        read_manifest(path, LANGS, check_files=False)


def test_a_manifest_that_is_a_socket_says_so(sock: Path) -> None:
    from clap_example.data import ManifestError, read_manifest

    with pytest.raises(ManifestError, match=rf"manifest {sock}: a socket, not a regular file"):
        read_manifest(sock, LANGS, check_files=False)


def test_a_missing_manifest_still_says_it_does_not_exist(tmp_path: Path) -> None:
    from clap_example.data import ManifestError, read_manifest

    with pytest.raises(ManifestError, match=rf"manifest {tmp_path / 'm.csv'} does not exist"):
        read_manifest(tmp_path / "m.csv", LANGS)


@pytest.mark.parametrize("case", list(NOT_FILES))
def test_a_config_that_is_not_a_regular_file_says_what_it_is(tmp_path: Path, case: str) -> None:
    """``--config`` is read from the descriptor it checked: a FIFO is an error, not a hang
    (nor "does not exist", as the old ``is_file()`` check said)."""
    from clap_example.config import load_config_file

    make, what = NOT_FILES[case]
    path = make(tmp_path)
    with pytest.raises(ValueError, match=re.escape(f"--config {path}: {what}, not a regular")):
        load_config_file(path)
    with pytest.raises(FileNotFoundError, match=re.escape(f"{tmp_path / 'no.json'} does not")):
        load_config_file(tmp_path / "no.json")
    (tmp_path / "ok.json").write_text('{"epochs": 2}')
    assert load_config_file(tmp_path / "ok.json") == {"epochs": 2}


def swap_after_open(monkeypatch: pytest.MonkeyPatch, swap: Callable[[Path], None]) -> list[Path]:
    """``swap(path)`` right after ``data`` opened and checked a file: the path becomes
    something else, the descriptor stays the file that was checked."""
    from clap_example import data

    original, swapped = data.open_regular, []

    def open_then_swap(path: Any, what: str) -> int:
        fd = original(path, what)
        swap(Path(path))
        swapped.append(Path(path))
        return fd

    monkeypatch.setattr(data, "open_regular", open_then_swap)
    return swapped


def to_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def test_a_manifest_swapped_for_a_fifo_after_the_check_is_read_from_what_was_checked(
    tmp_path: Path, wav: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from clap_example.data import read_manifest

    path = tmp_path / "m.csv"
    path.write_bytes(HEADER + b"a.wav,a,a dog,en\n")
    swapped = swap_after_open(monkeypatch, to_fifo)
    clips = read_manifest(path, LANGS)
    assert swapped == [path] and stat.S_ISFIFO(path.lstat().st_mode)
    assert [(c.audio_id, c.captions) for c in clips] == [("a", {"eng_Latn": ["a dog"]})]


def test_audio_swapped_for_a_fifo_after_the_check_is_decoded_from_what_was_checked(
    wav: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from clap_example.data import load_audio

    expected = load_audio(wav)
    swapped = swap_after_open(monkeypatch, to_fifo)
    assert np.array_equal(load_audio(wav), expected)  # no re-open of the path: no wait
    assert swapped == [wav]


@pytest.mark.parametrize("case", ["fifo", "device", "directory"])
def test_audio_that_is_not_a_regular_file_says_what_it_is(
    tmp_path: Path, wav: Path, case: str
) -> None:
    from clap_example.data import ManifestError, audio_problem, load_audio, read_manifest

    path, what = {
        "fifo": (tmp_path / "f.wav", "a FIFO (named pipe)"),
        "device": (Path(os.devnull), "a device"),
        "directory": (tmp_path / "d.wav", "a directory"),
    }[case]
    if case == "fifo":
        os.mkfifo(path)
    elif case == "directory":
        path.mkdir()
    with pytest.raises(ManifestError, match=re.escape(f"audio file {path}: {what}, not a regular")):
        load_audio(path)
    for decode in (True, False):
        assert f"{what}, not a regular file" in str(audio_problem(path, decode))
    manifest = tmp_path / "m.csv"
    manifest.write_bytes(HEADER + f"a.wav,a,a dog,en\n{path},b,a cat,en\n".encode())
    listed = re.escape(f"{path} (line 3): {what}")
    with pytest.raises(ManifestError, match=rf"{manifest}: 1 audio file.*{listed}"):
        read_manifest(manifest, LANGS)


def test_audio_that_is_a_socket_says_so(wav: Path, sock: Path) -> None:
    from clap_example.data import ManifestError, load_audio, read_manifest

    with pytest.raises(ManifestError, match=rf"audio file {sock}: a socket"):
        load_audio(sock)
    manifest = wav.parent / "m.csv"
    manifest.write_bytes(HEADER + f"a.wav,a,a dog,en\n{sock},b,a cat,en\n".encode())
    with pytest.raises(ManifestError, match=rf"{sock} \(line 3\): a socket"):
        read_manifest(manifest, LANGS)


def test_training_audio_that_becomes_a_fifo_is_an_error_naming_the_line(
    tmp_path: Path, base_config: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The clip is a file when the manifest is checked (``--check-audio off``) and a FIFO when
    the loader reads it: an error naming the manifest line and the FIFO, not a hang."""
    from clap_example import startup
    from clap_example.data import ManifestError

    read = startup.read_manifest
    fifo: list[Path] = []

    def read_then_swap(*args: Any, **kwargs: Any) -> Any:
        clips = read(*args, **kwargs)
        if not fifo:  # the training manifest
            data = tmp_path / clips[0].path.name
            data.write_bytes(clips[0].path.read_bytes())
            clips[0].path = data
            to_fifo(data)
            fifo.append(data)
        return clips

    monkeypatch.setattr(startup, "read_manifest", read_then_swap)
    cfg = {
        **base_config,
        "loss": "infonce",
        "epochs": 1,
        "test_manifest": None,
        "val_manifest": None,
    }
    with pytest.raises(ManifestError, match=r":\d+: audio file .*: a FIFO \(named pipe\)"):
        run(tmp_path / "run", cfg, check_audio="off")
    assert fifo


# --- long lines: bounded memory, the file and the line named --------------------------------------


def write_long_line(path: Path, size: int, jsonl: bool) -> None:
    """A manifest whose last row (line 2 of JSONL, 3 of CSV) holds ``size`` bytes of caption."""
    with path.open("wb") as f:
        if jsonl:
            row = {"audio_path": "a.wav", "audio_id": "a", "caption": "a dog", "language": "en"}
            f.write(json.dumps(row).encode() + b"\n")
            f.write(b'{"audio_path": "a.wav", "audio_id": "a", "language": "en", "caption": "')
        else:
            f.write(HEADER + b"a.wav,a,a dog,en\na.wav,a,")
        chunk = b"x" * (1 << 20)
        for _ in range(size >> 20):
            f.write(chunk)
        f.write(b'"}\n' if jsonl else b",en\n")


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_a_long_manifest_line_is_an_error_naming_the_line_in_bounded_memory(
    tmp_path: Path, suffix: str
) -> None:
    from clap_example.data import MAX_LINE_BYTES, ManifestError, read_manifest

    path = tmp_path / f"m{suffix}"
    size = 32 << 20  # 32 MiB; the read stops one byte past the 1 MiB cap, whatever the size
    write_long_line(path, size, jsonl=suffix == ".jsonl")
    tracemalloc.start()
    try:
        line = 2 if suffix == ".jsonl" else 3
        with pytest.raises(
            ManifestError, match=rf"{path}:{line}: a line longer than {MAX_LINE_BYTES}"
        ):
            read_manifest(path, LANGS, check_files=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * MAX_LINE_BYTES < size // 10, peak  # 2.1 MB measured


def test_a_line_at_the_cap_is_read(tmp_path: Path, wav: Path) -> None:
    from clap_example.data import MAX_LINE_BYTES, ManifestError, read_manifest

    path = tmp_path / "m.jsonl"
    row = {"audio_path": "a.wav", "audio_id": "a", "caption": "", "language": "en"}
    short = len(json.dumps(row)) + 1
    line = json.dumps({**row, "caption": "x" * (MAX_LINE_BYTES - short)}) + "\n"
    assert len(line) == MAX_LINE_BYTES
    path.write_text(line)
    # read whole: the field cap, not the line cap, refuses it
    with pytest.raises(ManifestError, match=rf"{path}: 1 bad row.*line 1: caption has"):
        read_manifest(path, LANGS)
    path.write_text(json.dumps({**row, "caption": "x" * (MAX_LINE_BYTES - short + 1)}) + "\n")
    with pytest.raises(ManifestError, match=rf"{path}:1: a line longer than"):
        read_manifest(path, LANGS)


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_a_manifest_larger_than_the_line_cap_is_read_whole(
    tmp_path: Path, wav: Path, suffix: str
) -> None:
    """The cap is per line (per CSV row), not per file: 3 MiB of short rows are all read."""
    from clap_example.data import MAX_LINE_BYTES, read_manifest

    path = tmp_path / f"m{suffix}"
    n = 3 * MAX_LINE_BYTES // 400
    caption = "a dog barks " * 30
    if suffix == ".csv":
        body = HEADER.decode() + "".join(f"a.wav,a,{caption}{i},en\n" for i in range(n))
    else:
        body = "".join(
            json.dumps(
                {
                    "audio_path": "a.wav",
                    "audio_id": "a",
                    "caption": f"{caption}{i}",
                    "language": "en",
                }
            )
            + "\n"
            for i in range(n)
        )
    path.write_text(body)
    assert len(body) > 2 * MAX_LINE_BYTES
    (clip,) = read_manifest(path, LANGS)
    assert len(clip.captions["eng_Latn"]) == n and clip.rows[-1] == n + (suffix == ".csv")


def test_a_csv_row_spread_over_many_lines_is_capped_too(tmp_path: Path) -> None:
    from clap_example.data import MAX_LINE_BYTES, ManifestError, read_manifest

    path = tmp_path / "m.csv"
    fields = b',"\n"' * (MAX_LINE_BYTES // 3)  # short lines, one endless row
    path.write_bytes(HEADER + b"a.wav,a,a dog,en" + fields + b"\n")
    with pytest.raises(ManifestError, match=rf"{path}:\d+: a CSV row longer than"):
        read_manifest(path, LANGS, check_files=False)


def test_a_memory_error_while_reading_a_manifest_names_the_file_and_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from clap_example import data

    path = tmp_path / "m.csv"
    path.write_bytes(HEADER + b"a.wav,a,a dog,en\na.wav,a,a cat,en\n")

    class Lines(data._ManifestLines):
        def __next__(self) -> str:
            line = super().__next__()
            if self.line_no == 3:
                raise MemoryError
            return line

    monkeypatch.setattr(data, "_ManifestLines", Lines)
    with pytest.raises(data.ManifestError, match=rf"{path}:3: out of memory"):
        data.read_manifest(path, LANGS, check_files=False)


def test_tensorboard_swapped_for_a_link_while_it_writes_sends_nothing_outside(
    tmp_path: Path, base_config: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """TensorBoard's writer opens its event files by path: it is given the descriptor of the
    directory that was checked (``/proc/self/fd/N``), so a ``tensorboard/`` swapped for a link
    after it started receives no event."""
    pytest.importorskip("tensorboard", reason="tensorboard (examples extra) not installed")
    from clap_example.board import ScalarBoard

    out, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    step = ScalarBoard.step

    def swap_then_step(self: ScalarBoard, row: dict[str, Any]) -> None:
        if not (out / "tensorboard").is_symlink():
            swap_for_link(out / "tensorboard", outside)
        step(self, row)

    monkeypatch.setattr(ScalarBoard, "step", swap_then_step)
    cfg = {**base_config, "loss": "infonce", "epochs": 1, "max_steps": 2, "tensorboard": True}
    run(out, cfg, test_manifest=None, val_manifest=None)
    assert files_under(outside) == {}
    assert list((out / "tensorboard.moved").glob("events.out.tfevents.*"))


# --- issue 40 item 5: bounded as a whole, changed while read, errors naming the path ---


class _FstatSays:
    """``os`` as ``config``/``data`` see it, except that ``fstat`` reports ``delta`` bytes
    off the real size: the file changed between the ``fstat`` and the read."""

    def __init__(self, delta: int) -> None:
        self.delta = delta

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def fstat(self, fd: int) -> os.stat_result:
        st = os.fstat(fd)
        fields = list(st)
        fields[stat.ST_SIZE] = max(0, st.st_size + self.delta)
        return os.stat_result(fields)


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
@pytest.mark.parametrize("delta", [-9, 9])
def test_a_config_that_changes_after_fstat_fails_loudly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str, delta: int
) -> None:
    """Grown (the read finds more than ``fstat`` said) or shrunk: an error naming the file,
    never a config parsed cut short (YAML dropped the later options silently)."""
    from clap_example import config

    path = tmp_path / f"run{suffix}"
    path.write_text('{"epochs": 2, "lr": 0.1}' if suffix == ".json" else "epochs: 2\nlr: 0.1\n")
    assert config.load_config_file(path) == {"epochs": 2, "lr": 0.1}
    monkeypatch.setattr(config, "os", _FstatSays(delta))
    with pytest.raises(ValueError, match=re.escape(f"--config {path}: changed while it was read")):
        config.load_config_file(path)


def _manifest(tmp_path: Path, rows: int, extra: str = "") -> Path:
    path = tmp_path / "m.csv"
    body = "".join(f"a{i}.wav,a{i},a caption {i},eng_Latn{extra}\n" for i in range(rows))
    path.write_bytes(HEADER + body.encode())
    return path


def test_a_manifest_is_bounded_in_rows_and_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``MAX_MANIFEST_ROWS`` rows an error names the file and the first line over;
    past ``MAX_MANIFEST_BYTES`` (by ``fstat``, and as read for a file still growing) an
    error names the file."""
    from clap_example import data

    path = _manifest(tmp_path, 5)
    assert len(data.read_manifest(path, LANGS, check_files=False)) == 5
    monkeypatch.setattr(data, "MAX_MANIFEST_ROWS", 3)
    with pytest.raises(data.ManifestError, match=re.escape(f"{path}:5: more than 3 rows")):
        data.read_manifest(path, LANGS, check_files=False)
    monkeypatch.setattr(data, "MAX_MANIFEST_ROWS", 10)
    size = path.stat().st_size
    monkeypatch.setattr(data, "MAX_MANIFEST_BYTES", size - 1)
    with pytest.raises(data.ManifestError, match=re.escape(f"{path}: {size} bytes, more than")):
        data.read_manifest(path, LANGS, check_files=False)
    monkeypatch.setattr(data, "os", _FstatSays(-40))  # it grew after fstat
    with pytest.raises(data.ManifestError, match=re.escape(f"{path}:6: the manifest passes")):
        data.read_manifest(path, LANGS, check_files=False)


def test_extra_manifest_fields_are_warned_about_and_not_kept(tmp_path: Path) -> None:
    """CSV fields beyond the header and JSON keys beyond the four columns: one warning
    naming the file, the first line and how many rows; the rows read the same."""
    from clap_example.data import read_manifest

    path = _manifest(tmp_path, 4, extra=",x" * 50)
    with pytest.warns(UserWarning, match=re.escape(f"{path}:2: fields other than")) as record:
        clips = read_manifest(path, LANGS, check_files=False)
    assert len(clips) == 4 and "in 4 row(s)" in str(record[0].message)
    jsonl = tmp_path / "m.jsonl"
    rows = [
        {"audio_path": "a.wav", "audio_id": "a", "caption": "c", "language": "eng_Latn"},
        {"audio_path": "b.wav", "audio_id": "b", "caption": "c", "language": "eng_Latn", "n": 1},
    ]
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(UserWarning, match=re.escape(f"{jsonl}:2: fields other than")) as record:
        assert len(read_manifest(jsonl, LANGS, check_files=False)) == 2
    assert "(n) in 1 row(s)" in str(record[0].message)


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux's /proc/self/mem")
def test_a_manifest_that_cannot_be_read_names_the_file(tmp_path: Path) -> None:
    """A manifest linked to ``/proc/self/mem`` (a regular file by ``fstat`` whose read
    fails with EIO): a ``ManifestError`` naming the manifest and the line, not a bare
    ``OSError``; ``--config`` likewise names its file."""
    from clap_example.config import load_config_file
    from clap_example.data import ManifestError, read_manifest

    link = tmp_path / "m.csv"
    link.symlink_to("/proc/self/mem")
    with pytest.raises(ManifestError, match=re.escape(f"{link}:1: cannot be read")):
        read_manifest(link, LANGS, check_files=False)
    config = tmp_path / "c.json"
    config.symlink_to("/proc/self/mem")
    try:
        load_config_file(config)
    except OSError as err:
        assert str(config) in str(err)
    except ValueError as err:  # (size 0 by fstat: read nothing, or "changed while read")
        assert str(config) in str(err)


@pytest.mark.parametrize("when", ["between check and write", "before the write"])
def test_a_directory_swapped_for_a_link_back_into_the_run_folder_is_refused(
    layout: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """``eval/`` moved aside to ``eval.moved/`` and a link ``eval -> eval.moved`` in its
    place: the same directory by identity, so the old test let one file through before
    the run stopped. Now refused by name, nothing published anywhere (issue 40 item 5)."""
    from clap_example.run_folder import RunFolder, RunFolderError

    root, _ = layout

    def swap_back() -> None:
        moved = root / "eval.moved"
        (root / "eval").rename(moved)
        (root / "eval").symlink_to(moved, target_is_directory=True)

    folder = RunFolder(root)
    if when == "before the write":
        folder.write_text(root / "eval" / "a.md", "first")
        swap_back()
        expected = rf"{root / 'eval'}: a symbolic link"
    else:
        swap_before(monkeypatch, "atomic_write", swap_back)
        expected = rf"{root / 'eval'}: replaced while a file"
    with pytest.raises(RunFolderError, match=expected):
        folder.write_text(root / "eval" / "b.md", "x")
    with pytest.raises(RunFolderError, match=rf"{root / 'eval'}: a symbolic link"):
        folder.torch_save({"a": 1}, root / "eval" / "c.pt")  # and every write after
    left = sorted(os.listdir(root / "eval.moved"))
    assert left == ([] if when == "between check and write" else ["a.md"])
