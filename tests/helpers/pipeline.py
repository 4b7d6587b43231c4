"""Programs shared by the ``pipeline`` worker (tests/workers/pp_checks.py) and its
single-process reference: a residual MLP of 4 blocks cut at ``blocks.2`` into 2 stages, on
regression data, and the hand-written loop it must equal."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import accelfn as af
from tests.helpers import programs as P

BATCH = 4
NUM_SAMPLES = 72  # 18 micro-batches per epoch: windows of 4, 4, 4, 4 and 2 on one data shard
EPOCHS = 3
ACCUMULATE = 4
CLIP = 1.0
LR = 1e-2
SPLIT = ["blocks.2"]
#: interleaved 1F1B: 4 stages, 2 per rank (rank 0: inp, blocks.0, blocks.2; rank 1: blocks.1, blocks.3, out)
SPLIT_INTERLEAVED = ["blocks.1", "blocks.2", "blocks.3"]


class Net(torch.nn.Module):
    """``(batch, 4) -> (batch, 1)``: an input layer, 4 residual tanh blocks, an output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.out(h)


def factor(step: int) -> float:
    """The learning-rate factor of update ``step`` (a warm-up: the scheduler must step once per update)."""
    return min(1.0, (step + 1) / 5)


def make_state() -> af.TrainState:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-4)
    return af.TrainState.create(model, optimizer, scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, factor))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(NUM_SAMPLES, 4, generator=g)
    return TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))


def loader() -> DataLoader:
    return DataLoader(data(), batch_size=BATCH, shuffle=True)


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The pipelined form (``af.output_loss``): the last stage's output and the targets."""
    return F.mse_loss(output, targets)


def step(schedule: str, data_world: int) -> Any:
    parallel = [af.replicate()] if data_world > 1 else []
    split = SPLIT_INTERLEAVED if schedule == "interleaved_1f1b" else SPLIT
    return af.compose(af.shard_data(seed=P.SHARD_SEED), af.pipeline(split, size=2, schedule=schedule), *parallel,
                      af.accumulate(ACCUMULATE), af.clip(CLIP))(af.train_step(af.output_loss(loss)))


def hand_written(*, data_world: int = 1, epochs: int = EPOCHS,
                 skip: frozenset[int] = frozenset()) -> tuple[af.TrainState, list[float], list[float]]:
    """One process, no accelfn: AdamW over windows of ``BATCH * data_world * ACCUMULATE``
    samples in the ``shard_data`` order of each epoch (the last window what is left),
    clip_grad_norm_ before every update, the scheduler stepped after it; the windows
    numbered in ``skip`` (from 0, over the run) are left out (skip_nonfinite's skipped updates).

    Returns:
        The trained state, each update's gradient norm before clipping, and its mean loss.
    """
    state = make_state()
    model, opt, sched = state.model, state.optimizer, state.scheduler
    x, y = data().tensors
    norms, losses = [], []
    for window, batch in enumerate(windows(epochs, data_world)):
        if window in skip:
            continue
        value = loss(model(x[batch]), y[batch])
        value.backward()
        losses.append(float(value.detach()))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        sched.step()  # type: ignore[union-attr]  # made with one
        opt.zero_grad()
    return state, norms, losses


def windows(epochs: int, data_world: int) -> Iterator[list[int]]:
    """The sample indices of each update's window, in order: the seeded shuffle of each epoch
    cut into windows of ``BATCH * data_world * ACCUMULATE`` (the last one shorter)."""
    for epoch in range(epochs):
        sampler = DistributedSampler(data(), num_replicas=1, rank=0, shuffle=True, seed=P.SHARD_SEED)
        sampler.set_epoch(epoch)
        order = list(sampler)
        size = BATCH * data_world * ACCUMULATE
        for start in range(0, len(order), size):
            yield order[start:start + size]


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(u, v, rel_tol=1e-5, abs_tol=1e-6) for u, v in zip(a, b))


def items(output: torch.Tensor, targets: torch.Tensor) -> tuple[af.Loss, dict[str, torch.Tensor]]:
    """An af.Loss over the samples whose target exceeds 0.3 (ragged counts, some micro-batches
    without any), and their mean absolute error as a metric."""
    mask = (targets > 0.3).float()
    error = output - targets
    count = mask.sum()
    return (af.Loss(total=(error.pow(2) * mask).sum(), count=count),
            {"mae": (error.abs() * mask).sum() / count.clamp_min(1)})


def mean_with_metrics(output: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean loss and the mean absolute error as a metric."""
    return loss(output, targets), {"mae": (output - targets).abs().mean()}


def hand_written_items(*, summed: bool, epochs: int = 1,
                       data_world: int = 1) -> tuple[af.TrainState, list[float], list[float], int]:
    """One process, no accelfn, windows as ``hand_written``'s: with ``summed`` the window's
    masked squared errors summed and divided by its masked count (``items``), else the mean
    loss; each update's logged loss and mean absolute error (over the window's counted
    samples, or all of them), and the number of micro-batches of ``BATCH`` without items."""
    state = make_state()
    model, opt, sched = state.model, state.optimizer, state.scheduler
    x, y = data().tensors
    losses, maes, empty = [], [], 0
    for batch in windows(epochs, data_world):
        output, targets = model(x[batch]), y[batch]
        mask = (targets > 0.3).float() if summed else torch.ones_like(targets)
        empty += sum(int(mask[i:i + BATCH].sum() == 0) for i in range(0, len(batch), BATCH))
        error = output - targets
        value = (error.pow(2) * mask).sum() / mask.sum()
        value.backward()
        losses.append(float(value.detach()))
        maes.append(float((error.abs() * mask).sum().detach() / mask.sum()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()  # type: ignore[union-attr]  # made with one
        opt.zero_grad()
    return state, losses, maes, empty
