"""Manifests of (audio file, audio id, caption, language) rows, audio loading and batching.

Manifest format -- CSV with a header, or JSON Lines, one caption per row::

    audio_path,audio_id,caption,language
    clips/Y7fmOlUlwoNg.wav,Y7fmOlUlwoNg,A dog barks while rain falls,eng_Latn
    clips/Y7fmOlUlwoNg.wav,Y7fmOlUlwoNg,Un chien aboie sous la pluie,fra_Latn

``audio_path`` is absolute or relative to the manifest's directory (or to ``audio_root``).
``language`` is an NLLB code (``fra_Latn``) or a short alias (``fr``, ``fra``). A clip may have
several captions per language (Clotho: 5) and may lack some languages (the KCL mask).

Randomness (crop offset, which caption of a language) is a pure function of
``(seed, epoch, clip index)``, so a run is reproducible whatever the number of loader workers
and resumes exactly mid-epoch.
"""

from __future__ import annotations

import csv
import math
import os
import stat
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, Sampler

from . import safe_json
from .ced import SAMPLE_RATE
from .descriptors import NotRegularFile, kind, open_regular
from .sonar import canonical_language

REQUIRED_COLUMNS = ("audio_path", "audio_id", "caption", "language")


class ManifestError(ValueError):
    """A manifest row or file is wrong; the message names the file and the rows."""


@dataclass
class Clip:
    audio_id: str
    path: Path
    captions: dict[str, list[str]] = field(default_factory=dict)
    rows: list[int] = field(default_factory=list)
    manifest: str = ""

    def where(self) -> str:
        """``manifest:line`` of the clip's first row, for error messages."""
        return f"{self.manifest}:{self.rows[0]}" if self.rows else self.manifest


#: Longest accepted manifest field (characters); longer ones are almost surely a broken row.
MAX_FIELD_CHARS = 4096
#: Longest accepted manifest line, or CSV row spread over several lines (bytes): four fields
#: of :data:`MAX_FIELD_CHARS` characters, escaped, fit many times over. Reading stops one byte
#: past it, so no line, however long, is held in memory whole.
MAX_LINE_BYTES = 1 << 20
#: Largest manifest (bytes, by ``fstat`` and as read) and most rows: each parsed row costs
#: about 2.5 KB of Python objects (a 299 MB manifest took 7.5 GB), so a manifest is bounded
#: as a whole, not only line by line; split a larger one (``--train-manifest`` takes one).
MAX_MANIFEST_BYTES = 1 << 28
MAX_MANIFEST_ROWS = 1_000_000
_BOM = b"\xef\xbb\xbf"


class _ManifestLines:
    """The manifest's lines, decoded one at a time from one descriptor (``O_NONBLOCK``,
    checked by ``fstat``); each line (and each CSV row) is capped at ``max_bytes``. UTF-8 with
    or without a BOM; a NUL byte, another encoding or too long a line is an error naming the
    file and the line."""

    def __init__(self, path: Path, file: BinaryIO, max_bytes: int = MAX_LINE_BYTES) -> None:
        self.path, self.file, self.max_bytes = path, file, max_bytes
        self.line_no = 0
        self.row_bytes = 0  # bytes of the CSV row being read (a quoted field spans lines)
        self.total_bytes = 0  # the whole file's, against MAX_MANIFEST_BYTES

    def __iter__(self) -> _ManifestLines:
        return self

    def row_done(self) -> None:
        self.row_bytes = 0

    def __next__(self) -> str:
        try:
            raw = self.file.readline(self.max_bytes + 1)
        except OSError as err:  # e.g. a link to /proc/self/mem: EIO, named here
            raise ManifestError(
                f"{self.path}:{self.line_no + 1}: cannot be read ({err.strerror or err})"
            ) from None
        if not raw:
            raise StopIteration
        self.line_no += 1
        self.row_bytes += len(raw)
        self.total_bytes += len(raw)
        where = f"{self.path}:{self.line_no}"
        if self.total_bytes > MAX_MANIFEST_BYTES:
            raise ManifestError(
                f"{where}: the manifest passes {MAX_MANIFEST_BYTES} bytes here (it grew after "
                "it was opened?); split it into smaller manifests"
            )
        if len(raw) > self.max_bytes:
            raise ManifestError(
                f"{where}: a line longer than {self.max_bytes} bytes (not read further; a "
                "manifest line is one caption row)"
            )
        if self.row_bytes > self.max_bytes:
            raise ManifestError(
                f"{where}: a CSV row longer than {self.max_bytes} bytes (a quoted field left open?)"
            )
        if self.line_no == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM) :]
        if b"\x00" in raw:
            raise ManifestError(f"{where}: NUL byte in the manifest")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ManifestError(
                f"{where}: not UTF-8 (byte 0x{raw[err.start]:02x}); save the manifest as UTF-8"
            ) from None


