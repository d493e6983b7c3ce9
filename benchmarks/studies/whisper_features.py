r"""Whisper base on every Tux Paint recording, computed once and kept on disk.

Two caches for ``real_pretrained.py``, both keyed by a hash of the model file (``model.bin``,
the ``whisper`` extra's wheels or a given folder), the clips' audio ids and the settings:

- :func:`encoder_states`: each recording at its own length (the whole file, 16 kHz mono,
  Whisper's log-mel, the positional table sliced to its ``ceil(T / 2)`` frames; see
  ``whisper_window.py`` for why not the padded 30-s window) through the torch encoder
  (``examples/clap_example/whisper.py``, float32). Kept per clip: the hidden states
  *entering the top block* (float16, packed: ``(sum of frames, d_model)`` and offsets), what
  a trainable top block starts from, and the final states' (top block + ``ln_post``, frozen)
  mean and max over the clip's frames, ``(N, 2 d_model)`` float32, what a head on the frozen
  encoder reads.
- :func:`transcripts`: the *cascade*'s input, no training: Whisper's own transcript of a
  clip (faster-whisper, CTranslate2 int8, the padded 30-s window Whisper was trained on,
  greedy, the spoken language given), one JSON line per clip, resumable.

Run once before the study (about 25 min for 7,421 clips on one core at own length; the
transcripts of the ~1,030 test gallery clips about 1-3 s each)::

    python benchmarks/studies/whisper_features.py --manifests data/tuxpaint --cache CACHE \
        --what states          # or: --what transcripts --split test
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import real_data  # noqa: E402
from real_data import Clip  # noqa: E402

#: The manifests' spoken languages -> Whisper's language codes (all nine are among its 99).
WHISPER_LANGUAGE = {
    "bel_Cyrl": "be", "bul_Cyrl": "bg", "cat_Latn": "ca", "dan_Latn": "da", "deu_Latn": "de",
    "ell_Grek": "el", "eng_Latn": "en", "fra_Latn": "fr", "ron_Latn": "ro", "rus_Cyrl": "ru",
    "spa_Latn": "es", "jpn_Jpan": "ja",
}  # fmt: skip
SHARD = 256  # clips per file written (a killed run resumes at the next shard)


def model_folder(given: Path | None) -> list[Path] | Path:
    """``given`` (a folder with ``model.bin`` or its parts), else the wheels' folders."""
    if given is not None:
        return given
    from clap_example.whisper import wheel_folders

    return wheel_folders()


