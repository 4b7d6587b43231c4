"""Shared fixtures: small models and data whose training a hand-written loop can mirror."""

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


class MLP(torch.nn.Module):
    """6 -> 16 -> 3 with a tanh: small, deterministic, every parameter gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def make_mlp(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP()


def classification_data(n: int = 40, seed: int = 1) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return torch.utils.data.TensorDataset(x, y)
