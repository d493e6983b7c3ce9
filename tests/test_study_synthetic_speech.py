"""The real-data study's synthetic speech: only training captions are read aloud (a
generated manifest and a fake synthesiser; eSpeak NG itself only where its wheel is)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

STUDIES = Path(__file__).resolve().parents[1] / "benchmarks" / "studies"
sys.path.insert(0, str(STUDIES))

import real_data  # noqa: E402
import synthetic_speech  # noqa: E402

SPLIT_OF = {"d0": "train", "d1": "train", "d2": "train", "d3": "val", "d4": "test"}


def _manifests(folder: Path) -> Path:
    """Five descriptions (three train, one val, one test), each recorded in two spoken
    languages and captioned in English, French, Russian and German; every caption names
    its description and split, so a leak is visible in the text."""
    folder.mkdir()
    rows: dict[str, list[str]] = {s: [] for s in real_data.SPLITS}
    for desc, split in SPLIT_OF.items():
        for spoken in ("fra_Latn", "rus_Cyrl"):
            for lang in ("eng_Latn", "fra_Latn", "rus_Cyrl", "deu_Latn"):
                row = {
                    "audio_path": f"/nowhere/{desc}_{spoken}.ogg",
                    "audio_id": f"{desc}_{spoken}",
                    "caption": f"{split} {desc} in {lang}.",
                    "language": lang,
                    "spoken_language": spoken,
                    "description_id": desc,
                }
                rows[split].append(json.dumps(row))
    for split, lines in rows.items():
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


class FakeSay:
    """Records what it is asked to say; a wave whose length follows the text's."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []

    def __call__(self, text: str, voice: str, rate: int, pitch: int) -> tuple[np.ndarray, int]:
        self.asked.append((text, voice))
        g = np.random.default_rng(len(self.asked))
        return (g.normal(0, 3000, 220 * len(text)).astype(np.int16), 22_050)


def test_only_training_captions_are_read_aloud(tmp_path) -> None:
    clips = real_data.read_manifests(_manifests(tmp_path / "manifests"))
    say, variants = FakeSay(), synthetic_speech.VARIANTS[:2]
    utterances, audio, frames = synthetic_speech.speech_features(
        clips, tmp_path / "cache", variants, say=say, progress=False
    )
    train = {d for d, s in SPLIT_OF.items() if s == "train"}
    assert {u.description for u in utterances} == train
    # French and Russian have voices, English and German do not: 3 descriptions x 2
    assert len(utterances) == 6 and {u.language for u in utterances} == {"fra_Latn", "rus_Cyrl"}
    spoken = {text for text, _ in say.asked}
    assert spoken == {f"train {d} in {lang}." for d in train for lang in ("fra_Latn", "rus_Cyrl")}
    assert not any(t.startswith(("val", "test")) for t in spoken)
    assert len(say.asked) == 6 * len(variants) and audio.shape == (6 * len(variants), 64, 256)
    assert {v for _, v in say.asked} == {
        voice + suffix for voice in ("fr", "ru") for suffix, _, _ in variants
    }
    assert bool((frames > 0).all()) and audio.dtype == torch.float16
    again = FakeSay()  # the second call reads the cache and says nothing
    _, cached, _ = synthetic_speech.speech_features(clips, tmp_path / "cache", say=again)
    assert again.asked == [] and torch.equal(cached, audio)
    # a third variant: only it is synthesised; rows stay utterance-major
    more = synthetic_speech.VARIANTS[:3]
    _, three, _ = synthetic_speech.speech_features(
        clips, tmp_path / "cache", more, say=again, progress=False
    )
    assert len(again.asked) == 6 and {v for _, v in again.asked} == {"fr+m3", "ru+m3"}
    assert torch.equal(three.reshape(6, 3, 64, 256)[:, :2], audio.reshape(6, 2, 64, 256))


def test_synthetic_clips_pair_with_their_descriptions_captions(tmp_path) -> None:
    clips = real_data.read_manifests(_manifests(tmp_path / "manifests"))
    data = real_data.build(
        clips,
        torch.zeros(len(clips), 64, 4),
        torch.zeros(len(clips)),
        lambda texts: torch.randn(len(texts), 8),
        languages=("eng_Latn", "fra_Latn", "rus_Cyrl", "deu_Latn"),
    )
    utterances, audio, frames = synthetic_speech.speech_features(
        clips, tmp_path / "cache", say=FakeSay(), progress=False
    )
    speech = synthetic_speech.as_real_data(utterances, audio, frames, data)
    v = len(audio) // len(utterances)
    for row in range(len(audio)):
        u = utterances[row // v]
        assert data.descriptions[int(speech.desc[row])] == u.description
        assert speech.spoken_languages[int(speech.spoken[row])] == u.language
    assert speech.text is data.text and (speech.split == 0).all() and not speech.gallery.any()
    assert torch.allclose(speech.seconds.exp(), frames * 0.01)
    with pytest.raises(ValueError, match="description ids"):
        synthetic_speech.as_real_data(utterances, audio, frames, real_data.synthetic())


def test_espeak_reads_a_caption_in_each_gallery_language() -> None:
    pytest.importorskip("espeakng_loader", reason="eSpeak NG's wheel: pip install espeakng-loader")
    say = synthetic_speech.Espeak()
    for voice in synthetic_speech.VOICES.values():
        wave, sr = say("Une grenouille.", voice, 175, 50)
        assert sr == 22_050 and wave.dtype == np.int16 and len(wave) > 0.2 * sr
    with pytest.raises(ValueError, match="voice"):
        say("x", "no-such-voice", 175, 50)