def model_digest(source: list[Path] | Path) -> str:
    """SHA-256 of the model's bytes (``model.bin``, or its parts in order, as
    ``ct2_format.model_files`` finds them): part of every key."""
    from clap_example.ct2_format import model_files

    h = hashlib.sha256()
    for part in model_files(source):
        with part.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def clips_key(clips: Sequence[Clip], *parts: object) -> str:
    ids = "\n".join(c.audio_id for c in clips)
    return hashlib.sha256((repr(parts) + ids).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------- encoder states


@dataclass
class WhisperStates:
    """Every clip's Whisper states (see the module doc)."""

    states: Tensor  # (sum frames, d) float16: entering the top block
    offsets: Tensor  # (N + 1,) long: clip i's frames are states[offsets[i]:offsets[i + 1]]
    pooled: Tensor  # (N, 2 d) float32: mean and max of the frozen final states
    digest: str  # the cache file's key (model, clips, settings)

    def frames(self) -> Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def padded(
        self, clips: Tensor, max_frames: int, dtype: torch.dtype = torch.float32
    ) -> tuple[Tensor, Tensor]:
        """``(len(clips), max_frames, d)`` states (zero after each clip's frames, cut after
        ``max_frames``) and the ``(len(clips),)`` frame counts."""
        n = self.frames()[clips].clamp(max=max_frames)
        out = torch.zeros(len(clips), max_frames, self.states.shape[1], dtype=dtype)
        for row, (i, m) in enumerate(zip(clips.tolist(), n.tolist(), strict=True)):
            start = int(self.offsets[i])
            out[row, :m] = self.states[start : start + m].to(dtype)
        return out, n


@torch.no_grad()
def _encode_clip(encoder, front_end, wave: Tensor) -> tuple[Tensor, Tensor]:
    """One clip: ``(states entering the top block (T', d) float16, pooled (2 d,))``."""
    limit = 2 * encoder.dims.n_positions
    features, frames = front_end(wave[None], None, window="own")
    features, frames = features[..., :limit], frames.clamp(max=limit)
    x, key_mask = encoder.stem(features, frames)
    top = len(encoder.blocks) - 1
    x = encoder.blocks_between(x, key_mask, 0, top)[0]
    final = encoder.ln_post(encoder.blocks_between(x[None], key_mask, top, top + 1))[0]
    return x.half(), torch.cat([final.mean(0), final.amax(0)])


def encoder_states(
    clips: Sequence[Clip], cache: Path, source: list[Path] | Path, progress: bool = True
) -> WhisperStates:
    """The states of ``clips`` (cached in ``cache``; shards kept until the whole is saved)."""
    from clap_example.whisper import load_whisper_encoder
    from clap_example.whisper_mel import WhisperLogMel

    digest = model_digest(source)
    key = clips_key(clips, "own length, states entering the top block", digest)
    path = cache / f"whisper-states-{key}.pt"
    if path.is_file():
        saved = torch.load(path)
        return WhisperStates(saved["states"], saved["offsets"], saved["pooled"], key)
    encoder = load_whisper_encoder(source).eval()
    front_end = WhisperLogMel(encoder.dims.n_mels)
    shards = []
    start = time.perf_counter()
    for s in range(0, len(clips), SHARD):
        shard_path = cache / f"whisper-states-{key}.shard{s // SHARD:04d}.pt"
        if not shard_path.is_file():
            out = [
                _encode_clip(
                    encoder, front_end, torch.from_numpy(real_data.read_wave(c.audio_path))
                )
                for c in clips[s : s + SHARD]
            ]
            real_data.save_cache({"states": [o[0] for o in out], "pooled": [o[1] for o in out]},
                                 shard_path)  # fmt: skip
        shards.append(shard_path)
        if progress:
            done = min(s + SHARD, len(clips))
            print(f"whisper states {done}/{len(clips)} ({time.perf_counter() - start:.0f} s)",
                  flush=True)  # fmt: skip
    states, pooled = [], []
    for shard_path in shards:
        saved = torch.load(shard_path)
        states += saved["states"]
        pooled += saved["pooled"]
    lengths = torch.tensor([0] + [len(x) for x in states])
    result = WhisperStates(torch.cat(states), lengths.cumsum(0), torch.stack(pooled), key)
    real_data.save_cache(
        {"states": result.states, "offsets": result.offsets, "pooled": result.pooled}, path
    )
    for shard_path in shards:
        shard_path.unlink()
    return result


# ----------------------------------------------------------------------- transcripts


def transcripts(
    clips: Sequence[Clip], cache: Path, source: list[Path] | Path, progress: bool = True
) -> dict[str, str]:
    """audio id -> Whisper's transcript of each of ``clips`` (see the module doc); one JSON
    line per clip appended to the cache file as it is done."""
    digest = model_digest(source)
    path = cache / f"whisper-transcripts-{digest[:16]}.jsonl"
    done: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a killed writer
                continue
            done[row["audio_id"]] = row["text"]
    todo = [c for c in clips if c.audio_id not in done]
    if todo:
        from faster_whisper import WhisperModel

        folder = source if isinstance(source, Path) else _joined(source, cache, digest)
        model = WhisperModel(str(folder), device="cpu", compute_type="int8", cpu_threads=1)
        start = time.perf_counter()
        with path.open("a", encoding="utf-8") as f:
            for n, clip in enumerate(todo, 1):
                segments, _ = model.transcribe(
                    real_data.read_wave(clip.audio_path),
                    language=WHISPER_LANGUAGE[clip.spoken],
                    beam_size=1,
                    without_timestamps=True,
                    condition_on_previous_text=False,
                    vad_filter=False,
                )
                text = " ".join(s.text.strip() for s in segments).strip()
                done[clip.audio_id] = text
                f.write(json.dumps({"audio_id": clip.audio_id, "text": text}) + "\n")
                f.flush()
                if progress and n % 50 == 0:
                    print(f"transcripts {n}/{len(todo)} ({time.perf_counter() - start:.0f} s)",
                          flush=True)  # fmt: skip
    return {c.audio_id: done[c.audio_id] for c in clips}


def _joined(parts: list[Path], cache: Path, digest: str) -> Path:
    """A folder faster-whisper can open: the wheels' parts concatenated into ``model.bin``
    (once, in ``cache``) beside their config and vocabulary."""
    folder = cache / f"whisper-model-{digest[:16]}"
    if (folder / "model.bin").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for f in parts:
        for item in f.iterdir():
            if item.suffix == ".json":
                (folder / item.name).write_bytes(item.read_bytes())
    from clap_example.ct2_format import model_files

    with (folder / "model.bin.tmp").open("wb") as out:
        for part in model_files(parts):
            out.write(part.read_bytes())
    (folder / "model.bin.tmp").rename(folder / "model.bin")
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--manifests", type=Path, required=True)
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--whisper-dir", type=Path, help="default: the whisper extra's wheels")
    parser.add_argument("--what", choices=("states", "transcripts"), default="states")
    parser.add_argument("--split", default="test", help="transcripts: the gallery clips of it")
    parser.add_argument(
        "--shard", default="0/1", help="transcripts: i/n, every n-th clip from the i-th (processes)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    clips = real_data.read_manifests(args.manifests)
    source = model_folder(args.whisper_dir)
    if args.what == "states":
        encoder_states(clips, args.cache, source)
    else:
        index, count = (int(x) for x in args.shard.split("/"))
        chosen = [c for c in clips if c.split == args.split and c.in_gallery][index::count]
        transcripts(chosen, args.cache, source)


if __name__ == "__main__":
    main()
