"""End-to-end runs of ``examples/finetune_ced_sonar.py`` on synthetic data with tiny models."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from clap_example.train import main

import contrastive_losses as cl

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
REPO = EXAMPLES.parent

needs_svr = pytest.mark.skipif(
    not hasattr(cl, "SupportVectorRegularizer"), reason="needs SupportVectorRegularizer (issue 3)"
)


needs_ask = pytest.mark.skipif(
    not (hasattr(cl, "ASKLoss") and hasattr(cl, "KnowledgeBank")),
    reason="needs ASKLoss and KnowledgeBank (issue 4)",
)


def _has_metrics() -> bool:
    try:
        from contrastive_losses.metrics import retrieval_report  # noqa: F401
    except ImportError:
        return False
    return True


needs_metrics = pytest.mark.skipif(
    not _has_metrics(), reason="needs metrics.retrieval_report (issue 5)"
)


def run(tmp_path: Path, base: dict[str, Any], name: str, **overrides: Any) -> dict[str, Any]:
    values = {**base, "output_dir": str(tmp_path / name), **overrides}
    values = {k: v for k, v in values.items() if v is not None}
    config = tmp_path / f"{name}.json"
    config.write_text(json.dumps(values))
    return main(["--config", str(config)])


def steps(out: Path) -> list[dict[str, Any]]:
    with (out / "train_log.jsonl").open() as f:
        return [json.loads(line) for line in f]


# --- every loss x a couple of SVR modes ----------------------------------------------------------

CASES = [
    pytest.param("infonce", "none", "bi", id="infonce"),
    pytest.param("siglip", "none", "bi", id="siglip"),
    pytest.param("mlclap", "none", "bi", id="mlclap"),
    pytest.param("kcl", "none", "bi", id="kcl"),
    pytest.param("infonce_all", "none", "bi", id="infonce_all"),
    pytest.param("cacl", "none", "bi", id="cacl"),
    pytest.param("ask", "none", "bi", id="ask", marks=needs_ask),
    pytest.param("infonce", "static", "bi", id="infonce-svr-static", marks=needs_svr),
    pytest.param("siglip", "dynamic", "uni", id="siglip-svr-dynamic-uni", marks=needs_svr),
    pytest.param("mlclap", "dynamic", "bi", id="mlclap-svr-dynamic", marks=needs_svr),
    pytest.param("kcl", "static", "uni", id="kcl-svr-static-uni", marks=needs_svr),
    pytest.param("kcl", "dynamic", "bi", id="kcl-svr-dynamic", marks=needs_svr),
    pytest.param("infonce_all", "static", "bi", id="infonce_all-svr-static", marks=needs_svr),
    pytest.param("cacl", "static", "bi", id="cacl-svr-static", marks=needs_svr),
]


@pytest.mark.parametrize(("loss", "svr", "direction"), CASES)
def test_every_loss_and_svr_mode_trains(
    tmp_path: Path, base_config: dict[str, Any], loss: str, svr: str, direction: str
) -> None:
    extra: dict[str, Any] = (
        {"ask_k": 3, "ask_prototypes": 4, "ask_k_coarse": 2} if loss == "ask" else {}
    )
    result = run(
        tmp_path,
        base_config,
        "run",
        loss=loss,
        svr=svr,
        svr_direction=direction,
        max_steps=2,
        test_manifest=None,
        val_manifest=None,
        **extra,
    )
    out = tmp_path / "run"
    rows = steps(out)
    assert [r["step"] for r in rows] == [1, 2] and result["step"] == 2
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    assert any(k.startswith("terms/") for k in rows[0])
    if svr != "none":
        assert any("radius" in k for k in rows[0]), sorted(rows[0])
    assert (out / "checkpoints" / "latest").is_file()
    header = (out / "train_log.csv").read_text().splitlines()[0].split(",")
    assert header[:4] == ["step", "epoch", "batch", "loss"]


# --- learning, evaluation, checkpoints ------------------------------------------------------------


def test_two_epochs_loss_falls(tmp_path: Path, base_config: dict[str, Any]) -> None:
    result = run(
        tmp_path,
        base_config,
        "fit",
        loss="kcl",
        epochs=2,
        test_manifest=None,
        val_manifest=None,
        plots=True,
    )
    history = result["history"]
    assert [h["epoch"] for h in history] == [1, 2]
    assert history[1]["train_loss"] < history[0]["train_loss"]
    assert (tmp_path / "fit" / "plots" / "loss.png").is_file()


@needs_metrics
def test_evaluation_reports_r1_per_language_and_keeps_the_best(
    tmp_path: Path, base_config: dict[str, Any]
) -> None:
    result = run(tmp_path, base_config, "eval", loss="kcl", epochs=2, plots=True)
    out = tmp_path / "eval"
    epochs = [json.loads(line) for line in (out / "epoch_log.jsonl").read_text().splitlines()]
    assert len(epochs) == 2
    metrics = epochs[-1]["metrics"]
    for lang in ("eng_Latn", "fra_Latn", "deu_Latn"):
        assert any(lang in k and ("R@1" in k or "r1" in k.lower()) for k in metrics), sorted(
            metrics
        )[:20]
    assert result["best"] is not None
    assert (out / "best" / "state.pt").is_file() and (out / "best" / "metrics.json").is_file()
    assert (out / "plots" / "retrieval_r1.png").is_file()


@pytest.mark.parametrize("loss", ["kcl", "mlclap"])
def test_resume_reproduces_the_following_steps(
    tmp_path: Path, base_config: dict[str, Any], loss: str
) -> None:
    """Stop after step 3 (mid-epoch), resume: steps 4..8 match the uninterrupted run exactly.

    Dropout is on, so the RNG states are part of what the checkpoint must restore.
    """
    noisy = {
        **base_config,
        "loss": loss,
        "epochs": 2,
        "test_manifest": None,
        "val_manifest": None,
        "ced_config": {**base_config["ced_config"], "drop_rate": 0.1},
        "sonar_config": {"dropout": 0.1, "activation_dropout": 0.1},
        "save_every_steps": 1,
        "keep_checkpoints": 20,
    }
    run(tmp_path, noisy, "full")
    full = steps(tmp_path / "full")
    assert len(full) == 8
    run(tmp_path, noisy, "resumed", resume=str(tmp_path / "full" / "checkpoints" / "step-00000003"))
    resumed = steps(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert resumed[:3] == full[:3]  # a new folder: rows 1-3 recreated from the checkpoint
    for a, b in zip(full[3:], resumed[3:], strict=True):
        assert a["loss"] == b["loss"], (a["step"], a["loss"], b["loss"])
        assert a["grad_norm"] == b["grad_norm"]
        assert a["lr"] == b["lr"]


@needs_ask
def test_ask_bank_is_refreshed_and_restored_on_resume(
    tmp_path: Path, base_config: dict[str, Any]
) -> None:
    """Bank built before epoch 1, refreshed before epoch 2; a resume in epoch 2 restores the
    refreshed bank from the checkpoint (the following losses match exactly)."""
    import torch

    values = {
        **base_config,
        "loss": "ask",
        "ask_k": 3,
        "ask_prototypes": 4,
        "ask_k_coarse": 2,
        "ask_refresh_every": 1,
        "ask_backend": "torch",
        "pair_language": "random",
        "epochs": 2,
        "test_manifest": None,
        "val_manifest": None,
        "save_every_steps": 1,
        "keep_checkpoints": 20,
    }
    run(tmp_path, values, "full")
    checkpoints = tmp_path / "full" / "checkpoints"
    first = torch.load(checkpoints / "step-00000004" / "state.pt", weights_only=True)
    second = torch.load(checkpoints / "step-00000005" / "state.pt", weights_only=True)
    assert first["bank_epoch"] == 0 and second["bank_epoch"] == 1
    assert not torch.equal(first["bank"]["audio"], second["bank"]["audio"])  # re-encoded
    run(tmp_path, values, "resumed", resume=str(checkpoints / "step-00000005"))
    full, resumed = steps(tmp_path / "full"), steps(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert resumed[:5] == full[:5]  # a new folder: rows 1-5 recreated from the checkpoint
    for a, b in zip(full[5:], resumed[5:], strict=True):
        assert a["loss"] == b["loss"]


def test_resume_auto_continues_in_the_output_dir(
    tmp_path: Path, base_config: dict[str, Any]
) -> None:
    run(
        tmp_path,
        base_config,
        "auto",
        loss="infonce",
        epochs=1,
        max_steps=2,
        test_manifest=None,
        val_manifest=None,
    )
    result = run(
        tmp_path,
        base_config,
        "auto",
        loss="infonce",
        epochs=2,
        resume="auto",
        test_manifest=None,
        val_manifest=None,
    )
    assert result["step"] == 8
    assert [r["step"] for r in steps(tmp_path / "auto")] == list(range(1, 9))


def test_grad_cache_run_matches_the_plain_run(tmp_path: Path, base_config: dict[str, Any]) -> None:
    run(
        tmp_path,
        base_config,
        "plain",
        loss="kcl",
        max_steps=3,
        test_manifest=None,
        val_manifest=None,
    )
    run(
        tmp_path,
        base_config,
        "cached",
        loss="kcl",
        max_steps=3,
        test_manifest=None,
        val_manifest=None,
        grad_cache=True,
        grad_cache_chunk=4,  # one audio chunk (the CED batch-norm sees the batch), 3 of text
    )
    for a, b in zip(steps(tmp_path / "plain"), steps(tmp_path / "cached"), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_loss_chunk_size_run_matches_the_dense_run(
    tmp_path: Path, base_config: dict[str, Any]
) -> None:
    """--loss-chunk-size tiles the loss (exact): the same losses and gradient norms, with
    KCL's masked captions and SVR's dynamic radius on top."""
    common = {
        "loss": "kcl",
        "svr": "dynamic",
        "max_steps": 3,
        "test_manifest": None,
        "val_manifest": None,
    }
    run(tmp_path, base_config, "dense", **common)
    run(tmp_path, base_config, "tiled", loss_chunk_size=2, **common)
    for a, b in zip(steps(tmp_path / "dense"), steps(tmp_path / "tiled"), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_bf16_autocast_runs(tmp_path: Path, base_config: dict[str, Any]) -> None:
    """The AMP path (bf16 autocast, float32 front end and loss) on CPU."""
    run(
        tmp_path,
        base_config,
        "amp",
        loss="cacl",
        amp="bf16",
        max_steps=2,
        test_manifest=None,
        val_manifest=None,
    )
    assert all(math.isfinite(r["loss"]) for r in steps(tmp_path / "amp"))


def test_learning_rate_schedules(tmp_path: Path, base_config: dict[str, Any]) -> None:
    common = {
        "loss": "infonce",
        "epochs": 2,
        "test_manifest": None,
        "val_manifest": None,
        "lr": 0.01,
    }
    run(tmp_path, base_config, "step", schedule="step", step_epochs=1, step_gamma=0.5, **common)
    lrs = [r["lr"] for r in steps(tmp_path / "step")]
    assert lrs == pytest.approx([0.01] * 4 + [0.005] * 4)
    run(tmp_path, base_config, "cos", schedule="cosine", warmup_steps=2, **common)
    lrs = [r["lr"] for r in steps(tmp_path / "cos")]
    assert lrs[:3] == pytest.approx([0.005, 0.01, 0.01])  # linear warm-up, then the peak
    assert all(a > b for a, b in itertools.pairwise(lrs[2:]))  # cosine decay
    assert lrs[-1] == pytest.approx(0.01 * 0.5 * (1 + math.cos(math.pi * 5 / 6)))


# --- configuration errors ------------------------------------------------------------------------


def test_config_errors_say_what_to_change(tmp_path: Path, base_config: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="unknown option 'learning_rate'"):
        run(tmp_path, base_config, "bad", learning_rate=0.1)
    with pytest.raises(ValueError, match="SVR wraps"):
        run(tmp_path, base_config, "bad", loss="ask", svr="static")
    with pytest.raises(ValueError, match="CACL anchors on English"):
        run(
            tmp_path,
            base_config,
            "bad",
            loss="cacl",
            languages=["fra_Latn", "eng_Latn", "deu_Latn"],
        )
    with pytest.raises(ValueError, match=r"--pair-language: jpn_Jpan is not in --languages"):
        run(tmp_path, base_config, "bad", loss="infonce", pair_language="jpn_Jpan")
    with pytest.raises(SystemExit):
        main(["--loss", "kcl"])  # no manifest, no sonar, no output dir


# --- distributed ---------------------------------------------------------------------------------


@pytest.mark.parametrize("grad_cache", [False, True], ids=["ddp", "ddp-gradcache"])
def test_two_process_gloo_ddp_smoke(
    tmp_path: Path, base_config: dict[str, Any], grad_cache: bool
) -> None:
    values = {
        **base_config,
        "loss": "kcl",
        "max_steps": 2,
        "batch_size": 3,
        "test_manifest": None,
        "val_manifest": None,
        "output_dir": str(tmp_path / "ddp"),
        "grad_cache": grad_cache,
    }
    config = tmp_path / "ddp.json"
    config.write_text(json.dumps(values))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # rendezvous on a port the OS picks: no race between parallel tests
        "--nproc_per_node=2",
        str(EXAMPLES / "finetune_ced_sonar.py"),
        "--config",
        str(config),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "ddp"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 2 and summary["ranks_in_sync"] is True
    checkpoint = out / "checkpoints" / (out / "checkpoints" / "latest").read_text()
    assert (checkpoint / "rng-rank0.pt").is_file() and (checkpoint / "rng-rank1.pt").is_file()
    assert all(math.isfinite(r["loss"]) for r in steps(out))
