"""Small models, data and the loss whose training a hand-written loop can mirror."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of ``model(x)`` against the labels ``y`` of a ``(x, y)`` batch."""
    x, y = batch
    return F.cross_entropy(model(x), y)


def frozen_backbone_model() -> torch.nn.Sequential:
    """Sequential(backbone, head) with the backbone (Linear + BatchNorm) frozen and in eval mode."""
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    model = torch.nn.Sequential(backbone, torch.nn.Linear(8, 1))
    backbone.requires_grad_(False)
    backbone.eval()
    return model


def shifted_regression() -> torch.utils.data.TensorDataset:
    """32 samples of 4 features (mean 3, std 2: BatchNorm statistics move) and 1 target."""
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g) * 2 + 3, torch.randn(32, 1, generator=g))


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters that require a gradient."""
    return [p for p in model.parameters() if p.requires_grad]
