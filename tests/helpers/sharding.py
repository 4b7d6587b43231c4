"""Sharded (FSDP2) test states: ``af.shard_params`` in the program shards a test model (in
``backend.prepare``), the rest builds and reads states.

``build(sharded=True)`` and ``program()`` are the only places a test model gets sharded; the
sharded-checkpoint tests and their worker all go through them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.utils.data import DataLoader, TensorDataset

import accelfn as af


class Blocks(torch.nn.Module):
    """6 -> 8, three 8 -> 8 blocks with dropout, a 1-wide gate (rank 1's shard of its
    weight is empty), 8 -> 3; ``tied=True`` makes the output layer the transposed input
    embedding of a 3-token vocabulary (a tied weight)."""

    def __init__(self, *, tied: bool = False) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 8)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])
        self.gate = torch.nn.Linear(8, 1)
        self.drop = torch.nn.Dropout(0.2)
        self.out = torch.nn.Linear(8, 3)
        self.emb = torch.nn.Embedding(3, 8)
        if tied:
            self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = torch.tanh(block(self.drop(h)))
        return self.out(h * torch.sigmoid(self.gate(h)))


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def build(*, sharded: bool, tied: bool = False) -> af.TrainState:
    """Blocks (seeded; its embedding frozen unless ``tied``) with AdamW and a step schedule; with ``sharded``, prepared with
    ``program()`` by the launch environment's backend, which shards it over the processes
    (each block of the ModuleList a unit, then the root)."""
    torch.manual_seed(0)
    model = Blocks(tied=tied)
    if not tied:  # a frozen parameter (as a LoRA's base; unused by forward): its own dcp-frozen/ files
        model.emb.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    state = af.TrainState.create(model, optimizer, scheduler=scheduler)
    if sharded:
        state, _ = af.backends.auto().prepare(program(), state)
    return state


def loader() -> DataLoader:
    """40 samples in batches of 4: 5 updates per epoch on each of 2 processes."""
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g)),
                      batch_size=4, shuffle=True)


def program(*, sharded: bool = True) -> af.Step:
    """shard_data, and shard_params (which shards nothing in one process) unless ``sharded`` is False."""
    transforms = (af.shard_data(seed=3), af.shard_params()) if sharded else (af.shard_data(seed=3),)
    return af.compose(*transforms)(af.train_step(loss_fn))


def full_state(state: af.TrainState) -> dict[str, torch.Tensor]:
    """The model's and optimizer's tensors as full tensors (gathered when sharded: a
    collective), by ``model/<name>`` and ``optimizer/<parameter>/<key>``, and the counters."""
    options = StateDictOptions(full_state_dict=True)
    model = get_model_state_dict(state.model, options=options)
    optimizer = get_optimizer_state_dict(state.model, state.optimizer, options=options)
    tensors = {f"model/{k}": v for k, v in model.items()}
    tensors |= {f"optimizer/{p}/{k}": v for p, entries in optimizer["state"].items() for k, v in entries.items()}
    tensors["counters"] = torch.tensor([state.step, state.micro_step, state.epoch, state.epoch_micro_step])
    return {k: v.detach().clone().contiguous() for k, v in tensors.items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """``a`` and ``b`` hold the same names and bitwise equal tensors."""
    assert sorted(a) == sorted(b)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"differ: {differ}"
