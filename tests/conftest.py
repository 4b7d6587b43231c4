"""Shared fixtures: the same global RNG state for every test, and the one-process CPU backend."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import accelfn as af


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same global RNG state."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


@pytest.fixture(scope="session")
def cpu() -> af.backends.CPU:
    """The one-process CPU backend."""
    return af.backends.CPU(af.backends.LaunchEnv())
