"""Combinations of data, sharding and accumulation for the update-count tests, shared by the
single-process tests and the 2-process worker ``count_updates.py``."""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import accelfn as af

EPOCHS = 2
BATCH_SIZE = 4
#: (dataset size, DataLoader drop_last, shard_data: None | "pad" | "drop_last", accumulate n)
CASES: list[tuple[int, bool, str | None, int]] = [
    (size, loader_drop, shard, n)
    for size, loader_drop, shard, n in itertools.product((23, 24, 25), (False, True), (None, "pad", "drop_last"), (1, 3))
]
#: the cases run on 2 processes (sharded ones: unsharded data is the same on both ranks there)
SHARDED_CASES = [case for case in CASES if case[2] is not None and case[0] != 24]


def case_id(case: tuple[int, bool, str | None, int]) -> str:
    size, loader_drop, shard, n = case
    return f"n{size}-{'droplast' if loader_drop else 'keeplast'}-{shard or 'noshard'}-acc{n}"


def program(case: tuple[int, bool, str | None, int]) -> tuple[af.Step, DataLoader]:
    size, loader_drop, shard, n = case
    g = torch.Generator().manual_seed(size)
    data = TensorDataset(torch.randn(size, 2, generator=g), torch.randn(size, 1, generator=g))
    transforms: list[Any] = [af.accumulate(n)] if n > 1 else []
    if shard is not None:
        transforms += [af.shard_data(drop_last=shard == "drop_last"), af.replicate()]
    step = af.compose(*transforms)(af.train_step(lambda m, b: F.mse_loss(m(b[0]), b[1])))
    return step, DataLoader(data, batch_size=BATCH_SIZE, shuffle=shard is not None, drop_last=loader_drop)


def counted_and_run(case: tuple[int, bool, str | None, int], backend: af.backends.Backend) -> dict[str, int]:
    """``count_updates`` for the case, and the updates ``run`` applies in each of EPOCHS epochs."""
    step, loader = program(case)
    count = af.count_updates(step, loader, backend=backend, epochs=EPOCHS)
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.01))
    epoch_ends: list[int] = []
    hook = af.Hook(lambda s, b: epoch_ends.append(s.step), at_epoch_end=True)
    state = af.run(step, state, loader, backend=backend, epochs=EPOCHS, progress=False, hooks=[hook])
    return {"per_epoch": count.per_epoch, "total": count.total, "run": state.step,
            "run_epoch_1": epoch_ends[0], "run_epoch_2": epoch_ends[1] - epoch_ends[0]}


def one_cycle(backend: af.backends.Backend, epochs: int = 3, n: int = 2) -> tuple[int, int, float]:
    """The Accelerate-style case (25 batches, accumulate(2)) with OneCycleLR sized by
    ``count_updates``: (scheduler steps taken, total_steps, final lr)."""
    step, loader = program((200, False, "pad", n))
    loader = DataLoader(loader.dataset, batch_size=8 // backend.world_size, shuffle=True)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    total = af.count_updates(step, loader, backend=backend, epochs=epochs).total
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
    state = af.TrainState.create(model, optimizer, scheduler=scheduler)
    state = af.run(step, state, loader, backend=backend, epochs=epochs, progress=False)
    return scheduler.last_epoch, total, optimizer.param_groups[0]["lr"]
