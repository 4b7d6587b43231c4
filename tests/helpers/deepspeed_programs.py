"""Programs shared by the ``deepspeed()`` worker (2 processes) and its single-process references.

The model is ``Blocks`` of ``tests.helpers.sharded`` (4 -> 16, three 16 x 16 tanh blocks,
16 -> 1) on ``NUM_SAMPLES`` regression samples read in order (``shuffle=False``): under
``shard_data`` rank r reads samples r, r + 2, ..., so each update of ``n`` micro-batches of
``PER_RANK_BATCH`` on 2 ranks is the next ``6 n`` consecutive samples of the dataset.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from tests.helpers import programs as P
from tests.helpers.sharded import Blocks

#: where DeepSpeed's JIT-built C++ ops are kept between runs: outside the repository, built once per machine
EXTENSIONS = os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "accelfn" / "torch_extensions"))
NUM_SAMPLES = 60
PER_RANK_BATCH = 3
WORLD_SIZE = 2
UPDATES = 10
LR = 1e-2
CLIP = 1.0

#: name -> (ZeRO section of the config, accumulate n, clip max_norm or None)
ZERO = {
    "s1": {"stage": 1},
    "s2": {"stage": 2},
    "s3": {"stage": 3, "stage3_param_persistence_threshold": 0},  # small parameters partitioned too
    "s3_offload": {"stage": 3, "stage3_param_persistence_threshold": 0,
                   "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
}
CASES: dict[str, tuple[str, int, float | None]] = {
    **{f"{z}_plain": (z, 1, None) for z in ZERO},
    **{f"{z}_acc2_clip": (z, 2, CLIP) for z in ZERO},
}


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return Blocks()


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR)


def make_sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum and weight decay: not on DeepSpeed's list of ZeRO-tested optimizers."""
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=0.01)


def make_warmup(optimizer: torch.optim.Optimizer) -> Any:
    """DeepSpeed's own WarmupLR (what a ds_config "scheduler" section builds), as a TrainState's
    scheduler: from 0 to 10 x LR over 6 updates, log-shaped."""
    from deepspeed.runtime.lr_schedules import WarmupLR

    return WarmupLR(optimizer, warmup_min_lr=0.0, warmup_max_lr=10 * LR, warmup_num_steps=6)


def loader() -> DataLoader:
    return DataLoader(P.regression_data(NUM_SAMPLES), batch_size=PER_RANK_BATCH, shuffle=False)


def epochs(n: int) -> int:
    """Epochs of ``n``-micro-batch windows that make ``UPDATES`` updates on 2 ranks."""
    per_epoch = NUM_SAMPLES // (WORLD_SIZE * PER_RANK_BATCH * n)
    assert UPDATES % per_epoch == 0
    return UPDATES // per_epoch


def hand_written(n: int, max_norm: float | None, *, sgd_warmup: bool = False,
                 lrs: list[float] | None = None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, no accelfn, no DeepSpeed engine: ``UPDATES`` AdamW updates (or, with
    ``sgd_warmup``, ``make_sgd``'s with ``make_warmup`` stepped after each), each on the mean
    squared error of the next ``6 n`` samples, the gradient clipped to ``max_norm`` (if
    given); returns the parameters and the norms before clipping (and appends each update's
    lr to ``lrs``)."""
    model = make_model()
    optimizer = make_sgd(model) if sgd_warmup else make_optimizer(model)
    scheduler = make_warmup(optimizer) if sgd_warmup else None
    x, y = P.regression_data(NUM_SAMPLES).tensors
    size = WORLD_SIZE * PER_RANK_BATCH * n
    norms = []
    for update in range(UPDATES):
        start = (update * size) % NUM_SAMPLES
        loss = F.mse_loss(model(x[start:start + size]), y[start:start + size])
        loss.backward()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        if lrs is not None:
            lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def to_json(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {k: v.double().flatten().tolist() for k, v in tensors.items()}
