"""Small scenarios for the worker pool's own tests (tests/test_worker_pool.py), run on every
rank by tests/workers/pool.py: each returns JSON, or fails the way the test names."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch

import accelfn as af


def world(mark: str = "") -> dict[str, Any]:
    """The rank's view of a fresh worker: its process group, RNG, environment, directory and
    handlers; then it changes all of them (``mark``), which the next scenario must not see."""
    backend = af.backends.auto()
    seen = {
        "rank": backend.rank, "world_size": backend.world_size, "backend": backend.name,
        "master_port": backend.env.master_port,
        "sum_of_ranks_plus_one": backend.reduce(torch.tensor([float(backend.rank + 1)]), "sum").item(),
        "first_draw": torch.rand(3).tolist(),
        "marked_env": os.environ.get("POOL_SCENARIO_MARK"), "cwd": os.getcwd(),
        "sigterm_default": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
        "asked_env": os.environ.get("POOL_ASKED"),
    }
    torch.rand(100)
    os.environ["POOL_SCENARIO_MARK"] = mark
    os.chdir("/")
    signal.signal(signal.SIGTERM, lambda *_: None)
    return seen


def fail_on(rank: int) -> None:
    """Rank ``rank`` raises while the other ranks wait for it in a collective."""
    backend = af.backends.auto()
    if backend.rank == rank:
        print(f"rank {rank} is about to fail")
        raise ValueError(f"boom on rank {rank}")
    torch.distributed.barrier()


def die_on(rank: int) -> None:
    """Rank ``rank``'s process ends at once (a crash), the others wait for it in a collective."""
    backend = af.backends.auto()
    if backend.rank == rank:
        os._exit(3)
    torch.distributed.barrier()
