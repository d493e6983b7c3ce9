"""Fixtures of the example trainer's tests: synthetic captioned audio (3 languages) and a tiny
SONAR-shaped encoder with a sentencepiece NLLB tokenizer, built once per test session."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

from clap_example.synthetic import make_dataset, make_sonar_dir, tiny_run_config  # noqa: E402


@pytest.fixture(scope="session")
def synthetic_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """16 training clips (2-3 s, mixed sample rates, some stereo, some missing German), 8 test
    and 8 validation clips with 2 captions per language."""
    return make_dataset(tmp_path_factory.mktemp("data"), n_train=16, n_test=8, n_val=8)


@pytest.fixture(scope="session")
def sonar_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_sonar_dir(tmp_path_factory.mktemp("sonar"))


@pytest.fixture(scope="session")
def base_config(synthetic_data: dict[str, Path], sonar_dir: Path) -> dict[str, Any]:
    """Options of a tiny CPU run; tests add --loss, --output-dir, ..."""
    return tiny_run_config(synthetic_data, sonar_dir)


def write_config(directory: Path, values: dict[str, Any]) -> Path:
    path = directory / "config.json"
    path.write_text(json.dumps(values))
    return path
