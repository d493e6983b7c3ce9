"""Synthetic speech for the real-data study: eSpeak NG reading the *training* captions.

A pretraining set for the audio tower of ``real_multilingual.py`` (its ``PRETRAIN_EPOCHS``
lever): every distinct caption of a training-split description in each spoken language
of the galleries (``VOICES``), read by eSpeak NG in that language with each voice variant
of ``VARIANTS``, through the study's own front end (``real_data.sequences``: 16 kHz, 64
log-mel bands every 10 ms, silence trimmed, the first ``MAX_FRAMES`` frames). Only the
train split's descriptions are ever read aloud: the validation and test descriptions
(the evaluation's unseen descriptions) must stay unheard.

eSpeak NG comes from the ``espeakng-loader`` wheel (the library and its data, ~10 MB;
``pip install espeakng-loader``), driven through ``ctypes`` (its synchronous API:
``espeak_Initialize``, ``espeak_SetSynthCallback``, ``espeak_Synth``). The features are
cached (float16), one file per voice variant, under a key of the front end, the voice
and the texts; the waves are not kept. eSpeak NG's output varies by a few samples from
one call to the next (jitter inside the library that neither ``espeak_ng_SetRandSeed``
nor libc's ``srand`` fixes), so synthesis is not bit-reproducible: the cached features
are what a run used.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import real_data
import torch
from real_data import Clip, RealData
from torch import Tensor

#: Manifest language -> eSpeak NG voice, for the spoken languages of the galleries.
VOICES = {
    "fra_Latn": "fr",
    "spa_Latn": "es",
    "cat_Latn": "ca",
    "ron_Latn": "ro",
    "rus_Cyrl": "ru",
    "bul_Cyrl": "bg",
    "bel_Cyrl": "be",
    "ell_Grek": "el",
}
#: Voice variants: (eSpeak variant suffix, words per minute, pitch 0-100). The first is
#: eSpeak's default voice of the language, then a higher, slower "+f3", a faster, lower
#: "+m3" and a high "+f2" (the study uses the first ``PRETRAIN_VOICES``).
VARIANTS: tuple[tuple[str, int, int], ...] = (
    ("", 175, 50),
    ("+f3", 150, 70),
    ("+m3", 200, 35),
    ("+f2", 165, 85),
)

#: ``say(text, voice, rate, pitch) -> (wave, sample rate)``: one synthesised utterance.
Say = Callable[[str, str, int, int], tuple[np.ndarray, int]]


@dataclass(frozen=True)
class Utterance:
    """One caption to read: its description, manifest language and text."""

    description: str
    language: str
    text: str


def training_utterances(clips: Sequence[Clip], voices: dict[str, str] = VOICES) -> list[Utterance]:
    """Every distinct (description, language, caption) of the *train* split's clips in the
    languages of ``voices``, sorted; val and test clips are never read."""
    seen = {
        Utterance(c.description, lang, text)
        for c in clips
        if c.split == "train"
        for lang, text in c.captions.items()
        if lang in voices and text.strip()
    }
    return sorted(seen, key=lambda u: (u.language, u.description, u.text))


class Espeak:
    """eSpeak NG through ``ctypes`` (the ``espeakng-loader`` wheel's library and data).

    ``Espeak()(text, voice, rate, pitch) -> (int16 wave, sample rate)``; ``voice`` an
    eSpeak voice name ("fr", "fr+f3"). One instance per process (the library is global).
    """

    def __init__(self) -> None:
        try:
            import espeakng_loader
        except ImportError as e:  # lazily: only the pretraining lever needs it
            raise ImportError(
                "synthetic speech needs eSpeak NG: pip install espeakng-loader"
            ) from e
        self.lib = ctypes.CDLL(espeakng_loader.get_library_path())
        data = espeakng_loader.get_data_path().encode()
        self.rate = int(self.lib.espeak_Initialize(2, 0, data, 0))  # 2: synchronous
        if self.rate <= 0:
            raise RuntimeError(f"espeak_Initialize failed ({self.rate})")
        self.lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint]
        self.lib.espeak_Synth.argtypes += [ctypes.c_int, ctypes.c_uint, ctypes.c_uint]
        self.lib.espeak_Synth.argtypes += [ctypes.c_void_p, ctypes.c_void_p]
        self.chunks: list[np.ndarray] = []
        callback = ctypes.CFUNCTYPE(
            ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
        )
        self._callback = callback(self._collect)  # kept alive: the library holds it
        self.lib.espeak_SetSynthCallback(self._callback)

    def _collect(self, wave: Any, n: int, events: int) -> int:
        if n > 0:
            self.chunks.append(np.ctypeslib.as_array(wave, (n,)).copy())
        return 0  # continue

    def __call__(self, text: str, voice: str, rate: int, pitch: int) -> tuple[np.ndarray, int]:
        if self.lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise ValueError(f"voice: eSpeak NG has no voice {voice!r}")
        self.lib.espeak_SetParameter(1, rate, 0)  # espeakRATE, words per minute
        self.lib.espeak_SetParameter(3, pitch, 0)  # espeakPITCH, 0-100
        self.chunks.clear()
        raw = text.encode()
        status = self.lib.espeak_Synth(raw, len(raw) + 1, 0, 1, 0, 1, None, None)  # UTF-8
        if status != 0:
            raise RuntimeError(f"espeak_Synth failed ({status}) on {text!r}")
        wave = np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.int16)
        return wave, self.rate


def waves(
    utterances: Sequence[Utterance],
    variant: tuple[str, int, int],
    say: Say,
    voices: dict[str, str] = VOICES,
) -> Iterator[np.ndarray]:
    """16 kHz float32 waves of ``utterances`` read in one voice ``variant``; an utterance
    eSpeak gives (almost) no sound for becomes one window of faint noise, so that the rows
    stay aligned with ``utterances``."""
    suffix, rate, pitch = variant
    for u in utterances:
        wave, sr = say(u.text, voices[u.language] + suffix, rate, pitch)
        wave = wave.astype(np.float32) / 32768.0
        if len(wave) < real_data.N_FFT:
            wave = np.random.default_rng(0).normal(0, 1e-2, real_data.N_FFT)
        yield real_data.resample(wave, sr)


def cache_path(utterances: Sequence[Utterance], variant: tuple, cache: Path) -> Path:
    """The feature file of ``utterances`` read in ``variant`` under ``cache``."""
    front = [real_data.SAMPLE_RATE, real_data.N_FFT, real_data.HOP, real_data.MELS]
    front += [real_data.FMIN, real_data.FMAX, real_data.TRIM_DB, real_data.MAX_FRAMES]
    texts = [(u.description, u.language, u.text) for u in utterances]
    blob = json.dumps([front, sorted(VOICES.items()), list(variant), texts]).encode()
    return cache / f"espeak-{hashlib.sha256(blob).hexdigest()[:16]}.pt"


def variant_features(
    utterances: Sequence[Utterance],
    variant: tuple[str, int, int],
    cache: Path,
    say: Callable[[], Say],
    progress: bool = True,
) -> tuple[Tensor, Tensor]:
    """``utterances`` read in one ``variant``: ``(U, MELS, MAX_FRAMES)`` float16 frames and
    ``(U,)`` frame counts, cached under ``cache`` (``say()`` makes the synthesiser)."""
    path = cache_path(utterances, variant, cache)
    if path.is_file():
        saved = torch.load(path)
        return saved["audio"], saved["frames"]
    stream = waves(utterances, variant, say())
    audio, frames = real_data.sequences(stream, len(utterances), progress=progress)
    real_data.save_cache({"audio": audio, "frames": frames}, path)
    return audio, frames


def speech_features(
    clips: Sequence[Clip],
    cache: Path,
    variants: Sequence[tuple[str, int, int]] = VARIANTS[:2],
    say: Say | None = None,
    progress: bool = True,
) -> tuple[list[Utterance], Tensor, Tensor]:
    """The training captions read aloud: ``(utterances, (U * V, MELS, MAX_FRAMES) float16
    frames, (U * V,) frame counts)``, row ``u * V + v`` utterance ``u`` in variant ``v``;
    cached per variant under ``cache`` (``say`` defaults to one :class:`Espeak`, made
    only when a variant is not cached)."""
    utterances = training_utterances(clips)
    made: list[Say] = [say] if say is not None else []

    def synthesiser() -> Say:
        if not made:
            made.append(Espeak())
        return made[0]

    per_variant = [variant_features(utterances, v, cache, synthesiser, progress) for v in variants]
    audio = torch.stack([a for a, _ in per_variant], 1).flatten(0, 1)
    frames = torch.stack([f for _, f in per_variant], 1).flatten()
    return utterances, audio, frames


def as_real_data(
    utterances: Sequence[Utterance], audio: Tensor, frames: Tensor, data: RealData
) -> RealData:
    """The synthetic clips as a :class:`RealData` over ``data``'s descriptions and caption
    features (every clip in the train split, none in a gallery; ``spoken`` indexes the
    utterances' languages); each clip's captions are its description's captions in all of
    ``data``'s languages."""
    if not data.descriptions:
        raise ValueError("data: no description ids (build it with real_data.build)")
    index = {d: i for i, d in enumerate(data.descriptions)}
    repeat = len(audio) // max(len(utterances), 1)
    desc = torch.tensor([index[u.description] for u in utterances]).repeat_interleave(repeat)
    voices = sorted({u.language for u in utterances})
    spoken = [voices.index(u.language) for u in utterances]
    n = len(desc)
    return RealData(
        audio=audio,
        seconds=real_data.log_seconds(frames),
        text=data.text,
        present=data.present,
        desc=desc,
        spoken=torch.tensor(spoken).repeat_interleave(repeat),
        split=torch.zeros(n, dtype=torch.long),  # real_data.SPLITS[0]: "train"
        gallery=torch.zeros(n, dtype=torch.bool),
        twin=torch.arange(n),
        languages=data.languages,
        spoken_languages=voices,
        descriptions=data.descriptions,
    )
