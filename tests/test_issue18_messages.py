"""Messages and documentation of issue 18 (items 9, 10, 13): ``KnowledgeBank.refresh`` names
``encode_fn``, faiss's clustering warnings reach ``warnings``, ``docs/screenshot_check.py``
takes a relative ``--html``, and what the READMEs promise."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

import contrastive_losses as cl

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("returned", [2, 4])
def test_refresh_names_encode_fn_when_it_returns_the_wrong_number_of_values(
    returned: int,
) -> None:
    bank = cl.KnowledgeBank(8, backend="torch", num_prototypes=2)
    batch = torch.randn(4, 8)

    def encode(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (b, b, torch.arange(4), b)[:returned]

    with pytest.raises(ValueError, match=rf"encode_fn.*3.*{returned}"):
        bank.refresh(encode, [batch], progress=False)


def test_faiss_clustering_warnings_reach_python_warnings(capfd: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("faiss")
    bank = cl.KnowledgeBank(8, backend="faiss", num_prototypes=4)
    g = torch.Generator().manual_seed(0)
    audio, text = torch.randn(40, 8, generator=g), torch.randn(40, 8, generator=g)
    capfd.readouterr()
    with pytest.warns(UserWarning, match=r"clustering 40 points to 4 centroids"):
        bank.build(audio, text, torch.arange(40))
    assert "WARNING clustering" not in capfd.readouterr().err


def test_screenshot_check_accepts_a_relative_html_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = importlib.util.spec_from_file_location(
        "screenshot_check", ROOT / "docs" / "screenshot_check.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    html = tmp_path / "site"
    for page in module.SHOTS.values():
        (html / f"{page}.html").parent.mkdir(parents=True, exist_ok=True)
        (html / f"{page}.html").write_text("<html></html>")
    uris: list[str] = []

    class Stop(Exception):
        pass

    def fake_screenshot(page: Path, png: Path) -> None:
        uris.append(page.as_uri())  # a relative path raises ValueError here
        raise Stop

    monkeypatch.setattr(module, "screenshot", fake_screenshot)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["screenshot_check.py", "--html", "site", "--out", "shots"])
    with pytest.raises(Stop):
        module.main()
    assert uris and uris[0].startswith("file:///")


def test_readme_tells_cpu_users_to_install_the_cpu_torch_first() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in readme


def test_readme_says_what_each_rank_returns() -> None:
    text = " ".join((ROOT / "README.md").read_text().split())
    assert "equals the single-process loss" not in text.replace(
        "the mean over ranks equals the single-process loss", ""
    )
    assert "each rank returns its own share" in text
    assert "the mean over ranks equals the single-process loss" in text


def test_benchmarks_readme_states_the_quick_runs_measured_time() -> None:
    text = (ROOT / "benchmarks" / "README.md").read_text()
    line = next(line for line in text.splitlines() if "run_all.py --quick" in line)
    assert "~1 min" not in line
    assert re.search(r"measured|took", text) and re.search(r"\d+(\.\d+)? ?min", line), line
