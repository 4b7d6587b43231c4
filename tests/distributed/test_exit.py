"""Leaving the process group at exit: no abort when gloo's threads still own collectives, and no
wait for ranks that went on when one rank's ``af.run``/``af.evaluate`` ended by an exit.

Without accelfn's exit handler (``accelfn.distributed.process_group``) a gloo worker thread could free a
finished collective's tensors after the interpreter began to finalize, and the process
aborted (``terminate called without an active exception``) after a complete run.

The jobs that exit are real launches; the check that calls the exit handler itself runs in the
session's pool of started workers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import launch as _launch
from tests.helpers.pool import Pools

pytestmark = pytest.mark.multiprocess
POOL = ("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60")


def test_a_sharded_job_ending_with_a_collective_in_flight_exits_cleanly(tmp_path: Path) -> None:
    """Two FSDP2 ranks that end their script while an all-reduce still runs exit 0, without
    an abort message."""
    done = _launch.launch("--nproc-per-node", "2", script="exit_in_flight.py", script_args=("exit", "--out", tmp_path))
    assert "terminate called" not in done.stderr


def test_the_exit_barrier_keeps_the_collectives_it_waited_for_until_the_main_thread_frees_them(
        pool: Pools, tmp_path: Path) -> None:
    """After the exit handler, rank 0's unwaited all-reduce (in flight when the handler began:
    rank 1 joins it 0.3 s later; done: its sum is 2.0) is still owned by the kept barrier,
    0.5 s later too, so no gloo thread frees its tensor; the group is destroyed on both ranks,
    and the tensor is released when the barrier is let go. (Rank 1's all-reduce may end
    before its handler begins, and is then freed already.)"""
    pool.launch(*POOL, script="exit_in_flight.py", script_args=("owner", "--out", tmp_path))
    first = json.loads((tmp_path / "rank0.json").read_text())
    assert first["after_leave"] == first["later"] > 1
    for rank in (0, 1):
        counts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert counts == {**counts, "released": 1, "sum": 2.0, "initialized": False}


def _exits(mode: str) -> Any:
    """``exits.py MODE`` on 2 ranks with a 600 s collective timeout: a rank waiting it out would
    outlast the test's own limit (180 s), which then fails the test."""
    return _launch.launch("--nproc-per-node", "2", "--timeout-s", "600", script="exits.py", script_args=(mode,),
                          timeout_s=180, check=False)


def test_sys_exit_in_a_hook_on_one_rank_ends_the_job_naming_the_rank_and_the_exit() -> None:
    """Rank 0's hook calls sys.exit("loss diverged") while rank 1 goes on: rank 0 leaves without
    the exit barrier, saying so, and the job ends with rank 0's status 1 (not at the timeout)."""
    done = _exits("hook")
    assert done.returncode == 1, done.stderr[-4000:]
    assert ("accelfn: rank 0 of 2: af.run ended by SystemExit('loss diverged') (sys.exit, exit status 1) on this "
            "rank, while rank(s) 1 went on") in done.stderr


def test_sys_exit_0_inside_evaluate_on_one_rank_ends_the_job() -> None:
    """Rank 1's evaluation fn calls sys.exit(0) while rank 0 goes on into the outputs' gather:
    rank 1 leaves at once, naming itself, and rank 0's gather fails as rank 1's connection closes."""
    done = _exits("evaluate")
    assert done.returncode != 0
    assert "evaluate returned" not in done.stdout
    assert ("accelfn: rank 1 of 2: af.evaluate ended by SystemExit(0) (sys.exit, exit status 0) on this rank, "
            "while rank(s) 0 went on") in done.stderr


def test_every_rank_exiting_in_the_same_hook_leaves_together() -> None:
    """Every rank's hook calls sys.exit(3) at update 2: the ranks find one another at exit and
    meet in the exit barrier (no rank says it left alone); the job's status is 3."""
    done = _exits("together")
    assert done.returncode == 3, done.stderr[-4000:]
    assert "went on; leaving without waiting" not in done.stderr
    assert "terminate called" not in done.stderr
