"""Programs shared by the ``shard_params`` worker (2 processes) and its single-process references.

The model is a stack of equal blocks in an ``nn.ModuleList`` (the default FSDP units) between
an input and an output layer, on the regression data of ``programs``: x (n, 4) -> y (n, 1).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

import accelfn as af
from tests.helpers import programs as P

WIDTH = 16
DEPTH = 3
EPOCHS = 2
CLIP = 1.0
CLIP_VALUE = 0.05
OPTIMIZERS = ("sgd", "adamw")


class Blocks(torch.nn.Module):
    """``4 -> WIDTH``, ``depth`` equal ``tanh(Linear(WIDTH, WIDTH))`` blocks, ``WIDTH -> 1``."""

    def __init__(self, depth: int = DEPTH, width: int = WIDTH) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.out = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.out(h)


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def make_state(optimizer: str = "adamw", *, seed: int = 0, depth: int = DEPTH, narrow: bool = False) -> af.TrainState:
    """AdamW or SGD over ``Blocks(depth)``, or with ``narrow`` over one ``Linear(4, 1)``: a
    weight of 1 row and a bias of 1 element, fewer rows than ranks (the other ranks' shards
    of both are empty)."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 1) if narrow else Blocks(depth)
    return af.TrainState.create(model, make_optimizer(optimizer, model))


def train_program(shard: af.ShardParams | None = None, clip: af.Transform | None = None) -> af.Step:
    """shard_data + shard_params + accumulate(2) + clip(CLIP): Acceptance 1's composition
    (another ``shard_params(...)`` or clip transform may be given)."""
    return af.compose(af.shard_data(seed=P.SHARD_SEED), shard or af.shard_params(), af.accumulate(2),
                      clip or af.clip(CLIP))(af.train_step(P.mse))


def loader(batch_size: int) -> DataLoader:
    return DataLoader(P.regression_data(), batch_size=batch_size, shuffle=True)


def hand_written(optimizer: str, *, clip_value: float | None = None, world_size: int = 2,
                 max_norm: float = CLIP, norm_type: float = 2.0,
                 narrow: bool = False) -> tuple[torch.nn.Module, list[float]]:
    """One process, no accelfn: what ``train_program`` does on ``world_size`` ranks x batch 3.

    Each update is one window of 2 micro-batches of 3 samples on each of 2 ranks, i.e. 12
    samples of the epoch's shard_data order (the last window of an epoch holds 4; on 4
    ranks, 24 samples and then 4); its
    gradient is the mean over the window's samples, clipped to ``max_norm`` in the
    ``norm_type`` norm (or, given ``clip_value``, clamped to it element-wise). ``narrow``:
    the model of ``make_state(narrow=True)``.

    Returns:
        The trained model and the gradient norm before clipping of every update.
    """
    state = make_state(optimizer, narrow=narrow)
    model, opt = state.model, state.optimizer
    x, y = P.regression_data().tensors
    norms = []
    for epoch in range(EPOCHS):
        sampler = DistributedSampler(P.regression_data(), num_replicas=1, rank=0, shuffle=True, seed=P.SHARD_SEED)
        sampler.set_epoch(epoch)
        order = list(sampler)
        window_size = world_size * P.PER_RANK_BATCH * 2
        for start in range(0, len(order), window_size):
            window = order[start:start + window_size]
            F.mse_loss(model(x[window]), y[window]).backward()
            if clip_value is None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)))
            else:
                torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
            opt.step()
            opt.zero_grad()
    return model, norms


def full_parameters(model: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every parameter and buffer gathered whole (``full_tensor`` of a DTensor), on the CPU."""
    return {f"{prefix}{k}": (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
            for k, v in model.state_dict().items()}


def local_bytes(tensor: Any) -> int:
    """Bytes this rank holds of ``tensor`` (a DTensor's local shard), 0 for a non-tensor."""
    if not isinstance(tensor, torch.Tensor):
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def state_bytes(state: af.TrainState) -> dict[str, int]:
    """This rank's parameter and optimizer-state bytes, counted from the tensors."""
    params = [p for group in state.optimizer.param_groups for p in group["params"]]
    return {"params": sum(local_bytes(p) for p in params),
            "optimizer": sum(local_bytes(v) for s in state.optimizer.state.values() for v in s.values())}


def learnable(n: int = 64, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of 8 of a linear target, for the loss-falls checks."""
    data = P.regression_data(n, seed=seed)
    return list(DataLoader(data, batch_size=8))
