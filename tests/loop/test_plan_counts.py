"""``af.plan``'s counts are what ``run`` does: updates per epoch, total updates, scheduler steps,
and per epoch the samples each rank reads, pads and drops, over data sizes, every sharding,
DataLoader drop_last, accumulate(1..5) with partial windows, max_steps and resumed states, on
1 and 2 processes (real runs) and 3 and 4 ranks (the data path run reads)."""

from __future__ import annotations

import pytest

import accelfn as af
from accelfn.data import epoch_batches
from tests.helpers import planning
from tests.helpers.pool import Pools

TWO = ("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60")


def _check(results: list[dict], case: planning.Case) -> None:
    for result in results:
        planned, ran = result["planned"], result["run"]
        assert planned["updates"] == ran["updates"]
        assert planned["samples"] == ran["samples"]
        assert planned["total"] == ran["total"]
        assert planned["scheduler"] == ran["scheduler"] == ran["total"]
    if case.resume_at == 0 and case.max_steps is None:  # whole epochs: nothing read twice but padding
        dropped, padded = planning.unique_dropped_padded(results, case.size)
        if case.shard is not None or len(results) == 1:
            assert results[0]["planned"]["dropped"] == dropped
            assert results[0]["planned"]["padded_job"] == padded


@pytest.mark.parametrize("case", planning.ONE_PROCESS, ids=lambda c: c.id)
def test_planned_counts_are_what_run_does_on_one_process(cpu, case):
    """On one process, the plan's updates, samples, padding, drops, total and scheduler steps
    per epoch equal what run applied and read."""
    _check([planning.planned_and_run(case, cpu)], case)


@pytest.fixture(scope="module")
def two_processes(pool: Pools):
    """Both ranks' plans and runs of every 2-process case (one pooled scenario)."""
    return pool.call(*TWO, function="plan_checks:counts", timeout_s=300)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", planning.TWO_PROCESSES, ids=lambda c: c.id)
def test_planned_counts_are_what_run_does_on_two_processes(two_processes, case):
    """On two processes, each rank's planned counts equal what its run applied and read, and the
    padding and drops over both ranks are the samples read twice and never."""
    _check([rank[case.id] for rank in two_processes], case)


@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("case", planning.MANY_RANKS, ids=lambda c: c.id)
def test_planned_samples_are_what_each_of_many_ranks_reads(case, world_size):
    """Planned in one process for 3 and 4 ranks, every rank's micro-batches and samples equal
    what the data path of run (epoch_batches) gives that rank, and padding and drops equal the
    samples read twice and never."""
    step, loader = planning.program(case, world_size)
    plan = af.plan(step, planning.fresh_state(), loader, world_size=world_size, epochs=1, trace=False)
    (epoch,) = plan.epochs
    read = []
    for rank in range(world_size):
        batches = [b for b, _ in epoch_batches(loader, step.find(af.ShardData), rank=rank, world_size=world_size,
                                               epoch=0)]
        assert epoch.micro_batches[rank] == len(batches)
        assert epoch.samples[rank] == sum(len(b[2]) for b in batches)
        assert epoch.updates[rank] == -(-len(batches) // case.n)
        read += [i for b in batches for i in b[2].tolist()]
    assert sum(epoch.padded) == len(read) - len(set(read))
    assert epoch.dropped == case.size - len(set(read))


def test_a_million_epochs_plan_as_one_record(cpu):
    """epochs=None with max_steps plans whole epochs alike as one record, and the partial last."""
    step, loader = planning.program(planning.Case(23, n=3), 1)  # 6 micro-batches: 2 updates an epoch
    plan = af.plan(step, planning.fresh_state(), loader, epochs=None, max_steps=2_000_001, trace=False)
    assert [(e.epoch, e.num_epochs, e.updates) for e in plan.epochs] == [(0, 1_000_000, (2,)), (1_000_000, 1, (1,))]
    assert plan.total_updates == 2_000_001
    assert len(plan.epochs) == 2