def _open_input(path: str | os.PathLike[str], what: str) -> int:
    """A descriptor of the manifest or audio file ``path``, opened once with ``O_NONBLOCK`` and
    checked by ``fstat`` (``descriptors.open_regular``): a FIFO, socket, device or directory is
    an error saying what it is, never a read or a decoder that waits for ever."""
    try:
        return open_regular(path, what)
    except FileNotFoundError:
        raise ManifestError(f"{what} {path} does not exist") from None
    except NotRegularFile as err:
        raise ManifestError(str(err)) from None
    except OSError as err:
        raise ManifestError(f"{what} {path}: cannot be opened ({err.strerror or err})") from None


def _read_rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, row)`` pairs; line numbers are 1-based as an editor shows them."""
    with os.fdopen(_open_input(path, "manifest"), "rb", buffering=1 << 16) as file:
        size = os.fstat(file.fileno()).st_size
        if size > MAX_MANIFEST_BYTES:
            raise ManifestError(
                f"{path}: {size} bytes, more than the {MAX_MANIFEST_BYTES} a manifest may hold "
                "(MAX_MANIFEST_BYTES); split it into smaller manifests"
            )
        lines = _ManifestLines(path, file)
        try:
            if path.suffix.lower() in (".jsonl", ".json", ".ndjson"):
                return _json_rows(path, lines)
            return _csv_rows(path, lines)
        except MemoryError:
            raise ManifestError(
                f"{path}:{lines.line_no}: out of memory reading the manifest at this line"
            ) from None


def _json_rows(path: Path, lines: _ManifestLines) -> list[tuple[int, dict[str, Any]]]:
    rows: list[tuple[int, dict[str, Any]]] = []
    extra = _ExtraFields(path)
    for line in lines:
        lines.row_done()  # a JSON row is one line
        if not line.strip():
            continue
        try:
            row = safe_json.loads(line, f"{path}:{lines.line_no}")
        except ValueError as err:
            raise ManifestError(str(err)) from None
        if not isinstance(row, dict):
            raise ManifestError(f"{path}:{lines.line_no}: expected a JSON object, got {row!r:.60}")
        _add_row(rows, path, lines.line_no, row, extra.note)
    extra.warn()
    return rows


def _csv_rows(path: Path, lines: _ManifestLines) -> list[tuple[int, dict[str, Any]]]:
    rows: list[tuple[int, dict[str, Any]]] = []
    reader = csv.DictReader(lines)
    try:
        if reader.fieldnames is None:
            raise ManifestError(
                f"{path}: empty file, expected a header {','.join(REQUIRED_COLUMNS)}"
            )
        missing = [c for c in REQUIRED_COLUMNS if c not in reader.fieldnames]
        if missing:
            raise ManifestError(
                f"{path}: header {reader.fieldnames} lacks column(s) {missing}; expected "
                f"{','.join(REQUIRED_COLUMNS)}"
            )
        lines.row_done()
        extra = _ExtraFields(path)
        for row in reader:
            _add_row(rows, path, reader.line_num, row, extra.note)
            lines.row_done()
    except csv.Error as err:
        raise ManifestError(f"{path}:{reader.line_num + 1}: unreadable CSV row ({err})") from err
    extra.warn()
    return rows


def _add_row(
    rows: list[tuple[int, dict[str, Any]]],
    path: Path,
    line_no: int,
    row: dict[Any, Any],
    note: Callable[[int, list[str]], None],
) -> None:
    """Keep the required columns of ``row`` (the rest noted, then dropped: not held);
    past :data:`MAX_MANIFEST_ROWS` an error naming the file and the line."""
    if len(rows) >= MAX_MANIFEST_ROWS:
        raise ManifestError(
            f"{path}:{line_no}: more than {MAX_MANIFEST_ROWS} rows (MAX_MANIFEST_ROWS); split "
            "the manifest into smaller ones"
        )
    others = [str(k) if k is not None else "(fields beyond the header)" for k in row]
    others = [k for k in others if k not in REQUIRED_COLUMNS]
    if others:
        note(line_no, others)
    rows.append((line_no, {c: row[c] for c in REQUIRED_COLUMNS if c in row}))


class _ExtraFields:
    """Rows with fields beyond :data:`REQUIRED_COLUMNS`: one warning per manifest, naming
    the first such line, what it held and how many rows had some."""

    def __init__(self, path: Path) -> None:
        self.path, self.first, self.count = path, None, 0
        self.what: list[str] = []

    def note(self, line_no: int, names: list[str]) -> None:
        self.count += 1
        if self.first is None:
            self.first, self.what = line_no, names[:5]

    def warn(self) -> None:
        if self.count:
            warnings.warn(
                f"{self.path}:{self.first}: fields other than {', '.join(REQUIRED_COLUMNS)} "
                f"({', '.join(self.what)}) in {self.count} row(s), ignored",
                stacklevel=4,
            )


def _field_problem(column: str, value: Any) -> str | None:
    if value is None or not str(value).strip():
        return None  # reported as empty
    if not isinstance(value, str):
        return f"{column} is a {type(value).__name__}, expected a string"
    if "\x00" in value:
        return f"NUL character in {column}"
    if len(value) > MAX_FIELD_CHARS:
        return f"{column} has {len(value)} characters (more than {MAX_FIELD_CHARS})"
    return None


def _not_a_file(path: Path) -> str | None:
    """Why ``path`` is not a regular file (``stat``, links followed: no open, no wait), or
    ``None``."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "not found"
    except OSError as err:  # e.g. ENAMETOOLONG
        return f"cannot be checked ({err.strerror or err})"
    return None if stat.S_ISREG(mode) else kind(mode)


