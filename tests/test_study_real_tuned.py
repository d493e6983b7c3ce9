"""Issue 47's machinery on generated data: every knob of the pretrained-encoder study's arms
reaches its constructor (``knobs.py``), and ``real_tuned.py``'s equal-budget search on
validation (``--tune``, resumable, no test-split evaluation) and its test seeds at the
chosen settings (``--from-tuned``)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))

import knobs
import real_towers
import real_tuned
from test_study_real_pretrained import _args as pretrained_args
from test_study_real_pretrained import _generated, rm, study

ARMS = real_tuned.ARMS


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> tuple:
    """The pretrained study's generated data at a tiny size; every global that
    ``configure()`` and ``knobs.apply`` write is restored after the test."""
    for name, value in {"MIN_GALLERY": 10, "BATCH": 32, "DIM": 16, "TEXT_HIDDEN": 8}.items():
        monkeypatch.setattr(rm, name, value)
    monkeypatch.setattr(study, "HIDDEN", 8)
    monkeypatch.setattr(study, "KNOBS", {})
    for name in ("AUDIO_SIDE", "TOWER", "LR", "HIDDEN", "DROPOUT", "SVR_BETA", "TEXT_HEAD",
                 "TEXT_STANDARDISE", "PRETRAIN_EPOCHS", "EVAL_EVERY", "LOSS_OPTIONS",
                 "TEXT_TRAINABLE", "TEXT_LR", "PROTOTYPES"):  # fmt: skip
        monkeypatch.setattr(rm, name, getattr(rm, name))
    monkeypatch.setattr(rm, "PROTOTYPES", 4)  # the generated bank is small
    monkeypatch.setitem(real_tuned.ASK_SPACE, "ask.prototypes", ("choice", (2, 4)))
    return _generated(monkeypatch)


def test_knobs_reach_the_constructors_and_configure_keeps_them(tiny, tmp_path) -> None:
    given = ["svr.alpha=0.1", "svr.beta=10", "svr.radius_init=0.02", "temperature=0.05",
             "learn_temperature=True", "ask.ot_weight=0.05", "ask.injection_ratio=0.03",
             "ask.k=3", "ask.prototypes=3", "ask.refresh=7", "lr=3e-4", "dropout=0.25",
             "text=adapter", "text_lr=0.5", "epochs=1"]  # fmt: skip
    args = pretrained_args(tmp_path, set=given, methods="random,svr_dynamic,ask", seeds=1)
    assert study.set_up(args)["svr.alpha"] == 0.1 and args.epochs == 1
    study.configure()  # what study() and probe() call again: the knobs stay
    svr = rm.make_loss("svr_dynamic", 0)
    assert (svr.alpha, svr.beta, svr.radius_init, svr.radius_mode) == (0.1, 10.0, 0.02, "dynamic")
    assert svr.base.learnable_temperature
    assert float(svr.base.temperature.detach()) == pytest.approx(0.05)
    assert rm.make_loss("svr_static", 0).radius_mode == "static"  # the arm's kind
    prep = rm.prepare(tiny[0], 0, 0.0)
    towers = rm.make_towers(prep)
    step = rm.Step("ask", prep, towers, 0)
    assert (step.ask.ot_weight, step.ask.injection_ratio, step.ask.k) == (0.05, 0.03, 3)
    assert step.ask.temperature == 0.05
    assert (step.bank.num_prototypes, step.bank.refresh_every) == (3, 7)
    assert isinstance(towers["text"], real_towers.TextBlock)  # text=adapter, every arm
    assert towers["audio"].drop.p == 0.25
    groups = rm.param_groups(towers, step)
    assert groups[0]["params"] and rm.LR == 3e-4 and groups[1]["lr"] == pytest.approx(1.5e-4)
    with pytest.raises(ValueError, match=r"svr\.alpah: not a knob"):
        knobs.parse(["svr.alpah=1"])
    with pytest.raises(ValueError, match=r"ask\.k=0\.5: expected int"):
        knobs.parse(["ask.k=0.5"])
    # a full run records each run's knobs (the defaults resolved) and the ones given
    out = tmp_path / "run"
    study.study(pretrained_args(out, set=given, methods="random,svr_dynamic", seeds=1,
                                other_seeds=1, epochs=3), tiny)  # fmt: skip
    saved = json.loads((out / "real_pretrained.json").read_text())
    assert saved["setup"]["set"]["svr.alpha"] == 0.1
    svr_run = next(r for r in saved["runs"] if r["method"] == "svr_dynamic")
    assert svr_run["settings"]["svr.alpha"] == 0.1 and svr_run["epochs"] == 1
    assert svr_run["settings"]["svr.direction"] == "bi"  # the library's default, resolved
    assert "svr.alpha" not in next(r for r in saved["runs"] if r["method"] == "random")["settings"]
    with pytest.raises(SystemExit, match="needs --out-dir"):
        study.study(pretrained_args(study.common.RESULTS, set=["svr.alpha=0.1"]), tiny)


def test_the_sampler_is_seeded_per_arm_and_stays_in_its_space() -> None:
    base = {"lr": 1e-3, "dropout": 0.4, "hidden": 8, "epochs": 2}
    first = real_tuned.sample("svr_dynamic", 12, 0, base, "adapter")
    assert first == real_tuned.sample("svr_dynamic", 12, 0, base, "adapter")
    assert first[:5] == real_tuned.sample("svr_dynamic", 5, 0, base, "adapter")  # a prefix
    assert first != real_tuned.sample("svr_dynamic", 12, 1, base, "adapter")
    assert first[0] == knobs.effective("svr_dynamic", {"text": "adapter"}, base)  # defaults
    space = real_tuned.space("svr_dynamic")
    for setting in first[1:]:
        for name, spec in space.items():
            if spec[0] == "choice":
                assert setting[name] in spec[1]
            else:  # rounded to 4 digits: within a rounding step of the bounds
                assert spec[1] * 0.999 <= setting[name] <= spec[2] * 1.001, (name, setting)
    lrs = [math.log10(s["lr"]) for s in first[1:]]
    assert max(lrs) - min(lrs) > 0.5  # spread over the decades, not one value
    assert "text_lr" not in real_tuned.space("kcl", "frozen")
    assert "learn_temperature" not in real_tuned.space("ask")


def _tune_args(out: Path, **kw) -> argparse.Namespace:
    base = dict(arms=",".join(ARMS), render=False, tune=True, from_tuned=None, out_dir=out,
                cache=out, trials=2, tune_seeds=1, base_seed=0, text="adapter", epochs=1,
                seeds=2, frozen_seeds=1, default_seeds=1, workers=1, device="cpu",
                shard="0/1", collect=False, manifests=None, whisper_dir=None,
                text_cache=None)  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def _no_test_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every evaluation of the test split raises."""

    def guard(fn):
        def wrapped(towers, prep, split="test", *a, **kw):
            if split == "test":
                raise AssertionError(f"{fn.__name__} read the test split during --tune")
            return fn(towers, prep, split, *a, **kw)

        return wrapped

    monkeypatch.setattr(rm, "evaluate", guard(rm.evaluate))
    monkeypatch.setattr(rm, "caption_alignment", guard(rm.caption_alignment))
    monkeypatch.setattr(
        rm, "evaluate_heldout_recordings", lambda *a, **k: pytest.fail("test split read")
    )
    monkeypatch.setattr(study, "references", lambda *a, **k: pytest.fail("test split read"))


