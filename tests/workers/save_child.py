"""Child process for the crash test: saves a ~100 MB state over an existing checkpoint, in rounds.

Usage: ``python tests/workers/save_child.py PATH``. Writes the "old" checkpoint (every parameter
1.0, step 1) at PATH, then, for each ``round`` line on stdin: writes the old checkpoint over
whatever is at PATH (timed: a replace, which also removes what a killed save left), prints
``ready <seconds that replace took>``, waits for a ``go`` line, forks a process that saves the
"new" state (every parameter 2.0, step 2) over it, prints ``child <its pid>``, and once that
process has ended (the test SIGKILLs it at some moment of its save) prints ``ended``. EOF or
``quit`` ends it. One process imports torch and builds the model once for all rounds; each
save that is killed runs in a process of its own, as a crashing job's would.
"""

from __future__ import annotations

import os
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
    torch.set_num_threads(1)  # no OpenMP threads: the forked savers start from one thread
    model = make_model()
    af.save(state_at(model, 1.0, 1), path)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        old = state_at(model, 1.0, 1)
        start = time.perf_counter()
        af.save(old, path)
        print(f"ready {time.perf_counter() - start:.6f}", flush=True)
        sys.stdin.readline()  # go
        pid = os.fork()
        if pid == 0:  # the saver: killed during this save, or done
            af.save(state_at(model, 2.0, 2), path)
            os._exit(0)
        print(f"child {pid}", flush=True)
        os.waitpid(pid, 0)
        print("ended", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