def read_manifest(
    path: str | os.PathLike[str],
    languages: Sequence[str],
    audio_root: str | os.PathLike[str] | None = None,
    check_files: bool = True,
    contain: bool = False,
) -> list[Clip]:
    """Parse and validate a manifest; returns one :class:`Clip` per audio id, in file order.

    Raises :class:`ManifestError` naming the file and rows for: bytes that are not UTF-8 (a
    BOM is fine), NUL bytes, fields longer than :data:`MAX_FIELD_CHARS`, missing columns or
    fields, empty captions, languages outside ``languages``, an audio id bound to two files,
    (with ``contain``) audio paths resolving outside ``audio_root`` (or the manifest's
    directory), and (with ``check_files``) audio files that do not exist or are not regular
    files (a FIFO, socket or device, named). The manifest is opened once with ``O_NONBLOCK``
    and checked by ``fstat`` (a FIFO, socket, device or directory is an error saying what it
    is, never a wait), then streamed line by line, each line (and CSV row) capped at
    :data:`MAX_LINE_BYTES`: an over-long line is an error naming the file and the line after
    reading one byte past the cap, never a ``MemoryError``.
    """
    path = Path(path)
    rows = _read_rows(path)
    root = Path(audio_root) if audio_root is not None else path.parent
    resolved_root = root.resolve()
    wanted = [canonical_language(lang) for lang in languages]
    if not rows:
        raise ManifestError(f"{path}: no rows")
    clips: dict[str, Clip] = {}
    bad: list[str] = []
    unknown: dict[str, list[int]] = {}
    for line_no, row in rows:
        values = {c: row.get(c) for c in REQUIRED_COLUMNS}
        problems = [p for c, v in values.items() if (p := _field_problem(c, v)) is not None]
        if problems:
            bad.append(f"line {line_no}: " + "; ".join(problems))
            continue
        empty = [c for c, v in values.items() if v is None or not str(v).strip()]
        if empty:
            bad.append(f"line {line_no}: empty or missing {empty}")
            continue
        lang = canonical_language(str(values["language"]))
        if lang not in wanted:
            unknown.setdefault(str(values["language"]), []).append(line_no)
            continue
        audio_id = str(values["audio_id"]).strip()
        audio_path = Path(str(values["audio_path"]).strip())
        if not audio_path.is_absolute():
            audio_path = root / audio_path
        if contain and not audio_path.resolve().is_relative_to(resolved_root):
            bad.append(
                f"line {line_no}: audio_path {audio_path} resolves outside the audio root "
                f"{resolved_root} (--contain-audio-paths)"
            )
            continue
        clip = clips.setdefault(audio_id, Clip(audio_id, audio_path, manifest=str(path)))
        if clip.path != audio_path:
            bad.append(
                f"line {line_no}: audio_id {audio_id!r} points to {audio_path} but an earlier "
                f"row (line {clip.rows[0]}) points to {clip.path}"
            )
            continue
        clip.captions.setdefault(lang, []).append(str(values["caption"]).strip())
        clip.rows.append(line_no)
    if bad:
        raise ManifestError(f"{path}: {len(bad)} bad row(s): " + "; ".join(bad[:10]))
    if unknown:
        detail = "; ".join(
            f"{lang!r} on line(s) {lines[:5]}{'...' if len(lines) > 5 else ''}"
            for lang, lines in unknown.items()
        )
        raise ManifestError(
            f"{path}: language(s) not among the configured {wanted}: {detail} "
            "(add them to --languages or remove the rows)"
        )
    if check_files:
        missing = [
            (c.rows[0], c.path, why)
            for c in clips.values()
            if (why := _not_a_file(c.path)) is not None
        ]
        if missing:
            listed = "; ".join(f"{p} (line {line}): {why}" for line, p, why in missing[:10])
            raise ManifestError(
                f"{path}: {len(missing)} audio file(s) not found or not regular files: {listed}"
                f"{'...' if len(missing) > 10 else ''}"
            )
    return list(clips.values())


