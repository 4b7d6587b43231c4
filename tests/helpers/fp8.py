"""Programs shared by the fp8 worker (2 processes, ``tests/workers/fp8_checks.py``) and the
single-process fp8 tests: a small residual MLP whose layers suit float8 (dimensions multiples
of 16) but for its output head, and a fixed regression task of 800 samples (50 updates of
2 ranks x 8 samples per epoch)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import accelfn as af

IN, WIDTH, HIDDEN, OUT = 32, 64, 128, 16
NUM_SAMPLES = 800
PER_RANK_BATCH = 8
UPDATES = 50  # one epoch on 2 ranks: 800 / (2 * 8)
RESUME_AT = 25
SEED = 0
#: the docs' tolerance (docs/03, "fp8"): the fp8 loss curve stays within this of bf16's, relative
#: to bf16's loss at each of the 50 updates (measured on 2 CPU processes: at most 2.4%, 1.3% at the last)
TOLERANCE = 0.05


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(h)))


class Net(torch.nn.Module):
    """``IN -> WIDTH``, two residual ``WIDTH -> HIDDEN -> WIDTH`` blocks (FSDP2's units), a
    ``WIDTH -> OUT`` head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(IN, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.head = torch.nn.Linear(WIDTH, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(NUM_SAMPLES, IN, generator=g)
    teacher = torch.randn(IN, OUT, generator=g) / IN**0.5
    return TensorDataset(x, torch.tanh(x @ teacher) + 0.1 * torch.randn(NUM_SAMPLES, OUT, generator=g))


def loader() -> DataLoader:
    return DataLoader(data(), batch_size=PER_RANK_BATCH, shuffle=True)


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def make_state(seed: int = SEED) -> af.TrainState:
    torch.manual_seed(seed)
    model = Net()
    return af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=3e-3))


def program(precision: af.Transform, *, shard: bool = True) -> af.Step:
    """shard_data + (shard_params) + the precision given."""
    transforms = [af.shard_data(seed=SEED), precision] + ([af.shard_params()] if shard else [])
    return af.compose(*transforms)(af.train_step(loss_fn))


def fp8(**options: object) -> af.Transform:
    """``with_precision("fp8")`` with the head excluded (and the options given)."""
    return af.with_precision("fp8", exclude=("head",), **options)  # type: ignore[arg-type]


def fp8_unavailable() -> str | None:
    """Why fp8 training cannot run on this machine's CPU (torchao missing, or no float8 matmul
    in this torch), or None."""
    from accelfn.distributed import float8

    return float8.why_unsupported(torch.device("cpu"))


#: skips a test where fp8 training cannot run on the CPU, with the exact reason
requires_fp8 = pytest.mark.skipif(fp8_unavailable() is not None, reason=str(fp8_unavailable()))
