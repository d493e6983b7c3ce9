"""Manifests, audio loading/resampling, sampling and the per-loss caption selection."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from clap_example.data import (
    EpochBatchSampler,
    ManifestError,
    TrainDataset,
    collate,
    eval_captions,
    load_audio,
    read_manifest,
    resample,
)

LANGS = ["eng_Latn", "fra_Latn", "deu_Latn"]


def write_csv(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def wav(tmp_path: Path) -> Path:
    path = tmp_path / "a.wav"
    sf.write(str(path), np.zeros(16000, dtype=np.float32), 16000)
    return path


def test_manifest_groups_captions_per_clip_and_accepts_aliases(tmp_path: Path, wav: Path) -> None:
    manifest = write_csv(tmp_path / "m.csv", [
        "audio_path,audio_id,caption,language",
        "a.wav,a,a dog,en",
        "a.wav,a,another dog,eng_Latn",
        "a.wav,a,un chien,fr",
    ])  # fmt: skip
    clips = read_manifest(manifest, LANGS)
    assert len(clips) == 1
    assert clips[0].captions == {"eng_Latn": ["a dog", "another dog"], "fra_Latn": ["un chien"]}
    assert clips[0].path == wav


def test_missing_audio_file_names_file_and_line(tmp_path: Path, wav: Path) -> None:
    manifest = write_csv(tmp_path / "m.csv", [
        "audio_path,audio_id,caption,language",
        "a.wav,a,a dog,en",
        "missing.wav,b,a cat,en",
    ])  # fmt: skip
    with pytest.raises(ManifestError, match=r"missing\.wav \(line 3\)"):
        read_manifest(manifest, LANGS)


def test_bad_rows_are_listed_with_line_numbers(tmp_path: Path, wav: Path) -> None:
    manifest = write_csv(tmp_path / "m.csv", [
        "audio_path,audio_id,caption,language",
        "a.wav,a,,en",
        "a.wav,a,ok,en",
        "other.wav,a,conflict,fr",
    ])  # fmt: skip
    with pytest.raises(
        ManifestError, match=r"line 2: empty or missing \['caption'\].*line 4: audio_id 'a'"
    ):
        read_manifest(manifest, LANGS)


def test_unknown_language_names_the_rows(tmp_path: Path, wav: Path) -> None:
    manifest = tmp_path / "m.jsonl"
    rows = [
        {"audio_path": "a.wav", "audio_id": "a", "caption": "a dog", "language": "en"},
        {"audio_path": "a.wav", "audio_id": "a", "caption": "犬", "language": "jpn_Jpan"},
    ]
    manifest.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows))
    with pytest.raises(ManifestError, match=r"'jpn_Jpan' on line\(s\) \[2\].*--languages"):
        read_manifest(manifest, LANGS)


def test_cacl_needs_english_and_another_language(tmp_path: Path, wav: Path) -> None:
    from clap_example.data import require_language, require_other_language

    manifest = write_csv(tmp_path / "m.csv", [
        "audio_path,audio_id,caption,language",
        "a.wav,a,a dog,en",
        "a.wav,b,un chien,fr",
    ])  # fmt: skip
    clips = read_manifest(manifest, LANGS)
    with pytest.raises(ManifestError, match=r"1 clip\(s\) have no eng_Latn caption.*b \(line 3\)"):
        require_language(clips, "eng_Latn", "CACL", str(manifest))
    with pytest.raises(ManifestError, match=r"only eng_Latn captions.*a \(line 2\)"):
        require_other_language(clips, "eng_Latn", str(manifest))


def test_missing_column_and_bad_json(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match=r"lacks column\(s\) \['language'\]"):
        read_manifest(
            write_csv(tmp_path / "m.csv", ["audio_path,audio_id,caption", "a.wav,a,x"]), LANGS
        )
    bad = tmp_path / "m.jsonl"
    bad.write_text('{"audio_path": "a.wav"}\nnot json\n')
    with pytest.raises(ManifestError, match=r"m\.jsonl:2: not valid JSON"):
        read_manifest(bad, LANGS)


def test_resample_keeps_a_sine_in_band() -> None:
    sr_in, freq = 44100, 1000.0
    t = np.arange(sr_in) / sr_in
    out = resample(np.sin(2 * np.pi * freq * t).astype(np.float32), sr_in, 16000)
    assert out.shape == (16000,) and out.dtype == np.float32
    ref = np.sin(2 * np.pi * freq * np.arange(16000) / 16000)
    inner = slice(200, -200)  # away from the filter's edge effects
    assert np.max(np.abs(out[inner] - ref[inner])) < 1e-2
    # A tone above the new Nyquist frequency is filtered out, not aliased.
    high = resample(np.sin(2 * np.pi * 12000 * t).astype(np.float32), sr_in, 16000)
    assert np.sqrt(np.mean(high[inner] ** 2)) < 1e-2


def test_load_audio_downmixes_resamples_and_crops(tmp_path: Path) -> None:
    path = tmp_path / "stereo.wav"
    sr = 22050
    left = np.random.default_rng(0).uniform(-0.5, 0.5, sr * 3).astype(np.float32)
    sf.write(str(path), np.stack([left, -left], axis=1), sr)
    full = load_audio(path)
    assert full.shape == (48000,) and np.abs(full).max() < 1e-4  # L + R cancel
    a = load_audio(path, max_seconds=1.0, rng=np.random.default_rng(5))
    b = load_audio(path, max_seconds=1.0, rng=np.random.default_rng(5))
    assert a.shape == (16000,) and np.array_equal(a, b)
    with pytest.raises(ManifestError, match="cannot read audio file"):
        bad = tmp_path / "bad.wav"
        bad.write_bytes(b"not audio")
        load_audio(bad)


def test_sampler_shards_cover_the_data_and_resume_mid_epoch() -> None:
    shards = [
        EpochBatchSampler(10, 2, seed=3, rank=r, world_size=2, drop_last=False) for r in (0, 1)
    ]
    for s in shards:
        s.set_epoch(1)
    seen = [i for s in shards for batch in s for i in batch]
    assert sorted(seen) == list(range(10))
    assert len(shards[0]) == len(shards[1]) == 3
    again = EpochBatchSampler(10, 2, seed=3, rank=0, world_size=2, drop_last=False)
    again.set_epoch(1, start_batch=1)
    assert list(again) == list(shards[0])[1:]
    other_epoch = EpochBatchSampler(10, 2, seed=3, rank=0, world_size=2, drop_last=False)
    other_epoch.set_epoch(2)
    assert list(other_epoch) != list(shards[0])
    dropped = EpochBatchSampler(10, 4, seed=3)
    assert [len(b) for b in dropped] == [4, 4]


def test_train_items_are_reproducible_and_collate_builds_the_mask(
    synthetic_data: dict[str, Path],
) -> None:
    clips = read_manifest(synthetic_data["train"], LANGS)
    ds = TrainDataset(clips, LANGS, max_seconds=1.5, seed=0)
    ds.set_epoch(2)
    first = ds[3]
    again = ds[3]
    assert torch.equal(first["audio"], again["audio"]) and first["captions"] == again["captions"]
    assert first["audio"].shape[0] <= 24000
    batch = collate([ds[i] for i in range(4)])
    assert batch["audio"].shape[0] == 4 and batch["mask"].shape == (4, 3)
    assert batch["mask"][3].tolist() == [True, True, False]  # every 4th clip lacks German
    assert batch["lengths"].tolist() == [
        item.shape[0] for item in (ds[i]["audio"] for i in range(4))
    ]


def test_eval_captions_are_dense_and_complete(synthetic_data: dict[str, Path]) -> None:
    clips = read_manifest(synthetic_data["test"], LANGS)
    texts, langs, c = eval_captions(clips, LANGS, "test")
    assert c == 2 and len(texts) == len(clips) * 3 * 2
    assert langs[:6] == ["eng_Latn"] * 2 + ["fra_Latn"] * 2 + ["deu_Latn"] * 2
    train = read_manifest(synthetic_data["train"], LANGS)
    expected = r"an evaluation \(validation or test\) manifest needs .* lacks deu_Latn"
    with pytest.raises(ManifestError, match=expected):
        eval_captions(train, LANGS, "train")