def require_language(
    clips: Sequence[Clip], language: str, why: str, manifest: str, fix: str = ""
) -> None:
    """Every clip must have a caption in ``language`` (e.g. English for CACL); ``fix`` says
    which option does without it."""
    lacking = [c for c in clips if language not in c.captions]
    if lacking:
        listed = ", ".join(f"{c.audio_id} (line {c.rows[0]})" for c in lacking[:10])
        raise ManifestError(
            f"{manifest}: {len(lacking)} clip(s) have no {language} caption, which {why} needs: "
            f"{listed}{'...' if len(lacking) > 10 else ''}{'; ' + fix if fix else ''}"
        )


def require_other_language(clips: Sequence[Clip], english: str, manifest: str) -> None:
    """Every clip must have a caption in some language besides English (CACL's other one)."""
    lacking = [c for c in clips if not any(lang != english for lang in c.captions)]
    if lacking:
        listed = ", ".join(f"{c.audio_id} (line {c.rows[0]})" for c in lacking[:10])
        raise ManifestError(
            f"{manifest}: {len(lacking)} clip(s) have only {english} captions; CACL pairs "
            f"English with another language: {listed}{'...' if len(lacking) > 10 else ''}"
        )


# --------------------------------------------------------------------------------------------
# Audio
# --------------------------------------------------------------------------------------------


