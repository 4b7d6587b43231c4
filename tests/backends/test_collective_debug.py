"""``ACCELFN_DEBUG_COLLECTIVES=1``: every collective is checked across ranks first, so one
that differs (another shape, reduce op or function) is named on every rank at once, instead
of hanging until the process group's timeout or reducing silently with mixed ops; off, a
collective makes no call more (tests/workers/collective_debug.py, 2 real gloo processes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import launch as L

pytestmark = pytest.mark.multiprocess
TIMEOUT_S = 120  # the process group's: a check that waited for it would take this long
WORKER = "tests/workers/collective_debug.py"


def _ranks(tmp_path: Path, **env: str) -> list[dict[str, Any]]:
    L.launch("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", str(TIMEOUT_S), script="collective_debug.py",
             script_args=(tmp_path,), env=L.environment(**env), cwd=L.ROOT, timeout_s=300)
    return L.read_ranks(tmp_path, 2)


@pytest.fixture(scope="module")
def debugged(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _ranks(tmp_path_factory.mktemp("debug"), ACCELFN_DEBUG_COLLECTIVES="1")


@pytest.mark.parametrize(("case", "differ", "rank0", "rank1"), [
    ("shape", "shape", "reduce(op='sum', shape=[3], dtype='float32')", "reduce(op='sum', shape=[5], dtype='float32')"),
    ("op", "op", "reduce(op='sum', shape=[3], dtype='float32')", "reduce(op='max', shape=[3], dtype='float32')"),
    ("call", "call, src, op", "broadcast(src=0, shape=[3], dtype='float32')",
     "reduce(op='mean', shape=[3], dtype='float32')"),
])
def test_a_collective_that_differs_is_named_on_every_rank_at_once(debugged: list[dict[str, Any]], case: str,
                                                                   differ: str, rank0: str, rank1: str) -> None:
    """A reduce of shapes (3,) and (5,), a reduce with "sum" on rank 0 and "max" on rank 1
    (which gloo would compute silently), and a broadcast on rank 0 against a reduce on rank 1
    each raise the same ValueError on both ranks within seconds (the group's timeout is 120
    s), naming each rank's call, what differs, and the line of the script that made it; the
    process group works on afterwards."""
    line = {"shape": 43, "op": 44, "call": 45}[case]
    expected = (f"the ranks are making different collective calls (checked by ACCELFN_DEBUG_COLLECTIVES=1; they "
                f"differ in {differ}): rank 0: {rank0} at {WORKER}:{line} (<lambda>); rank 1: {rank1} at "
                f"{WORKER}:{line} (<lambda>). Every rank must make")
    for rank in debugged:
        assert rank[case]["error"].startswith(expected), rank[case]["error"]
        assert rank[case]["seconds"] < 10
        assert rank["after"] == [3.0, 3.0]


def test_debug_mode_switches_on_torchs_own_checks(debugged: list[dict[str, Any]]) -> None:
    """With the mode on, torch's debug level is DETAIL (its ProcessGroupWrapper checks the
    collectives DDP and FSDP make), and a checked reduce makes 3 collectives (2 of the check)."""
    for rank in debugged:
        assert rank["debugging"] is True and rank["torch_debug"] == "DebugLevel.DETAIL"
        assert rank["collectives_per_5_reduces"] == 15


def test_without_the_mode_a_collective_makes_no_call_more(tmp_path: Path) -> None:
    """Off (the default), the check is off, torch's debug level untouched, and 5 reduces are
    5 collectives of the process group: nothing is added on the hot path but a flag's test."""
    for rank in _ranks(tmp_path):
        assert rank["debugging"] is False and rank["torch_debug"] == "DebugLevel.OFF"
        assert rank["collectives_per_5_reduces"] == 5


def test_the_flag_is_checked() -> None:
    """ACCELFN_DEBUG_COLLECTIVES takes 1/0/true/false, naming the variable otherwise."""
    import accelfn as af
    from accelfn.distributed.env import LaunchEnv

    assert LaunchEnv.from_env({"ACCELFN_DEBUG_COLLECTIVES": "1"}).debug_collectives is True
    assert LaunchEnv.from_env({}).debug_collectives is False
    with pytest.raises(af.LaunchError, match=r"ACCELFN_DEBUG_COLLECTIVES='yes' must be 1 or 0"):
        LaunchEnv.from_env({"ACCELFN_DEBUG_COLLECTIVES": "yes"})
