"""Starting, watching and killing the jobs of the fault tests (tests/workers/faults.py): a
launch's whole process tree (a node: the launcher and its workers, which torchrun starts in
sessions of their own), progress files read as they grow, and the uninterrupted reference
(run once per test session, for every fault test that compares with it)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

from tests.helpers import launch as _launch

WORKER = _launch.WORKERS / "faults.py"


class Jobs:
    """The processes a test started; on leaving the ``with`` block, those still running are
    killed with their workers (a failed test leaves nothing behind)."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen] = []

    def __enter__(self) -> Jobs:
        return self

    def __exit__(self, *exc: object) -> None:
        for job in self.started:
            if job.poll() is None:
                kill_node(job)
            else:
                job.communicate()

    def start(self, out: Path, *launch_args: str, script_args: tuple[str, ...] = ()) -> subprocess.Popen:
        """``accelfn launch LAUNCH_ARGS... faults.py --out OUT SCRIPT_ARGS...``, started."""
        job = _launch.start("launch", *launch_args, WORKER, "--out", out, *script_args)
        self.started.append(job)
        return job

    def process(self, *command: str, **kwargs: Any) -> subprocess.Popen:
        """Any other process, started in its own session."""
        job = subprocess.Popen(list(command), start_new_session=True, **kwargs)
        self.started.append(job)
        return job


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (from /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def workers(launcher: subprocess.Popen) -> list[int]:
    """The worker processes of a launch (the children of its launcher)."""
    return children(launcher.pid)


def kill_node(launcher: subprocess.Popen) -> list[int]:
    """SIGKILL to a launch's launcher and every worker it started (a node lost); returns them."""
    pids = [launcher.pid, *workers(launcher)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if launcher.stdout is not None:
        launcher.communicate(timeout=30)  # its pipes closed too
    else:
        launcher.wait(timeout=30)
    return pids


def accepts(port: int) -> bool:
    """Whether something listens on ``127.0.0.1:port``."""
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines written to ``path`` so far (none if it does not exist yet)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip().endswith("}")]


def wait_for(what: str, ready: Callable[[], bool], *, jobs: tuple[subprocess.Popen, ...] = (),
             timeout_s: float = 200) -> None:
    """Polls ``ready`` until it holds; fails naming ``what`` on timeout, or when one of ``jobs``
    exits first (with its output)."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        for job in jobs:
            if job.poll() is not None:
                out, err = job.communicate()
                raise AssertionError(f"waiting for {what}: {' '.join(map(str, job.args))} exited "
                                     f"{job.returncode}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-6000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s} s for {what}")
        time.sleep(0.2)


def final(out: Path, group: int | None) -> dict[str, Any]:
    """What the worker wrote at the end of the run of ``group`` (None: no replica group)."""
    return json.loads((out / f"final-{group}.json").read_text())


def same_run(result: dict[str, Any], reference: dict[str, Any], *, world_size: int = 1) -> None:
    """The counters and the model and optimizer bytes are the one-process reference's (a
    process's ``micro_step`` counts its own micro-batches: ``world_size`` times it is the
    reference's)."""
    keys = ("step", "epoch", "epoch_micro_step", "sha256")
    assert {k: result[k] for k in keys} == {k: reference[k] for k in keys}
    assert result["micro_step"] * world_size == reference["micro_step"]


def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What the uninterrupted run wrote at its end (``final``): ``python faults.py --out OUT``
    on one process (one thread), run once per test session; the xdist workers of the session
    share it (a file lock in their common temporary directory)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the session's, not another's
    out = root / "faults-uninterrupted"
    with FileLock(str(root / "faults-uninterrupted.lock")):
        if not (out / "final-None.json").exists():
            out.mkdir(exist_ok=True)
            done = subprocess.run([sys.executable, str(WORKER), "--out", str(out)], env=_launch.environment(),
                                  capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, f"the uninterrupted run exited {done.returncode}:\n{done.stderr[-6000:]}"
        return final(out, None)