def resample(wave: np.ndarray, orig_sr: int, target_sr: int = SAMPLE_RATE) -> np.ndarray:
    """Band-limited polyphase resampling (``scipy.signal.resample_poly``, Kaiser-windowed FIR)."""
    if orig_sr == target_sr:
        return wave
    try:
        from scipy.signal import resample_poly
    except ImportError as err:  # pragma: no cover - scipy is in the examples extra
        raise ImportError(
            "resampling needs scipy: pip install 'contrastive-losses[examples]'"
        ) from err
    g = math.gcd(int(orig_sr), int(target_sr))
    out = resample_poly(wave, target_sr // g, orig_sr // g, axis=0)
    return np.asarray(out, dtype=np.float32)


def _sf_reason(err: Exception) -> str:
    """libsndfile's reason, without its ``Error opening <descriptor>:`` prefix."""
    return str(getattr(err, "error_string", None) or err)


@contextmanager
def _sound_file(path: str | os.PathLike[str]) -> Iterator[Any]:
    """The audio file decoded from the one descriptor :func:`_open_input` opened and checked
    (never by re-opening the path)."""
    import soundfile as sf

    fd = _open_input(path, "audio file")
    try:
        try:
            sound = sf.SoundFile(fd, closefd=False)
        except Exception as err:  # soundfile raises LibsndfileError / RuntimeError variants
            raise ManifestError(f"cannot read audio file {path}: {_sf_reason(err)}") from err
        with sound:
            yield sound
    finally:
        os.close(fd)


def load_audio(
    path: str | os.PathLike[str],
    max_seconds: float | None = None,
    rng: np.random.Generator | None = None,
    target_sr: int = SAMPLE_RATE,
) -> np.ndarray:
    """Mono float32 waveform at ``target_sr``; longer than ``max_seconds`` -> a crop of that length.

    The crop starts at a uniform random offset drawn from ``rng`` (the start with ``rng=None``);
    only the cropped frames are read from disk. The file is opened once with ``O_NONBLOCK`` and
    must be a regular file (``fstat``); it is decoded from that descriptor.
    """
    with _sound_file(path) as sound:
        frames, samplerate = sound.frames, sound.samplerate
        start, stop = 0, frames
        if max_seconds is not None:
            crop = round(max_seconds * samplerate)
            if frames > crop:
                offset = int(rng.integers(0, frames - crop + 1)) if rng is not None else 0
                start, stop = offset, offset + crop
        try:
            sound.seek(start)
            wave = sound.read(stop - start, dtype="float32", always_2d=True)
        except Exception as err:
            raise ManifestError(f"cannot decode audio file {path}: {_sf_reason(err)}") from err
    if wave.shape[0] == 0:
        raise ManifestError(f"audio file {path} is empty")
    if not np.isfinite(wave).all():
        raise ManifestError(f"audio file {path} has non-finite (NaN/Inf) samples")
    mono = wave.mean(axis=1)
    out = resample(mono, int(samplerate), target_sr)
    if max_seconds is not None:
        out = out[: round(max_seconds * target_sr)]
    return np.ascontiguousarray(out, dtype=np.float32)


def audio_problem(path: Path, decode: bool = True) -> str | None:
    """Why ``path`` cannot be trained on, or ``None``: missing, not a regular file (a FIFO,
    socket or device, named), unreadable, empty, and (``decode``) undecodable, shorter than
    its header says, or holding NaN/Inf samples. Decoded from one descriptor, as
    :func:`load_audio` does."""
    try:
        with _sound_file(path) as sound:
            if sound.frames <= 0:
                return "no audio frames"
            if not decode:
                return None
            return _decode_problem(sound)
    except ManifestError as err:
        return str(err).replace(f" {path}", "", 1)


def _decode_problem(sound: Any) -> str | None:
    frames = 0
    try:
        for block in sound.blocks(blocksize=1 << 16, dtype="float32", always_2d=True):
            if not np.isfinite(block).all():
                return f"non-finite (NaN/Inf) samples near frame {frames}"
            frames += block.shape[0]
    except Exception as err:
        return f"cannot decode after frame {frames} ({_sf_reason(err)})"
    if frames < sound.frames:
        return f"truncated: the header says {sound.frames} frames, {frames} decoded"
    return None


class _AudioCheck(Dataset[str | None]):
    def __init__(self, clips: Sequence[Clip], decode: bool) -> None:
        self.clips, self.decode = list(clips), decode

    def __len__(self) -> int:
        return len(self.clips)

    def __getitem__(self, index: int) -> str | None:
        clip = self.clips[index]
        problem = audio_problem(clip.path, self.decode)
        return None if problem is None else f"{clip.where()}: {clip.path}: {problem}"


def _first(items: list[Any]) -> Any:
    return items[0]


def check_audio(clips: Sequence[Clip], decode: bool = True, workers: int = 0) -> list[str]:
    """Problems of the clips' audio files (``manifest:line: path: why``), read in parallel by
    ``workers`` DataLoader processes (see :func:`audio_problem`)."""
    from torch.utils.data import DataLoader

    loader = DataLoader(
        _AudioCheck(clips, decode), batch_size=1, num_workers=workers, collate_fn=_first
    )
    return [problem for problem in loader if problem is not None]


# --------------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------------


def _load_clip(clip: Clip, max_seconds: float | None, rng: np.random.Generator | None) -> Any:
    try:
        return load_audio(clip.path, max_seconds, rng)
    except ManifestError as err:
        raise ManifestError(f"{clip.where()}: {err}") from err


class TrainDataset(Dataset[dict[str, Any]]):
    """One item per clip: a random crop and, per language, one of its captions (or ``None``)."""

    def __init__(
        self,
        clips: Sequence[Clip],
        languages: Sequence[str],
        max_seconds: float = 10.0,
        seed: int = 0,
    ) -> None:
        self.clips = list(clips)
        self.languages = [canonical_language(lang) for lang in languages]
        self.max_seconds = max_seconds
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.clips)

    def __getitem__(self, index: int) -> dict[str, Any]:
        clip = self.clips[index]
        rng = np.random.default_rng([self.seed, self.epoch, index])
        wave = _load_clip(clip, self.max_seconds, rng)
        captions: list[str | None] = []
        for lang in self.languages:
            options = clip.captions.get(lang)
            captions.append(None if not options else options[int(rng.integers(len(options)))])
        return {"audio": torch.from_numpy(wave), "captions": captions, "index": index}


