"""Processes started with only Slurm's or Open MPI's variables (plain ``python``, no torchrun)
train as one world, bitwise equal to ``accelfn launch`` (the reference run: in the session's pool of
started 2-process workers)."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from tests.helpers import launch as _launch
from tests.helpers.pool import Pools

pytestmark = pytest.mark.multiprocess
SCRIPT = _launch.WORKERS / "engine_train.py"


def slurm_task(rank: int, port: int) -> dict[str, str]:
    """What ``srun --ntasks=2`` sets for task ``rank`` on one node (job id chosen so that the
    derived port is ``port``)."""
    return {"SLURM_JOB_ID": str(port - 10000), "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2",
            "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2",
            "SLURM_STEP_NODELIST": "localhost", "SLURM_JOB_NODELIST": "localhost"}


def mpi_rank(rank: int, port: int) -> dict[str, str]:
    """What Open MPI's ``mpirun -np 2`` sets for rank ``rank`` on one node, and MASTER_PORT."""
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_PORT": str(port)}


def free_port_below_30000() -> int:
    """A TCP port in Slurm's derived range (10000..29999) that was free a moment ago."""
    for port in random.sample(range(10000, 30000), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port in 10000..29999")


def started_by(variables: object, out: Path) -> list[dict]:
    """Runs SCRIPT as two plain processes, each with only the engine's variables for its rank."""
    out.mkdir()
    port = free_port_below_30000()
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(out)], env=_launch.environment(**variables(r, port)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for r in range(2)]
    for proc in procs:
        _launch.assert_ok(_launch.finish(proc))
    return _launch.read_ranks(out, 2)


def test_slurm_and_open_mpi_tasks_train_as_two_ranks_like_accelfn_launch(pool: Pools, tmp_path: Path) -> None:
    """Two processes with only Slurm's (then Open MPI's) variables detect their engine, form a
    world of 2, and end with parameters bitwise equal to those of a 2-process `accelfn launch`
    (its workers in the pool, which detect torchrun)."""
    reference = tmp_path / "launch"
    reference.mkdir()
    pool.launch("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60", script=SCRIPT,
                script_args=(reference,))
    expected = safetensors.torch.load_file(reference / "params.safetensors")
    assert [r["engine"] for r in _launch.read_ranks(reference, 2)] == ["torchrun"] * 2
    for engine, variables in (("slurm", slurm_task), ("openmpi", mpi_rank)):
        ranks = started_by(variables, tmp_path / engine)
        assert ranks == [{"engine": engine, "rank": r, "world_size": 2, "local_rank": r, "local_world_size": 2}
                         for r in range(2)], json.dumps(ranks)
        got = safetensors.torch.load_file(tmp_path / engine / "params.safetensors")
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(got[name], value), f"{engine}: {name} differs from accelfn launch's"
