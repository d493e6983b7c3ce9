"""Shared test settings: hypothesis profile sized for a 2-core CPU CI."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Two pytest-xdist workers on two cores: one intra-op thread each avoids oversubscription.
torch.set_num_threads(1)


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded CPU generator so every test draws the same data on every run."""
    return torch.Generator().manual_seed(0)