class AudioOnlyDataset(Dataset[dict[str, Any]]):
    """Whole clips (no crop unless ``max_seconds``) for evaluation and knowledge banks."""

    def __init__(self, clips: Sequence[Clip], max_seconds: float | None = None) -> None:
        self.clips = list(clips)
        self.max_seconds = max_seconds

    def __len__(self) -> int:
        return len(self.clips)

    def __getitem__(self, index: int) -> dict[str, Any]:
        wave = _load_clip(self.clips[index], self.max_seconds, None)
        return {"audio": torch.from_numpy(wave), "captions": [], "index": index}


def collate(items: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Pad waveforms to the longest; keep captions as a ``(B, K)`` list of lists and the mask.

    Returns ``audio (B, S)``, ``lengths (B,)``, ``captions`` (B lists of K ``str | None``),
    ``mask (B, K)`` bool (caption present) and ``index (B,)`` dataset indices (clip ids).
    """
    lengths = torch.tensor([item["audio"].shape[0] for item in items], dtype=torch.long)
    audio = torch.zeros(len(items), int(lengths.max()))
    for i, item in enumerate(items):
        audio[i, : item["audio"].shape[0]] = item["audio"]
    captions = [list(item["captions"]) for item in items]
    k = len(captions[0]) if captions else 0
    mask = torch.tensor([[c is not None for c in row] for row in captions], dtype=torch.bool)
    return {
        "audio": audio,
        "lengths": lengths,
        "captions": captions,
        "mask": mask.reshape(len(items), k),
        "index": torch.tensor([item["index"] for item in items], dtype=torch.long),
    }


class EpochBatchSampler(Sampler[list[int]]):
    """Shuffled batches of one rank's shard; the order is a function of ``(seed, epoch)``.

    Like ``DistributedSampler``: the permutation is padded by wrapping around to a multiple of
    ``world_size`` and rank ``r`` takes every ``world_size``-th index from ``r``, so every rank has
    the same number of batches. ``drop_last`` drops the incomplete last batch (contrastive losses
    want full batches). ``start_batch`` skips batches already done (exact resume).
    """

    def __init__(
        self,
        num_items: int,
        batch_size: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size: expected >= 1, got {batch_size}")
        self.num_items = num_items
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.start_batch = 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch = epoch
        self.start_batch = start_batch

    def _shard(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(self.num_items, generator=g).tolist()
        else:
            order = list(range(self.num_items))
        per_rank = math.ceil(self.num_items / self.world_size)
        total = per_rank * self.world_size
        order = (order * math.ceil(total / max(len(order), 1)))[:total]
        return order[self.rank : total : self.world_size]

    def batches(self) -> list[list[int]]:
        shard = self._shard()
        out = [shard[i : i + self.batch_size] for i in range(0, len(shard), self.batch_size)]
        if self.drop_last and out and len(out[-1]) < self.batch_size:
            out.pop()
        return out

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.batches()[self.start_batch :]

    def __len__(self) -> int:
        return max(len(self.batches()) - self.start_batch, 0)


# --------------------------------------------------------------------------------------------
# Choosing which captions a loss sees
# --------------------------------------------------------------------------------------------


def random_present(mask: Tensor, generator: torch.Generator) -> Tensor:
    """One present language per row of ``mask (B, K)``, uniformly (the ML-CLAP baseline)."""
    if not bool(mask.any(dim=1).all()):
        raise ValueError("mask: a sample has no caption at all")
    return torch.multinomial(mask.float(), 1, generator=generator).squeeze(1)


def pick(captions: Sequence[Sequence[str | None]], column: Tensor) -> list[str]:
    """``captions[i][column[i]]`` for every row (all must be present)."""
    out = []
    for i, k in enumerate(column.tolist()):
        text = captions[i][k]
        if text is None:
            raise ValueError(f"captions: sample {i} has no caption in language column {k}")
        out.append(text)
    return out


def eval_captions(
    clips: Sequence[Clip], languages: Sequence[str], manifest: str
) -> tuple[list[str], list[str], int]:
    """Flatten an evaluation manifest's captions to ``(N, K, C)`` order: returns texts,
    their languages, and C.

    ``C`` is the smallest number of captions any clip has in any language; clips with more are
    truncated to ``C`` (the metrics need a dense ``(N, K, C, D)``). A clip missing a language
    is an error naming it.
    """
    langs = [canonical_language(lang) for lang in languages]
    lacking = [(c, lang) for c in clips for lang in langs if not c.captions.get(lang)]
    if lacking:
        listed = ", ".join(f"{c.audio_id} lacks {lang}" for c, lang in lacking[:10])
        shared = [lang for lang in langs if all(c.captions.get(lang) for c in clips)]
        fix = (
            f"; to evaluate the languages every clip has, pass --languages {','.join(shared)}"
            if shared
            else ""
        )
        raise ManifestError(
            f"{manifest}: an evaluation (validation or test) manifest needs a caption in "
            f"every language of --languages ({','.join(langs)}) for every clip: "
            f"{listed}{'...' if len(lacking) > 10 else ''}{fix}"
        )
    c = min(len(clip.captions[lang]) for clip in clips for lang in langs)
    texts: list[str] = []
    text_langs: list[str] = []
    for clip in clips:
        for lang in langs:
            texts.extend(clip.captions[lang][:c])
            text_langs.extend([lang] * c)
    return texts, text_langs, c
