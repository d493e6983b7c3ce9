"""What differs between torch releases (``_compat``) and what must hold on every one:
the version shims, the refusal of ``torch.compile`` on a torch too old to trace the
losses, and a ``state_dict`` round trip of every loss Module.

Part of the compat subset that ``.ci/compat`` runs on the floor torch, 2.9, 2.11 and the
newest release (with test_compile, test_tiled, test_kernels and test_distributed)."""

from __future__ import annotations

import io
import re
import tomllib
from pathlib import Path

import pytest
import torch
from test_compile import LOSSES, _build, _inputs

from contrastive_losses import InfoNCELoss, SupportVectorRegularizer, _compat
from contrastive_losses import functional as CF


def test_torch_version_parses_local_and_pre_release_tags() -> None:
    assert _compat.torch_version("2.11.0+cu130") == (2, 11, 0)
    assert _compat.torch_version("2.12.0a0+git1234") == (2, 12, 0)
    assert _compat.torch_version("2.1") == (2, 1, 0)
    assert _compat.TORCH == _compat.torch_version(torch.__version__)


def test_is_compiling_is_false_in_eager_and_true_while_traced() -> None:
    """torch.compiler.is_compiling arrived in torch 2.3; the shim answers on 2.1 and 2.2."""
    assert _compat.is_compiling() is False
    if _compat.TORCH[:2] < _compat.MIN_TORCH_COMPILE:
        pytest.skip(f"torch {torch.__version__}: compile is refused (the next test)")
    torch._dynamo.reset()
    seen = torch.compile(lambda x: x + int(_compat.is_compiling()), fullgraph=True)
    assert seen(torch.zeros(())).item() == 1


def test_compile_on_too_old_torch_is_refused_naming_the_version(monkeypatch) -> None:
    """Below MIN_TORCH_COMPILE every loss raises, under torch.compile, a RuntimeError that
    names the running torch and the release it needs (simulated on a newer torch)."""
    monkeypatch.setattr(_compat, "TORCH", (2, 1, 2))
    monkeypatch.setattr(_compat, "is_compiling", lambda: True)
    want = r"needs torch>=2\.\d+; this is torch " + re.escape(torch.__version__)
    with pytest.raises(RuntimeError, match=want):
        InfoNCELoss()(torch.randn(4, 8), torch.randn(4, 8))
    with pytest.raises(RuntimeError, match=want):
        CF.siglip(torch.randn(4, 8), torch.randn(4, 8), chunk_size=2)
    monkeypatch.setattr(_compat, "is_compiling", lambda: False)  # eager: runs
    assert torch.isfinite(InfoNCELoss()(torch.randn(4, 8), torch.randn(4, 8)))


MODULES = [n for n in LOSSES if isinstance(_build(n), torch.nn.Module)]


# ASKLoss keeps no state of its own (its KnowledgeBank's round trip: test_edges).
@pytest.mark.parametrize("name", MODULES)
def test_state_dict_round_trip(name: str) -> None:
    """Every loss Module through torch.save / torch.load(weights_only=True) into a fresh
    one, its parameters and buffers moved off their initial values first: same state,
    same loss."""
    loss_fn = _build(name)
    with torch.no_grad():
        for i, t in enumerate([*loss_fn.parameters(), *loss_fn.buffers()]):
            if t.is_floating_point():
                t.mul_(0.9 - 0.01 * i)
    buffer = io.BytesIO()
    torch.save(loss_fn.state_dict(), buffer)
    buffer.seek(0)
    fresh = _build(name)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    saved, loaded = loss_fn.state_dict(), fresh.state_dict()
    assert saved.keys() == loaded.keys()
    for key in saved:
        torch.testing.assert_close(loaded[key], saved[key], rtol=0, atol=0, msg=key)
    args, kwargs = _inputs(name, 8)
    torch.testing.assert_close(fresh(*args, **kwargs), loss_fn(*args, **kwargs))


def test_the_floors_are_stated_alike_everywhere() -> None:
    """pyproject's torch and numpy floors are the ones the compat stage installs first, and
    README and the docs name them and the compile floor."""
    root = Path(__file__).resolve().parents[1]
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    floor = "{}.{}".format(*_compat.MIN_TORCH)
    assert f"torch>={floor}" in deps
    numpy_floor = next(d for d in deps if d.startswith("numpy>=")).removeprefix("numpy>=")
    compat = (root / ".ci" / "compat").read_text()
    assert re.search(
        rf'^    "{re.escape(floor)}\.\d+" "numpy=={re.escape(numpy_floor)}\.\d+"$', compat, re.M
    )
    compile_floor = "torch>={}.{}".format(*_compat.MIN_TORCH_COMPILE)
    for page in ("README.md", "docs/index.rst", "docs/versions.rst"):
        text = " ".join((root / page).read_text().split())
        assert f"torch>={floor}" in text and compile_floor in text, page


def test_compile_of_the_regulariser_is_refused_below_its_own_floor(monkeypatch) -> None:
    """torch 2.7 and 2.8 compile the bases but not SupportVectorRegularizer (simulated)."""
    monkeypatch.setattr(_compat, "TORCH", (2, 8, 0))
    monkeypatch.setattr(_compat, "is_compiling", lambda: True)
    a, t = torch.randn(4, 8), torch.randn(4, 8)
    assert torch.isfinite(InfoNCELoss()(a, t))
    want = r"SupportVectorRegularizer under torch.compile needs torch>=2\.9; this is torch "
    with pytest.raises(RuntimeError, match=want + re.escape(torch.__version__)):
        SupportVectorRegularizer(InfoNCELoss(), radius=0.2)(a, t)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_the_refusal_through_dynamo_is_a_runtime_error_carrying_its_text(
    monkeypatch, fullgraph: bool
) -> None:
    """The refusal as a torch below a floor runs it (called through
    ``assume_constant_result``, untraced), under this torch's real dynamo, with and
    without fullgraph: a RuntimeError carrying the whole text (here dynamo's
    ``InternalTorchDynamoError``, a subclass, as on torch 2.3.1; docs: "Supported
    versions")."""
    if _compat.TORCH[:2] < _compat.MIN_TORCH_COMPILE:
        pytest.skip(f"torch {torch.__version__}: every loss is refused (test_compile)")
    monkeypatch.setattr(_compat, "TORCH", (2, 8, 0))  # below the regulariser's floor
    wrapped = torch._dynamo.assume_constant_result(_compat._raise_compile_refusal)
    monkeypatch.setattr(_compat, "_refuse_compile", wrapped)
    torch._dynamo.reset()
    loss_fn = SupportVectorRegularizer(InfoNCELoss(), radius=0.2)
    compiled = torch.compile(loss_fn, fullgraph=fullgraph, backend="aot_eager")
    want = r"SupportVectorRegularizer under torch.compile needs torch>=2\.9; this is torch "
    with pytest.raises(RuntimeError, match=want + re.escape(torch.__version__)):
        compiled(torch.randn(4, 8), torch.randn(4, 8))
    torch._dynamo.reset()
