"""Worker for tests/test_world_resume.py: resumes and writes checkpoints across world sizes.

Usage: accelfn launch --nproc-per-node 2 world_resume.py --mid CKPT --boundary CKPT --out DIR

On 2 processes: resumes ``--mid`` (written by 1 process in the middle of epoch 0) to the end
of the epoch, resumes ``--boundary`` (written by 1 process at the end of epoch 0) through
epoch 1, and trains a fresh run for 3 updates with a checkpoint at DIR/checkpoints/
step_00000003. Each rank writes DIR/rank{r}.json: the sample indices it read in each part
and the RuntimeWarnings each part raised. The test imports ``job`` for its 1-process side.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import accelfn as af

NUM_SAMPLES = 24
BATCH_SIZE = 2  # per process: 12 micro-batches per epoch on 1 process, 6 on each of 2


class Indexed(Dataset):
    """Sample ``i`` is ``(x_i, i)``, so training records which samples were read."""

    def __init__(self) -> None:
        self.x = torch.randn(NUM_SAMPLES, 3, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], i


def job() -> tuple[af.Step, af.TrainState, DataLoader, list[int]]:
    """The program (shard_data + replicate), a fresh state, the data, and the list of sample
    indices the loss function has read (appended to as it trains)."""
    read: list[int] = []

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, index = batch
        read.extend(int(i) for i in index)
        return F.mse_loss(model(x), torch.zeros(len(x), 1))

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.compose(af.shard_data(seed=5), af.replicate())(af.train_step(loss_fn))
    return step, state, DataLoader(Indexed(), batch_size=BATCH_SIZE, shuffle=True), read


def part(backend: af.backends.Backend, **run_args: Any) -> dict[str, Any]:
    """One run of ``job``: the indices this rank read, the warnings, the final counters."""
    step, state, data, read = job()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = af.run(step, state, data, backend=backend, progress=False, **run_args)
    return {"read": read, "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning],
            "counters": [state.step, state.epoch, state.epoch_micro_step]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mid", type=Path, required=True)
    parser.add_argument("--boundary", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    backend = af.backends.auto()
    record = {
        "mid": part(backend, epochs=1, resume=args.mid),
        "boundary": part(backend, epochs=2, resume=args.boundary),
        "fresh": part(backend, epochs=1, max_steps=3, checkpoints=af.Checkpoints(args.out / "checkpoints",
                                                                                 every_steps=3)),
    }
    (args.out / f"rank{backend.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
