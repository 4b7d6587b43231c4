"""Models and programs shared by the tests of ``checkpoint_activations`` and regional
compilation, single-process and pooled (tests/workers/recompute_checks.py): residual blocks
with dropout, so that a recomputation that drew other masks would change the parameters."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import accelfn as af

WIDTH = 16
NUM_SAMPLES = 24  # 3 micro-batches of 4 per rank on 2 processes
BATCH = 4


class Block(torch.nn.Module):
    """``x + b(dropout(gelu(a(x))))``: a transformer MLP block with dropout."""

    def __init__(self, width: int = WIDTH, hidden: int = 32, p: float = 0.2) -> None:
        super().__init__()
        self.a = torch.nn.Linear(width, hidden)
        self.b = torch.nn.Linear(hidden, width)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(self.drop(F.gelu(self.a(x))))


class Net(torch.nn.Module):
    """``(batch, 8) -> (batch, 4)``: an input layer, ``len(hidden)`` blocks, an output layer."""

    def __init__(self, hidden: tuple[int, ...] = (32, 32, 32, 32), width: int = WIDTH, p: float = 0.2) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, width)
        self.blocks = torch.nn.ModuleList(Block(width, h, p) for h in hidden)
        self.out = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


#: tensor parallelism's plan of ``Net``: each block's MLP split Megatron-style
TP_PLAN = {"blocks.*.a": "colwise", "blocks.*.b": "rowwise"}


def make_state(seed: int = 0, **net: Any) -> af.TrainState:
    torch.manual_seed(seed)
    model = Net(**net)
    return af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def data(num_samples: int = NUM_SAMPLES) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(num_samples, 8, generator=g)
    return TensorDataset(x, torch.randint(0, 4, (num_samples,), generator=g))


def loader(batch_size: int = BATCH) -> DataLoader:
    return DataLoader(data(), batch_size=batch_size, shuffle=True)


def loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def summed(model: torch.nn.Module, batch: Any) -> af.Loss:
    """The same loss as ``af.Loss``: summed over the samples, with their count."""
    x, y = batch
    return af.Loss(total=F.cross_entropy(model(x), y, reduction="sum"), count=y.shape[0])


def _pipelined(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)


#: the pipelined form of ``loss``: the last stage's output and the targets
pipelined = af.output_loss(_pipelined)


def local(t: torch.Tensor) -> torch.Tensor:
    """A parameter's values on this rank (a DTensor's local shard)."""
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def recomputed_blocks(model: torch.nn.Module) -> list[str]:
    """The blocks of ``model`` whose forward recomputes."""
    from accelfn.distributed.recompute import recomputing

    return [name for name, _ in recomputing(model)]


class Calls:
    """Counts the forwards of each block's first linear layer (a recomputation runs it again)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.count = 0
        for block in model.blocks:  # type: ignore[union-attr]
            block.a.register_forward_hook(self._called)

    def _called(self, *_: Any) -> None:
        self.count += 1
