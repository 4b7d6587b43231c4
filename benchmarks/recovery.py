"""Seconds from a kill to the next applied update: an elastic launch (torchrun) and replica groups
(``af.tolerate_faults``, torchft), on loopback, with the fault tests' job (tests/workers/faults.py).

    PYTHONPATH=$PWD python benchmarks/recovery.py [--repeats 3]

Elastic: two nodes (``--nnodes 1:2``, one process each, a checkpoint every update); node 1's
launcher and worker get SIGKILL; measured until node 0's worker, restarted at world size 1 and
resumed from the newest checkpoint, applies an update; then node 1 is started again, measured
until the job applies an update at world size 2. Replica groups: two groups of one process
(group 0's launch serving the lighthouse, its defaults: a group silent for 5 s is left out);
group 1's launcher and worker get SIGKILL; measured until group 0 applies an update alone;
then group 1 is started again, measured until it applies an update after copying group 0's state.
Each update waits 0.2 s, so an update is never more than that away. Prints one table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.helpers import faults
from tests.helpers import launch as _launch

TICK = "0.2"


def _first_after(path: Path, start: int, when: Callable[[dict[str, Any]], bool]) -> Callable[[], dict[str, Any] | None]:
    def found() -> dict[str, Any] | None:
        return next((p for p in faults.lines(path)[start:] if when(p)), None)
    return found


def _wait(what: str, found: Callable[[], Any], jobs: tuple[Any, ...]) -> Any:
    faults.wait_for(what, lambda: found() is not None, jobs=jobs, timeout_s=600)
    return found()


def elastic(root: Path) -> tuple[float, float]:
    """(seconds from the kill to the survivor's next update, from the restart to an update of 2 nodes)."""
    out = root / "elastic"
    out.mkdir()
    port = _launch.free_port()
    args = ("--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench",
            "--max-restarts", "3", "--rdzv-conf", "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3",
            "--backend", "cpu", "--timeout-s", "120")
    progress = out / "progress-None.jsonl"
    with faults.Jobs() as jobs:
        (out / "tick").write_text(TICK)
        node0 = jobs.start(out, *args, script_args=("--checkpoints",))
        faults.wait_for("node 0's store", lambda: faults.accepts(port), jobs=(node0,))
        node1 = jobs.start(out, *args, script_args=("--checkpoints",))
        _wait("5 updates on 2 nodes", _first_after(progress, 0, lambda p: p["world"] == 2 and p["step"] >= 5),
              (node0, node1))
        seen = len(faults.lines(progress))
        killed = time.time()
        faults.kill_node(node1)
        first = _wait("an update on 1 node", _first_after(progress, seen, lambda p: p["world"] == 1), (node0,))
        (out / "tick").write_text("3")
        seen = len(faults.lines(progress))
        started = time.time()
        node1 = jobs.start(out, *args, script_args=("--checkpoints",))
        again = _wait("an update on 2 nodes", _first_after(progress, seen, lambda p: p["world"] == 2), (node0, node1))
        (out / "tick").write_text("0")
        for job in (node0, node1):
            _launch.assert_ok(_launch.finish(job))
    return first["time"] - killed, again["time"] - started


def replica_groups(root: Path) -> tuple[float, float]:
    """(seconds from the kill to the survivor's next update, from the restart to the healed group's first)."""
    out = root / "groups"
    out.mkdir()
    port = _launch.free_port()

    def args(group: int, *extra: str) -> tuple[str, ...]:
        return ("--nproc-per-node", "1", "--backend", "cpu", "--timeout-s", "120", "--replica-group", str(group),
                "--lighthouse", f"localhost:{port}", *extra)

    progress0, progress1 = out / "progress-0.jsonl", out / "progress-1.jsonl"
    with faults.Jobs() as jobs:
        (out / "tick").write_text(TICK)
        group0 = jobs.start(out, *args(0, "--serve-lighthouse"), script_args=("--ft",))
        group1 = jobs.start(out, *args(1), script_args=("--ft",))
        _wait("5 updates of both groups", _first_after(progress1, 0, lambda p: p["step"] >= 5 and p["replicas"] == 2),
              (group0, group1))
        seen = len(faults.lines(progress0))
        killed = time.time()
        faults.kill_node(group1)
        first = _wait("an update of group 0 alone", _first_after(progress0, seen, lambda p: p["replicas"] == 1),
                      (group0,))
        (out / "tick").write_text("3")
        seen = len(faults.lines(progress1))
        started = time.time()
        group1 = jobs.start(out, *args(1), script_args=("--ft",))
        again = _wait("group 1's first update after healing", _first_after(progress1, seen, lambda p: True),
                      (group0, group1))
        (out / "tick").write_text("0")
        for job in (group0, group1):
            _launch.assert_ok(_launch.finish(job))
    return first["time"] - killed, again["time"] - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    repeats = parser.parse_args().repeats
    rows: dict[str, list[tuple[float, float]]] = {"elastic launch (torchrun, --nnodes 1:2)": [],
                                                   "replica groups (tolerate_faults, torchft)": []}
    loads = []
    for _ in range(repeats):
        for name, measure in zip(rows, (elastic, replica_groups)):
            with tempfile.TemporaryDirectory() as root:
                loads.append(os.getloadavg()[0])
                rows[name].append(measure(Path(root)))
    print(f"{repeats} repeats each; load average {min(loads):.1f}-{max(loads):.1f} (1 min)\n")
    print("| | kill to next applied update, s (median, range) | restart to an update with it back, s |")
    print("| --- | ---: | ---: |")
    for name, values in rows.items():
        lost = [v[0] for v in values]
        back = [v[1] for v in values]
        print(f"| {name} | {statistics.median(lost):.1f} ({min(lost):.1f}-{max(lost):.1f}) | "
              f"{statistics.median(back):.1f} ({min(back):.1f}-{max(back):.1f}) |")


if __name__ == "__main__":
    main()
