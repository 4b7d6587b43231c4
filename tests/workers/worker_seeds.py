"""Worker for tests/data/test_worker_seeds.py: the random augmentation each rank's DataLoader workers draw.

Usage: accelfn launch --nproc-per-node 2 aug_seeds.py --out DIR
Each rank writes DIR/rank{r}.json: per epoch, the (indices, torch noise, numpy noise) of each
batch of a map-style dataset (drawn per sample) and of a stream (drawn per pass of each of
the 2 workers) under shard_data(), plus
epoch 1 of both read again from micro-batch 2 (as a resumed run reads it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

import accelfn as af

NUM_SAMPLES, BATCH_SIZE, SEED = 16, 2, 5


class Noisy(Dataset):
    """Sample ``i`` is ``(i, torch.rand(1), np.random.rand(1))``: an augmentation's draws."""

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.tensor(i), torch.rand(1), torch.from_numpy(np.random.rand(1))


class NoisyStream(IterableDataset):
    """Items ``(i, t, n)``: ``t``, ``n`` drawn once per pass by each worker (as a shuffle buffer's order)."""

    def __iter__(self) -> Any:
        t, n = torch.rand(1), torch.from_numpy(np.random.rand(1))
        return ((torch.tensor(i), t, n) for i in range(NUM_SAMPLES))


def read(batches: Any) -> list[list[list[float]]]:
    return [[b[0].tolist(), b[1].flatten().tolist(), b[2].flatten().tolist()] for b, _ in batches]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    backend = af.backends.auto()
    torch.manual_seed(0)  # the same global seed on every rank: the workers must differ anyway
    np.random.seed(0)
    step = af.compose(af.shard_data(seed=SEED), af.replicate())(af.train_step(lambda m, b: m(b).sum()))
    loader = DataLoader(Noisy(), batch_size=BATCH_SIZE, shuffle=True, num_workers=2)
    stream = DataLoader(NoisyStream(), batch_size=BATCH_SIZE, num_workers=2)
    result = {
        "map": [read(backend.batches(loader, step, epoch)) for epoch in (0, 1)],
        "map_resumed": read(backend.batches(loader, step, 1, start=2)),
        "stream": [read(backend.batches(stream, step, epoch)) for epoch in (0, 1)],
        "stream_resumed": read(backend.batches(stream, step, 1, start=2)),
    }
    (out / f"rank{backend.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
