"""The package metadata a user installs: licence, one version, the changelog agrees.

Reads pyproject.toml (what hatchling turns into the wheel's METADATA) rather than building
a wheel, which would need the network for the isolated build environment.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import contrastive_losses

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_is_an_spdx_expression_with_its_file(pyproject: dict) -> None:
    project = pyproject["project"]
    assert project["license"] == "Apache-2.0"  # PEP 639: a string, not a table
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text, "LICENSE is not the full Apache-2.0 text"
    # PEP 639 supersedes licence classifiers by License-Expression; do not ship both.
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]
    # license-files as a list of globs and core metadata 2.4 by default: hatchling 1.27.
    (hatchling,) = [r for r in pyproject["build-system"]["requires"] if "hatchling" in r]
    minimum = tuple(int(x) for x in hatchling.split(">=")[1].split("."))
    assert minimum >= (1, 27), hatchling


def test_one_version_source(pyproject: dict) -> None:
    project = pyproject["project"]
    assert "version" not in project and "version" in project["dynamic"]
    path = ROOT / pyproject["tool"]["hatch"]["version"]["path"]
    assert path == ROOT / "src" / "contrastive_losses" / "__init__.py"
    found = re.findall(r'^__version__ = "([^"]+)"$', path.read_text(), flags=re.M)
    assert found == [contrastive_losses.__version__]


def test_changelog_newest_release_is_the_package_version() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+[^\]]*)\]", changelog, flags=re.M)
    assert releases, "CHANGELOG.md has no versioned entry"
    assert releases[0] == contrastive_losses.__version__, releases


def test_classifiers_and_urls(pyproject: dict) -> None:
    project = pyproject["project"]
    classifiers = project["classifiers"]
    assert any(c.startswith("Development Status ::") for c in classifiers)
    low = project["requires-python"].removeprefix(">=")
    assert f"Programming Language :: Python :: {low}" in classifiers
    assert set(project["urls"]) >= {"Repository", "Documentation", "Issues", "Changelog"}
    assert all(url.startswith("https://") for url in project["urls"].values())
