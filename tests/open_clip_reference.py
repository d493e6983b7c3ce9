"""The real open_clip, loaded without its package ``__init__``.

``import open_clip`` imports torchvision, and the torchvision that pip resolves beside
torch 2.13 from PyPI is a CUDA build that fails to import next to the CPU torch (and takes
transformers' ``ClapModel`` and ``Trainer`` down with it), so the project installs
``open_clip_torch`` without its dependencies (``.ci/run``). Its ``loss.py`` needs only
torch: it is loaded by file path. Its ``model.py`` needs torchvision only for
``FrozenBatchNorm2d`` (freezing ResNet towers) and ``hf_model`` only for Hugging Face text
towers: :func:`load_open_clip_model` stands both in while it imports, to build a tiny
ViT + text-transformer ``CLIP``.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

INSTALL = 'pip install --no-deps "open_clip_torch==3.3.*" (its loss.py needs only torch)'


def open_clip_root() -> Path:
    """The installed open_clip package folder, or skip the test saying why."""
    spec = importlib.util.find_spec("open_clip")  # finds, does not import
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"open_clip is not installed: {INSTALL}")
    return Path(next(iter(spec.submodule_search_locations)))


def load_open_clip_loss() -> Any:
    """open_clip's ``loss`` module (``ClipLoss``, ``SigLipLoss``), loaded by file path."""
    path = open_clip_root() / "loss.py"
    spec = importlib.util.spec_from_file_location("open_clip_reference_loss", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_open_clip_model(monkeypatch: pytest.MonkeyPatch) -> Any:
    """open_clip's ``model`` module, imported with two stand-ins (module docstring); the
    stand-ins and the package stub leave ``sys.modules`` with ``monkeypatch``."""
    root = open_clip_root()
    package = types.ModuleType("open_clip")
    package.__path__ = [str(root)]
    misc = types.ModuleType("torchvision.ops.misc")
    misc.FrozenBatchNorm2d = torch.nn.BatchNorm2d  # type: ignore[attr-defined]
    hf_model = types.ModuleType("open_clip.hf_model")
    hf_model.HFTextEncoder = None  # type: ignore[attr-defined]
    stand_ins = {"open_clip": package, "open_clip.hf_model": hf_model}
    try:
        import torchvision.ops.misc  # noqa: F401
    except Exception:  # missing, or the CUDA build beside a CPU torch
        stand_ins |= {
            "torchvision": types.ModuleType("torchvision"),
            "torchvision.ops": types.ModuleType("torchvision.ops"),
            "torchvision.ops.misc": misc,
        }
    for name in [n for n in sys.modules if n == "open_clip" or n.startswith("open_clip.")]:
        monkeypatch.delitem(sys.modules, name)
    for name, module in stand_ins.items():
        monkeypatch.setitem(sys.modules, name, module)
    try:
        model = importlib.import_module("open_clip.model")
    except Exception as exc:
        pytest.skip(f"open_clip's model.py does not import here ({type(exc).__name__}: {exc})")
    for name in [n for n in sys.modules if n.startswith("open_clip.")]:
        monkeypatch.setitem(sys.modules, name, sys.modules[name])  # removed after the test
    return model