def test_tune_gives_every_arm_the_same_trials_on_validation_only(tiny, tmp_path, monkeypatch):
    with monkeypatch.context() as m:
        _no_test_split(m)
        real_tuned.study(_tune_args(tmp_path), tiny)
        saved = json.loads((tmp_path / "real_tuned.json").read_text())
        tuning = saved["tuning"]
        assert tuning["trials"] == 2 and set(tuning["arms"]) == set(ARMS)
        for arm, t in tuning["arms"].items():
            space = {k: real_tuned.spec_json(v) for k, v in real_tuned.space(arm).items()}
            assert t["space"] == json.loads(json.dumps(space)) and t["n_trials"] == 2
            best = max(t["trials"], key=lambda x: (x["mean"], -x["trial"]))
            assert t["chosen"]["trial"] == best["trial"]
            assert (
                t["chosen"]["setting"] == best["setting"] and best["setting"]["text"] == "adapter"
            )
        svr = tuning["arms"]["svr_dynamic"]["trials"][1]["setting"]
        assert svr["svr.alpha"] != knobs.defaults("svr_dynamic", saved["setup"]["study"])[
            "svr.alpha"]  # fmt: skip
        # resumable: a third trial runs only the 7 new runs, the first two are read back
        calls = []
        real = rm.train_one
        m.setattr(rm, "train_one", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
        real_tuned.study(_tune_args(tmp_path, trials=3), tiny)
        assert sorted(calls) == sorted(ARMS)
        again = json.loads((tmp_path / "real_tuned.json").read_text())["tuning"]
        assert all(t["n_trials"] == 3 for t in again["arms"].values())
        assert again["arms"]["kcl"]["trials"][:2] == tuning["arms"]["kcl"]["trials"]
    # the chosen settings on test: tuned (adapter, frozen), and the defaults
    tuned = tmp_path / "tuned.json"
    tuned.write_text((tmp_path / "real_tuned.json").read_text())
    out = real_tuned.study(_tune_args(tmp_path, tune=False, from_tuned=tuned), tiny)
    runs = out["runs"]
    count = {v: sum(r["variant"] == v for r in runs) for v in
             ("tuned_text", "tuned_frozen", "default_text")}  # fmt: skip
    assert count == {"tuned_text": 2 * len(ARMS), "tuned_frozen": len(ARMS),
                     "default_text": len(ARMS)}  # fmt: skip
    chosen = again["arms"]["cacl"]["chosen"]["setting"]
    frozen = next(r for r in runs if r["variant"] == "tuned_frozen" and r["arm"] == "cacl")
    assert frozen["setting"] == chosen | {"text": "frozen"} and 0 <= frozen["t2a_R@1"] <= 1
    family = [c for c in out["contrasts"] if c["variant"] == "tuned_text"]
    assert {c["arm"] for c in family} == set(ARMS) - {"random"}
    assert all("survives_holm" in c for c in family)  # two seeds: tested
    assert set(out["cost"]) == {"tune", "test"}
    # an incomplete search is refused
    short = json.loads(tuned.read_text())
    short["tuning"]["arms"]["ask"]["n_trials"] = 1
    tuned.write_text(json.dumps(short))
    with pytest.raises(SystemExit, match=r"\['ask'\] is not complete"):
        real_tuned.study(_tune_args(tmp_path, tune=False, from_tuned=tuned), tiny)
