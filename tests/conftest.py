"""Shared fixtures and helpers for the test suite."""

from __future__ import annotations

import os

import pytest
import torch

# Keep runs deterministic and within the 2-core budget.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
