"""The scripts that the docs page "Use it in your trainer" shows (``docs/snippets/``), run
as they are: each trains a few steps and its loss falls. (The DDP script runs on two
processes in ``test_docs.py``.)"""

from __future__ import annotations

import functools
import runpy
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import CountingBackend
from torch import nn

SNIPPETS = Path(__file__).resolve().parents[1] / "docs" / "snippets"


@pytest.fixture
def run_snippet(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
):
    """``run(name)`` -> the script's globals; what it printed is echoed to the test log."""
    # Pasted as shown: run from an empty folder, docs/snippets not on the path, so a
    # recipe that imports a helper only the docs folder has fails here.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != SNIPPETS])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing is downloaded; make sure of it

    def run(name: str) -> dict[str, Any]:
        result = runpy.run_path(str(SNIPPETS / name), run_name="__main__")
        printed = capsys.readouterr().out.strip().splitlines()
        if printed:
            with capsys.disabled():
                print(f"\n{name}: {printed[-1]}")
        return result

    return run


def _falls(history: list[float], by: float = 0.0) -> None:
    assert history[-1] < history[0] - by, history


def test_open_clip_drop_in_snippet(run_snippet):
    _falls(run_snippet("open_clip_dropin.py")["history"], by=1.0)


def test_hugging_face_clap_snippet(run_snippet):
    pytest.importorskip("transformers", reason="the examples extra is not installed")
    result = run_snippet("hf_clap_loss.py")
    _falls(result["losses"])


def test_hugging_face_trainer_snippet(run_snippet):
    pytest.importorskip("transformers", reason="the examples extra is not installed")
    pytest.importorskip(
        "accelerate", reason="transformers.Trainer needs accelerate (examples extra)"
    )
    _falls(run_snippet("hf_trainer.py")["losses"])


def test_lightning_snippet(run_snippet, monkeypatch):
    """Lightning is not installed here: a stand-in ``LightningModule`` (an ``nn.Module``
    whose ``log``/``log_dict`` record) runs the page's ``training_step`` as it is."""
    logged: dict[str, torch.Tensor] = {}

    class LightningModule(nn.Module):
        def log(self, name: str, value: torch.Tensor, **kwargs: Any) -> None:
            logged[name] = value

        def log_dict(self, values: dict[str, torch.Tensor], **kwargs: Any) -> None:
            logged.update(values)

    monkeypatch.setitem(
        sys.modules, "lightning", types.SimpleNamespace(LightningModule=LightningModule)
    )
    torch.manual_seed(0)
    clap = run_snippet("lightning_module.py")["CLAP"](nn.Linear(40, 16), nn.Linear(30, 16))
    g = torch.Generator().manual_seed(0)
    batch = {
        "audio": torch.randn(8, 40, generator=g),
        "tokens": torch.randn(8 * 3, 30, generator=g),
        "mask": torch.ones(8, 3, dtype=torch.bool),
    }
    optimizer = clap.configure_optimizers()
    losses = []
    for step in range(5):
        loss = clap.training_step(batch, step)
        optimizer.zero_grad()
        loss.backward()
        assert clap.logit_scale.grad is not None and clap.logit_scale.grad != 0
        optimizer.step()
        losses.append(loss.item())
    _falls(losses)
    assert {"train/loss", "train/svr", "train/loss_a2t"} <= set(logged)


def test_compile_snippet(run_snippet, monkeypatch):
    """The page's claim: ``fullgraph=True`` with the value checks on (the snippet's
    default) gives one graph and no recompile over the loop. Compiled with ``aot_eager``
    here (inductor's C++ build takes minutes on CI's two cores; the compiled-loop tests
    run inductor once)."""
    import torch._dynamo

    from contrastive_losses import _checks

    torch._dynamo.reset()
    counter = CountingBackend("aot_eager")
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counter))
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    assert _checks.resolve_validate(None)  # the checks are on
    result = run_snippet("compile_loop.py")
    assert result["loss_fn"].base.validate_args is None and result["loss_fn"].validate_args is None
    assert counter.calls == 1, f"{counter.calls} graphs for one loop"
    _falls(result["history"])
