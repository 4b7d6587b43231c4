"""``af.count_updates`` says exactly how many optimizer updates ``run`` applies, per epoch and
in total, over data sizes, DataLoader and shard_data drop_last, accumulate(1 or 3) with its
partial windows, and 1 or 2 processes; a OneCycleLR sized by it runs to its end."""

from __future__ import annotations

import pytest
import torch

import accelfn as af
from tests.helpers import counting
from tests.helpers import launch as _launch
from tests.helpers.pool import Pools


@pytest.mark.parametrize("case", counting.CASES, ids=counting.case_id)
def test_count_equals_the_updates_run_applies_on_one_process(cpu, case):
    """On one process, count_updates' per-epoch and total counts are the updates run applied."""
    result = counting.counted_and_run(case, cpu)
    assert result["run_epoch_1"] == result["run_epoch_2"] == result["per_epoch"]
    assert result["run"] == result["total"] == counting.EPOCHS * result["per_epoch"]


def test_the_counts_follow_the_partial_window_and_drop_last(cpu):
    """25 batches of 4 (97..100 samples) under accumulate(3) make 9 updates per epoch (the last
    window holds one micro-batch); the DataLoader's drop_last on 99 samples leaves 24 batches."""
    step, loader = counting.program((100, False, None, 3))
    assert af.count_updates(step, loader, backend=cpu, epochs=3) == af.UpdateCount(
        per_epoch=9, total=27, micro_batches_per_epoch=25)
    step, loader = counting.program((99, True, None, 3))
    assert af.count_updates(step, loader, backend=cpu, epochs=3, max_steps=20) == af.UpdateCount(
        per_epoch=8, total=20, micro_batches_per_epoch=24)


@pytest.fixture(scope="module")
def two_processes(pool: Pools, tmp_path_factory):
    """Both ranks' results of the 2-process worker (one launch for every case)."""
    out = tmp_path_factory.mktemp("count")
    pool.launch("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60", script="count_updates.py",
                script_args=("--out", out))
    return _launch.read_ranks(out, 2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", counting.SHARDED_CASES, ids=counting.case_id)
def test_count_equals_the_updates_run_applies_on_two_processes(two_processes, case):
    """On two processes (shard_data + replicate), each rank's count is the updates run applied."""
    for rank in two_processes:
        result = rank[counting.case_id(case)]
        assert result["run_epoch_1"] == result["run_epoch_2"] == result["per_epoch"]
        assert result["run"] == result["total"]


@pytest.mark.multiprocess
def test_one_cycle_sized_by_the_count_completes_on_one_and_two_processes(cpu, two_processes):
    """OneCycleLR(total_steps=count_updates(...).total) steps exactly total_steps times and ends
    at its final lr, where the Accelerate sizing (epochs * len(loader) // n = 37) would raise."""
    steps, total, lr = counting.one_cycle(cpu)
    assert steps == total == 39
    for rank in two_processes:
        assert rank["one_cycle"] == [39, 39, lr]
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    by_hand = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=39)
    for _ in range(39):
        optimizer.step()
        by_hand.step()
    assert lr == by_hand.get_last_lr()[0]


def test_count_updates_refuses_data_of_unknown_length_without_max_steps(cpu):
    """A generator has no length: count_updates says so and points to max_steps."""
    step = af.train_step(lambda m, b: m(b).sum())
    with pytest.raises(ValueError, match=r"not known in advance .* run\(..., epochs=None, max_steps=N\)"):
        af.count_updates(step, (torch.randn(2, 2) for _ in range(3)), backend=cpu)
    assert af.count_updates(step, (torch.randn(2, 2) for _ in range(3)), backend=cpu, max_steps=5) == af.UpdateCount(
        per_epoch=None, total=5, micro_batches_per_epoch=None)


@pytest.mark.parametrize("case", [(25, False, "pad", 3), (23, True, None, 1), (24, False, "drop_last", 3)],
                         ids=counting.case_id)
def test_counted_from_a_resumed_state_the_total_is_where_the_resumed_run_stops(cpu, tmp_path, case):
    """count_updates(state=s) of a state saved mid-epoch and mid-window (or at an epoch's end)
    is the step at which run, resumed from it, stops; and that is the uninterrupted total."""
    step, loader = counting.program(case)
    total = af.count_updates(step, loader, backend=cpu, epochs=counting.EPOCHS).total
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.01))
    state, step_fn = cpu.prepare(step, state)
    for batch, last in cpu.batches(loader, step, 0):  # 4 micro-batches: mid-window under accumulate(3)
        state, _ = step_fn(state, batch, flush=last)
        if state.micro_step == 4:
            break
    counted = af.count_updates(step, loader, backend=cpu, epochs=counting.EPOCHS, state=state)
    assert counted.total == total
    resumed = af.run(step, state, loader, backend=cpu, epochs=counting.EPOCHS, progress=False)
    assert resumed.step == total


def test_under_accelfn_plan_the_count_is_the_planned_worlds():
    """Under ``accelfn plan --nproc-per-node 8`` (one process standing for 8), count_updates counts
    rank 0's updates of the 8-process launch, as af.plan does: a schedule sized by it in the
    planned script is the one the real launch sizes (101 samples of batch 4 under accumulate(3):
    13 samples, 4 micro-batches, 2 updates per epoch on 8 ranks; 9 updates on one)."""
    from accelfn.backends.cpu import CPU
    from accelfn.distributed.env import LaunchEnv

    planning = CPU(LaunchEnv(plan_world_size=8, plan_local_world_size=8))
    step, loader = counting.program((101, False, "pad", 3))
    counted = af.count_updates(step, loader, backend=planning, epochs=3)
    assert counted == af.UpdateCount(per_epoch=2, total=6, micro_batches_per_epoch=4)
    model = torch.nn.Linear(2, 1)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert af.plan(step, state, loader, backend=planning, epochs=3, trace=False).total_updates == counted.total
    assert af.count_updates(step, loader, backend=af.backends.CPU(), epochs=3).per_epoch == 9
