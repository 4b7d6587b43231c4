"""A tracker that records every point, and a small regression job whose logged points tests read."""

from __future__ import annotations

from typing import Any

import torch

import accelfn as af


class Recorder:
    """A tracker that keeps every point it is given."""

    def __init__(self) -> None:
        self.points: list[tuple[int, dict[str, float]]] = []

    def log(self, metrics: Any, step: int) -> None:
        self.points.append((step, dict(metrics)))

    def close(self) -> None:
        pass


def linear_job(num_batches: int = 10, seed: int = 0) -> tuple[af.TrainState, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Linear(4, 1) with SGD(lr 0.1), and ``num_batches`` random batches of 8."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 1)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(num_batches)]
    return state, data
