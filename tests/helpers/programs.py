"""Programs shared by the multi-process workers and the single-process references of the tests.

A worker under ``accelfn launch`` and the test's reference run import the same builders,
so the two differ only in the number of processes and the per-process batch size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

import accelfn as af

NUM_SAMPLES = 28  # 14 per rank: batches of 3,3,3,3,2 — an uneven last batch and a partial window
PER_RANK_BATCH = 3
SHARD_SEED = 3

#: name -> (epochs, transforms besides shard_data and replicate)
TRAIN_CASES: dict[str, tuple[int, tuple[Any, ...]]] = {
    "e1": (1, ()),
    "e2": (2, ()),
    "e1_acc2": (1, (af.accumulate(2),)),
    "e2_acc2": (2, (af.accumulate(2),)),
    "e1_clip": (1, (af.clip(0.05),)),
    "e2_clip": (2, (af.clip(0.05),)),
    "e1_acc2_clip": (1, (af.accumulate(2), af.clip(0.05))),
    "e2_acc2_clip": (2, (af.accumulate(2), af.clip(0.05))),
}


def regression_data(num_samples: int = NUM_SAMPLES, seed: int = 0) -> TensorDataset:
    """``(x, y)`` pairs: x of shape (num_samples, 4), y of shape (num_samples, 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(num_samples, 1, generator=g)
    return TensorDataset(x, y)


def make_state(seed: int = 0) -> af.TrainState:
    """A small MLP with AdamW (lr 1e-2), identical for a given seed."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def train_case(name: str, backend: af.backends.Backend, batch_size: int,
               trackers: tuple[af.Tracker, ...] = ()) -> af.TrainState:
    """Trains a fresh state with case ``name`` of TRAIN_CASES under shard_data + replicate."""
    epochs, transforms = TRAIN_CASES[name]
    step = af.compose(af.shard_data(seed=SHARD_SEED), af.replicate(), *transforms)(af.train_step(mse))
    loader = DataLoader(regression_data(), batch_size=batch_size, shuffle=True)
    return af.run(step, make_state(), loader, backend=backend, epochs=epochs, progress=False, trackers=trackers)


def parameters(state: af.TrainState, prefix: str = "") -> dict[str, torch.Tensor]:
    """The model's parameters by name, detached CPU copies."""
    return {f"{prefix}{k}": v.detach().cpu().clone() for k, v in state.model.state_dict().items()}


class IndexDataset(Dataset):
    """Sample ``i`` is ``(x_i, i)``: training on it records which samples each rank read."""

    def __init__(self, num_samples: int):
        self.x = regression_data(num_samples).tensors[0]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], i


class CountingStream(IterableDataset):
    """The integers ``0..n-1`` as a stream (an IterableDataset with no length)."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self) -> Any:
        return iter(range(self.n))


def token_batches(counts: tuple[int, ...], seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch per entry of ``counts``, of that many "tokens": x (count, 4), y (count, 1)."""
    data = regression_data(sum(counts), seed=seed).tensors
    out, start = [], 0
    for n in counts:
        out.append((data[0][start:start + n], data[1][start:start + n]))
        start += n
    return out


#: per optimizer update: (tokens on rank 0, tokens on rank 1)
TOKEN_COUNTS = ((2, 10), (7, 1), (4, 4))


def summed_mse(model: torch.nn.Module, batch: Any) -> af.Loss:
    x, y = batch
    return af.Loss(total=((model(x) - y) ** 2).sum(), count=x.shape[0])


def rank_token_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s batches for the af.Loss case: update k has TOKEN_COUNTS[k][rank] tokens."""
    batches = []
    for k, counts in enumerate(TOKEN_COUNTS):
        both = token_batches(counts, seed=100 + k)
        batches.append(both[rank])
    return batches


def eval_outputs(model: torch.nn.Module, batch: Any) -> Mapping[str, torch.Tensor]:
    x, index = batch
    return {"prediction": model(x), "index": index}


def rank_stream(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s own batches of 4 when the data is of unknown length: 3 on rank 0, 5 on rank 1."""
    data = regression_data(4 * (3 + 2 * rank), seed=10 + rank)
    return list(DataLoader(data, batch_size=4))
