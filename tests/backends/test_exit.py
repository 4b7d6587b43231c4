"""Leaving the process group at exit: no abort when gloo's threads still own collectives.

Without accelfn's exit handler (``accelfn.backends._distributed``) a gloo worker thread could free a
finished collective's tensors after the interpreter began to finalize, and the process
aborted (``terminate called without an active exception``) after a complete run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import launch as _launch

pytestmark = pytest.mark.multiprocess


def test_a_sharded_job_ending_with_a_collective_in_flight_exits_cleanly(tmp_path: Path) -> None:
    """Two FSDP2 ranks that end their script while an all-reduce still runs exit 0, without
    an abort message."""
    done = _launch.launch("--nproc-per-node", "2", script="exit_in_flight.py", script_args=("exit", "--out", tmp_path))
    assert "terminate called" not in done.stderr


def test_the_exit_barrier_keeps_the_collectives_it_waited_for_until_the_main_thread_frees_them(
        tmp_path: Path) -> None:
    """After the exit handler, rank 0's unwaited all-reduce (in flight when the handler began:
    rank 1 joins it 0.3 s later; done: its sum is 2.0) is still owned by the kept barrier,
    0.5 s later too, so no gloo thread frees its tensor; the group is destroyed on both ranks,
    and the tensor is released when the barrier is let go. (Rank 1's all-reduce may end
    before its handler begins, and is then freed already.)"""
    _launch.launch("--nproc-per-node", "2", script="exit_in_flight.py", script_args=("owner", "--out", tmp_path))
    first = json.loads((tmp_path / "rank0.json").read_text())
    assert first["after_leave"] == first["later"] > 1
    for rank in (0, 1):
        counts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert counts == {**counts, "released": 1, "sum": 2.0, "initialized": False}
