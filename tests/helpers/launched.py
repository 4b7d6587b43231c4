"""Functions that tests/cli/test_launch_function.py runs with ``af.launch`` (importable by
name, as a spawned worker needs)."""

from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader

import accelfn as af
from tests.helpers import programs as P
from tests.helpers import sockets


def train(batch_size: int) -> dict[str, object]:
    """The program of programs.train_case "e2_acc2_clip" on this world; rank, world size and
    the launch's timeout as the worker saw them, the final parameters, and (where /proc tells)
    the TCP sockets the launching process and every rank listen on while the job runs."""
    backend = af.backends.auto()
    state = P.train_case("e2_acc2_clip", backend, batch_size)
    ranks = backend.gather_object(os.getpid())
    listening = sockets.listening([os.getppid(), *ranks]) if sockets.available() else None
    backend.barrier()  # every rank alive until each has read them
    return {"rank": backend.rank, "world_size": backend.world_size, "timeout_s": os.environ["ACCELFN_TIMEOUT_S"],
            "parameters": {k: v.clone() for k, v in P.parameters(state).items()}, "listening": listening,
            "launcher_pid": os.getppid(), "rank_pids": ranks}


def fail_on_rank(rank: int) -> int:
    """Raises KeyError on ``rank`` after the process group is up; the other ranks wait in a
    collective that the failing rank never joins (the agent must stop them)."""
    backend = af.backends.auto()
    if backend.rank == rank:
        raise KeyError(f"no such key on rank {rank}")
    backend.reduce(torch.ones(1), "sum")
    return backend.rank


def loader_length(num_samples: int) -> int:
    return len(DataLoader(P.regression_data(num_samples), batch_size=3))


class _Opaque:
    def __repr__(self) -> str:
        return "<opaque>"


def fail_with_opaque_argument() -> None:
    """Raises an exception whose argument is no JSON value (it cannot be rebuilt elsewhere)."""
    raise ValueError(_Opaque())
