"""The pool of started workers the multi-process tests share (tests/helpers/pool.py): each
scenario runs as in a fresh worker, and a failure reports the failing rank and spoils no
other test."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import launch as _launch
from tests.helpers.pool import PoolError, Pools

pytestmark = pytest.mark.multiprocess

# a pool of its own, so that the failures these tests cause restart only it
OWN = ("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "30")


def test_each_scenario_runs_in_a_fresh_worker_of_the_same_launch(pool: Pools, tmp_path: Path) -> None:
    """Two scenarios in a row: each rank of a world of 2 joins a new process group (another
    port), draws the same random numbers a fresh worker draws, and sees none of the
    environment, directory and signal handler the first one changed; variables a test asks
    for reach it; the test's directory is the scenario's."""
    env = _launch.environment(POOL_ASKED="yes")
    first = pool.call(*OWN, function="scenarios:world", mark="first", cwd=tmp_path, env=env)
    second = pool.call(*OWN, function="scenarios:world", mark="second", cwd=tmp_path)
    for seen in (first, second):
        assert [r["rank"] for r in seen] == [0, 1]
        assert all(r["world_size"] == 2 and r["backend"] == "cpu" and r["sum_of_ranks_plus_one"] == 3.0
                   for r in seen)
        assert seen[0]["master_port"] == seen[1]["master_port"]
        assert all(r["marked_env"] is None and r["cwd"] == str(tmp_path) and r["sigterm_default"] for r in seen)
    assert first[0]["master_port"] != second[0]["master_port"]
    assert [r["first_draw"] for r in first] == [r["first_draw"] for r in second]
    assert [r["asked_env"] for r in first] == ["yes", "yes"] and [r["asked_env"] for r in second] == [None, None]


def test_a_failing_or_dying_rank_is_reported_and_the_next_scenario_runs(pool: Pools, tmp_path: Path) -> None:
    """A scenario that raises on rank 1 while rank 0 waits for it in a collective fails with
    rank 1's traceback and output (at once, not after the group's timeout); one whose rank 1
    dies fails naming it; after each, the next scenario runs in a new pool."""
    with pytest.raises(PoolError) as failed:
        pool.call(*OWN, function="scenarios:fail_on", rank=1, cwd=tmp_path, timeout_s=60)
    message = str(failed.value)
    assert "=== rank 1 failed:\nTraceback (most recent call last):" in message
    assert "ValueError: boom on rank 1" in message and "rank 1 is about to fail" in message
    assert "=== rank 0 did not finish" in message or "=== rank 0 failed" in message
    started = pool.started
    assert [r["rank"] for r in pool.call(*OWN, function="scenarios:world", cwd=tmp_path)] == [0, 1]
    assert pool.started == started + 1

    with pytest.raises(PoolError, match="=== rank 1 died"):
        pool.call(*OWN, function="scenarios:die_on", rank=1, cwd=tmp_path, timeout_s=60)
    assert [r["rank"] for r in pool.call(*OWN, function="scenarios:world", cwd=tmp_path)] == [0, 1]
    assert pool.started == started + 2
