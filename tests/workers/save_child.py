"""Child process for the crash test: saves a ~100 MB state over an existing checkpoint.

Usage: ``python tests/workers/save_child.py PATH``. Writes the "old" checkpoint (every parameter
1.0, step 1) at PATH twice (the second time over the first, timed), prints ``ready
<seconds that replace took>``, waits for a line on stdin, then saves the "new" state
(every parameter 2.0, step 2) over it and prints ``done``. The test SIGKILLs it at some
moment of that last save.
"""

from __future__ import annotations

import sys
import time

import torch

import accelfn as af


def make_model() -> torch.nn.Module:
    """25 layers of 1024 x 1024 float32: 100 MiB of parameters (and 100 KiB of biases)."""
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(25)])


def state_at(model: torch.nn.Module, value: float, step: int) -> af.TrainState:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1)).replace(step=step, micro_step=step)


def main(path: str) -> None:
    model = make_model()
    old = state_at(model, 1.0, 1)
    af.save(old, path)
    start = time.perf_counter()
    af.save(old, path)
    took = time.perf_counter() - start
    new = state_at(model, 2.0, 2)
    print(f"ready {took:.6f}", flush=True)
    sys.stdin.readline()
    af.save(new, path)
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
