"""Starting real worker processes with ``python -m accelfn launch`` for multi-process tests.

Every process gets the repository root on ``PYTHONPATH`` (accelfn from this checkout, and
the shared helpers as ``tests.helpers``). Launcher and
workers run in their own process session, so a test that times out ends all of them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
WORKERS = TESTS / "workers"
# variables a launch sets itself; an outer launcher's must not leak into the test's jobs
_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "GROUP_RANK", "ACCELFN_BACKEND", "ACCELFN_PRECISION", "ACCELFN_PRECISION_FROM", "ACCELFN_TIMEOUT_S",
                "ACCELFN_ACCUMULATE", "ACCELFN_COMPILE", "ACCELFN_CONFIG_FILE", "ACCELFN_LAUNCHER_SET",
                "ACCELFN_SHARD_PARAMS", "ACCELFN_DEBUG_COLLECTIVES")
DEFAULT_TIMEOUT_S = 240
# other engines' variables (Kubeflow's, a Slurm job's or mpirun's running the tests): not the test jobs'
_ENGINE_PREFIXES = ("PET_", "SLURM_", "OMPI_", "PMI_", "MPI_LOCAL")


def environment(**extra: str) -> dict[str, str]:
    """The test process's environment without launch variables, with accelfn importable."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith(_ENGINE_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    # bytecode caches as on a machine with Python's defaults: the first process compiles the
    # checkout's modules and each later one reads them (where the variable is set, every
    # launched process compiled accelfn and the test workers anew, about 0.1 s each)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.update(extra)
    return env


def accelfn_command(*args: str | os.PathLike[str]) -> list[str]:
    """``python -m accelfn ARGS...`` with this interpreter."""
    return [sys.executable, "-m", "accelfn", *map(str, args)]


def start(*args: str | os.PathLike[str], cwd: Path | None = None,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    """Starts ``python -m accelfn ARGS...`` in a new process session (stdout/stderr captured)."""
    return subprocess.Popen(accelfn_command(*args), cwd=cwd, env=env or environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Waits for ``proc``; on timeout ends its whole process session and fails the test."""
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(map(str, proc.args))} did not finish in {timeout_s} s\n"
                             f"--- stdout\n{out}\n--- stderr\n{err[-6000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def python(*args: str | os.PathLike[str], cwd: Path | None = None, env: dict[str, str] | None = None,
           timeout_s: float = DEFAULT_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``python ARGS...`` with this interpreter and the test environment (``environment()``
    unless ``env``), in its own process session, to completion (any exit code)."""
    proc = subprocess.Popen([sys.executable, *map(str, args)], cwd=cwd, env=env or environment(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    return finish(proc, timeout_s=timeout_s)


def run(*args: str | os.PathLike[str], cwd: Path | None = None, env: dict[str, str] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
    """``python -m accelfn ARGS...`` to completion; with ``check``, a non-zero exit fails the test."""
    result = finish(start(*args, cwd=cwd, env=env), timeout_s=timeout_s)
    if check:
        assert_ok(result)
    return result


def assert_ok(result: subprocess.CompletedProcess) -> None:
    """Fails with the command's output when it exited non-zero."""
    assert result.returncode == 0, (
        f"{' '.join(map(str, result.args))} exited {result.returncode}\n"
        f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-8000:]}"
    )


def launch(*launch_args: str | os.PathLike[str], script: str | os.PathLike[str], script_args: tuple[Any, ...] = (),
           **kwargs: Any) -> subprocess.CompletedProcess:
    """``accelfn launch LAUNCH_ARGS... SCRIPT SCRIPT_ARGS...`` (a worker name is looked up in tests/workers)."""
    path = Path(script)
    if not path.is_absolute() and not path.exists():
        path = WORKERS / path
    return run("launch", *launch_args, path, *map(str, script_args), **kwargs)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for static two-node rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_ranks(out: Path, world_size: int) -> list[dict[str, Any]]:
    """The ``rank{r}.json`` files the workers wrote, in rank order."""
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
