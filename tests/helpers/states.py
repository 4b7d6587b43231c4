"""A small training job with every kind of state, and a bitwise comparison of two states."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

import accelfn as af
from tests.helpers.models import classification_data, loss_fn


class DropNet(torch.nn.Module):
    """6 -> 16 -> 3 with dropout: training draws from the global torch RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.drop = torch.nn.Dropout(0.3)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


class Counter:
    """A user object with state_dict/load_state_dict, as ``TrainState.extra`` holds."""

    def __init__(self) -> None:
        self.seen = 0
        self.history: list[float] = []

    def state_dict(self) -> dict:
        return {"seen": self.seen, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.seen, self.history = state["seen"], list(state["history"])



def build(seed: int = 0, *, total_steps: int = 15, extra: bool = False) -> af.TrainState:
    """DropNet with AdamW and a cosine schedule over ``total_steps``; its init depends on ``seed``."""
    torch.manual_seed(seed)
    model = DropNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    return af.TrainState.create(model, optimizer, scheduler=scheduler, extra={"counter": Counter()} if extra else None)


def dataset(n: int = 40) -> TensorDataset:
    """``n`` samples of 6 features and 3 classes (``models.classification_data``)."""
    return classification_data(n)


def loader(n: int = 40, batch_size: int = 4, workers: int = 0) -> DataLoader:
    """A shuffled DataLoader (10 micro-batches per epoch by default) with ``workers`` worker processes."""
    return DataLoader(dataset(n), batch_size=batch_size, shuffle=True, num_workers=workers)


def program(*transforms: af.Transform) -> af.Step:
    """shard_data, accumulate(2) and clip(0.5), plus ``transforms``."""
    return af.compose(af.shard_data(seed=3), af.accumulate(2), af.clip(0.5), *transforms)(af.train_step(loss_fn))


def assert_same_state(a: af.TrainState, b: af.TrainState) -> None:
    """Parameters, buffers, optimizer state, lr, scheduler, counters and transform states
    of ``a`` and ``b`` are bitwise equal."""
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(x, y), f"model {name} differs"
    oa, ob = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for i, entries in oa["state"].items():
        for key, value in entries.items():
            assert torch.equal(value, ob["state"][i][key]), f"optimizer state[{i}][{key}] differs"
    if a.scheduler is not None:
        assert a.scheduler.state_dict() == b.scheduler.state_dict()
    assert (a.step, a.micro_step, a.epoch, a.epoch_micro_step) == (b.step, b.micro_step, b.epoch, b.epoch_micro_step)
    assert a.transforms_state.keys() == b.transforms_state.keys()
    for key in a.transforms_state:
        assert repr(a.transforms_state[key]) == repr(b.transforms_state[key]), f"transforms_state[{key}] differs"


def same_tree(a: Any, b: Any) -> bool:
    """Trees equal: tensors and arrays bitwise, records field by field."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if attrs.has(type(a)):
        return type(a) is type(b) and same_tree(attrs.asdict(a, recurse=False), attrs.asdict(b, recurse=False))
    if isinstance(a, Mapping):
        return isinstance(b, Mapping) and a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        if type(a) is not type(b) or len(a) != len(b):
            return False
        if all(type(x) in (int, float, str) for x in a):  # an RNG state: 625 ints at once
            return all(type(x) is type(y) for x, y in zip(a, b)) and a == b
        return all(map(same_tree, a, b))
    return type(a) is type(b) and a == b


def everything(state: af.TrainState) -> dict[str, Any]:
    """The state's tensors, optimizer, scheduler, extra, counters and the global generators."""
    snap = af.snapshot(state)
    return {"snapshot": {f.name: getattr(snap, f.name) for f in attrs.fields(af.Snapshot) if f.name != "rng"},
            "torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
