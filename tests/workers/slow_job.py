"""Worker for tests/test_launch.py: a slow training job with checkpoints, to be preempted.

Each optimizer update takes at least 50 ms; after update 2 rank 0 writes ``DIR/ready``, the
moment a test may send a signal to the launcher. On SIGTERM ``run`` saves a checkpoint in
``DIR/ckpts`` and exits with 143.

Usage: accelfn launch ... slow_job.py --out DIR
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import accelfn as af


class Slow:
    """A tracker that makes each logged update last 50 ms and marks update 2 in ``ready``."""

    def __init__(self, ready: Path | None):
        self.ready = ready

    def log(self, metrics: dict, step: int) -> None:
        if step == 2 and self.ready is not None:
            self.ready.write_text("2")
        time.sleep(0.05)

    def close(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.01))
    data = [(torch.randn(4, 4), torch.randn(4, 1)) for _ in range(16)]
    step = af.compose(af.shard_data(), af.replicate())(af.train_step(lambda m, b: F.mse_loss(m(b[0]), b[1])))
    backend = af.backends.auto()
    ready = args.out / "ready" if backend.is_main_process else None
    af.run(step, state, data, backend=backend, epochs=1000, progress=False, trackers=[Slow(ready)],
           checkpoints=af.Checkpoints(args.out / "ckpts", every_steps=10_000))


if __name__ == "__main__":
    main()
