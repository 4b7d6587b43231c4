"""A training script for the preemption and restart tests, run as its own process(es).

Usage (one process, or under ``torchrun``/``accelfn launch``)::

    python tests/workers/resume_script.py CHECKPOINTS RESULT LOGDIR [--interrupt KIND:RANK:CALL] [--workers N]

Trains ``tests._states``' job for 3 epochs with ``Checkpoints(CHECKPOINTS, every_steps=2
or 4)`` and ``resume="auto"``, then saves the final state at RESULT. With ``--interrupt``,
the loss function of rank RANK, at its CALL-th micro-batch (counting from 1) and only if
``LOGDIR/interrupted`` does not exist yet, creates that marker and then either exits at
once (``exit``: ``os._exit(1)``, a crash), sends itself SIGTERM (``sigterm``), or sends
SIGTERM to its whole process group, DataLoader workers included (``sigterm-group``, as a
scheduler does; start the script in a session of its own). ``--workers N`` loads the data
with N DataLoader worker processes. Each process appends ``attempt latest calls step micro_step`` to ``LOGDIR/rank<r>.log``.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import accelfn as af
from tests.helpers.states import build, loader, loss_fn, program

BATCH_SIZE = 4
NUM_SAMPLES = 40
EPOCHS = 3


def total_steps(world_size: int) -> int:
    """Optimizer updates of the job: accumulate(2) over each rank's micro-batches per epoch."""
    per_rank = NUM_SAMPLES // world_size // BATCH_SIZE
    return EPOCHS * -(-per_rank // 2)


def job(world_size: int, *, interrupt: tuple[str, int, int] | None = None, marker: Path | None = None,
        rank: int = 0, workers: int = 0) -> tuple[af.Step, af.TrainState, object, list[int]]:
    """The program, the initial state, the data, and a one-item list counting loss calls."""
    calls = [0]

    def counted_loss(model, batch):
        calls[0] += 1
        if interrupt is not None and (rank, calls[0]) == interrupt[1:] and not marker.exists():
            marker.touch()
            if interrupt[0] == "exit":
                os._exit(1)
            if interrupt[0] == "sigterm-group":
                # from another process, as a scheduler's (workers take their parent's SIGTERM
                # for a shutdown); the step goes on while the workers get it too
                subprocess.run(["kill", "-TERM", "--", f"-{os.getpgrp()}"], check=False)
                time.sleep(0.5)
            else:
                os.kill(os.getpid(), signal.SIGTERM)
        return loss_fn(model, batch)

    step = program(af.replicate())
    step = af.Step(counted_loss, step.transforms)
    return step, build(0, total_steps=total_steps(world_size)), loader(NUM_SAMPLES, BATCH_SIZE, workers), calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoints", type=Path)
    parser.add_argument("result", type=Path)
    parser.add_argument("logdir", type=Path)
    parser.add_argument("--interrupt", default=None)
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()
    random.seed(0)  # every process starts its generators alike, so runs can be compared whole
    np.random.seed(0)
    backend = af.backends.auto()
    interrupt = None
    if args.interrupt:
        kind, rank, call = args.interrupt.split(":")
        interrupt = (kind, int(rank), int(call))
    args.logdir.mkdir(parents=True, exist_ok=True)
    step, state, data, calls = job(backend.world_size, interrupt=interrupt, marker=args.logdir / "interrupted",
                                   rank=backend.rank, workers=args.workers)
    checkpoints = af.Checkpoints(args.checkpoints, every_steps=2 if backend.world_size > 1 else 4)
    latest = checkpoints.latest()
    state = af.run(step, state, data, backend=backend, epochs=EPOCHS, checkpoints=checkpoints, resume="auto",
                   progress=False)
    af.save(state, args.result, backend=backend)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "-")
    with open(args.logdir / f"rank{backend.rank}.log", "a") as log:
        print(attempt, latest.name if latest else None, calls[0], state.step, state.micro_step, file=log)


if __name__ == "__main__":
    sys.exit(main())
