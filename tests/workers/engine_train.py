"""A training script started by other engines than torchrun (Slurm's srun, mpirun, their variables).

Usage: python engine_train.py OUT [--checkpoints DIR] [--hold-at CALL]

Trains ``tests.helpers.programs``' regression job for 2 epochs under shard_data + replicate +
accumulate(2) + clip with ``af.backends.auto()``, whatever started it. Each rank writes
``OUT/rank{r}.json`` (the engine accelfn detected, rank, world size, local rank and size);
rank 0 writes the final parameters to ``OUT/params.safetensors``. With ``--checkpoints DIR``
it saves every 2 updates there and resumes from the latest (``resume="auto"``). With
``--hold-at CALL``, rank 0's CALL-th loss call (if ``OUT/held`` does not exist yet) creates
``OUT/held`` and then waits until ``OUT/go`` exists: a test signals the job meanwhile.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import safetensors.torch
from torch.utils.data import DataLoader

import accelfn as af
from tests.helpers import programs as P


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--checkpoints", type=Path)
    parser.add_argument("--hold-at", type=int)
    args = parser.parse_args()
    backend = af.backends.auto()
    env = backend.env
    calls = [0]

    def loss(model, batch):
        calls[0] += 1
        held = args.out / "held"
        if env.rank == 0 and calls[0] == args.hold_at and not held.exists():
            held.touch()
            deadline = time.monotonic() + 120
            while not (args.out / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return P.mse(model, batch)

    step = af.compose(af.shard_data(seed=P.SHARD_SEED), af.replicate(), af.accumulate(2), af.clip(0.05))(
        af.train_step(loss))
    loader = DataLoader(P.regression_data(), batch_size=P.PER_RANK_BATCH, shuffle=True)
    checkpoints = None if args.checkpoints is None else af.Checkpoints(args.checkpoints, every_steps=2)
    (args.out / f"rank{env.rank}.json").write_text(json.dumps({
        "engine": env.engine, "rank": env.rank, "world_size": env.world_size, "local_rank": env.local_rank,
        "local_world_size": env.local_world_size}))
    state = af.run(step, P.make_state(), loader, backend=backend, epochs=2, progress=False, checkpoints=checkpoints,
                   resume="auto" if checkpoints is not None else None)
    if env.rank == 0:
        safetensors.torch.save_file(P.parameters(state), args.out / "params.safetensors")


if __name__ == "__main__":
    main()
