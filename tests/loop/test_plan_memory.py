"""``af.plan``'s persistent bytes per rank (parameters, gradients, optimizer state, buffers)
equal the real state's after the first update: one process, two processes under replicate and
shard_params (uneven shards), in fp32, bf16, fp16 and bf16-true, and four processes under
shard_params (a rank with an empty shard), hybrid sharding and replicate."""

from __future__ import annotations

import pytest
import torch

import accelfn as af
from tests.helpers import planning
from tests.helpers.pool import Pools

TWO = ("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60")
FOUR = ("--backend", "cpu", "--nproc-per-node", "4", "--timeout-s", "60")


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "bf16-true"])
@pytest.mark.parametrize("optimizer", planning.MEMORY_OPTIMIZERS)
def test_planned_bytes_are_the_real_state_on_one_process(cpu, precision, optimizer):
    """On one process, planned parameter, gradient, optimizer-state and buffer bytes equal the
    state's after its first update."""
    result = planning.planned_and_measured(None, precision, optimizer, cpu)
    assert result["planned"] == result["measured"]


@pytest.fixture(scope="module")
def two_processes(pool: Pools):
    """Both ranks' planned and measured bytes of every 2-process case (one pooled scenario)."""
    return pool.call(*TWO, function="plan_checks:memory", timeout_s=300)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", planning.MEMORY_TWO, ids="-".join)
def test_planned_bytes_are_the_real_state_on_two_processes(two_processes, case):
    """On each of two ranks, planned bytes equal the real state's, shards of uneven rows included."""
    for rank in two_processes:
        result = rank["-".join(case)]
        assert result["planned"] == result["measured"]
    if case[0] == "shard_params":  # 7 and 5 rows split 4 + 3 and 3 + 2: the ranks differ
        assert two_processes[0]["-".join(case)]["measured"]["params"] > two_processes[1]["-".join(case)]["measured"]["params"]


@pytest.mark.multiprocess
def test_planned_bytes_are_the_real_state_on_four_processes(pool: Pools):
    """On each of four ranks, planned parameter, gradient, optimizer-state and buffer bytes equal
    the real state's after the first update, for every case of ``planning.MEMORY_FOUR`` (one
    pooled scenario): FSDP2's shards of 7 and 5 rows on 4 ranks (2+2+2+1 and 2+2+1+0), hybrid
    shards over pairs, and DDP's whole copies."""
    ranks = pool.call(*FOUR, function="plan_checks:memory_four", timeout_s=400)
    assert len(ranks) == 4
    for case in planning.MEMORY_FOUR:
        key = "-".join(case)
        for rank, result in enumerate(ranks):
            assert result[key]["planned"] == result[key]["measured"], (key, rank)
        params = [r[key]["measured"]["params"] for r in ranks]
        print(key, "params per rank:", params, "optimizer per rank:", [r[key]["measured"]["optimizer"] for r in ranks])
        if case[0] == "shard_params":  # rows 2+2+2+1 of 7 and 2+2+1+0 of 5
            assert params[0] == params[1] > params[2] > params[3]
        elif case[0] == "hybrid":  # ranks 0, 2 hold the first halves, 1, 3 the second
            assert params[0] == params[2] > params[1] == params[3]
        else:
            assert len(set(params)) == 1


def test_shards_on_four_ranks_are_torch_chunks():
    """Planned for 4 ranks, each rank's parameter bytes are its torch.chunk of every parameter's rows."""
    state = planning.memory_state("adamw")
    plan = af.plan(planning.memory_program("shard_params", "fp32"), state, planning.memory_loader(), world_size=4,
                   trace=False)
    for rank, memory in enumerate(plan.memory):
        chunks = [torch.chunk(p.detach(), 4)[rank] if len(torch.chunk(p.detach(), 4)) > rank else p[:0]
                  for p in state.model.parameters()]
        assert memory.params == sum(c.nbytes for c in chunks)
        assert memory.optimizer == 2 * sum(c.nbytes for c, p in zip(chunks, state.model.parameters())
                                           if p.requires_grad) + 4 * sum(p.requires_grad for p in state.model.parameters())


def test_an_lr_scheduler_does_not_hide_the_optimizer_state(cpu):
    """With an lr scheduler (which wraps the optimizer's step), the plan still runs a copy of the
    optimizer's own step: AdamW's state is planned, and the real optimizer is not touched."""
    state = planning.memory_state("adamw")
    scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda s: 1.0)
    state = state.replace(scheduler=scheduler)
    plan = af.plan(planning.memory_program(None, "fp32"), state, planning.memory_loader(), trace=False)
    trainable = [p for p in state.model.parameters() if p.requires_grad]
    assert plan.memory[0].optimizer == 2 * sum(p.nbytes for p in trainable) + 4 * len(trainable)
    assert not state.optimizer.state and not getattr(state.optimizer, "_opt_called", False)


class _Released(torch.optim.SGD):
    """An optimizer holding state outside Python (DeepSpeed's CPU Adam's kind): its finalizer
    releases it, and counts how often it ran."""

    released = 0

    def __del__(self):
        type(self).released += 1


@pytest.mark.parametrize("name", ["replicate", "zero-0", "zero-1"])
def test_an_optimizer_with_a_finalizer_is_never_copied(name):
    """An optimizer class with ``__del__`` is not copied to step on meta tensors, on any path
    (plain data parallel, DeepSpeed's stage 0 stepping the parameters, stage 1 stepping flat
    fp32 partitions): no copy is collected (which would release the real one's state: a segfault
    later with DeepSpeed's CPU Adam), and the plan says the optimizer state is not planned (a
    warning) while planning the rest."""
    import gc

    transforms = {"replicate": lambda: [af.shard_data(), af.replicate()],
                  "zero-0": lambda: [af.deepspeed({"zero_optimization": {"stage": 0}})],
                  "zero-1": lambda: [af.deepspeed({"zero_optimization": {"stage": 1}})]}[name]
    gc.collect()  # the optimizers of earlier cases first
    _Released.released = 0
    model = torch.nn.Linear(4, 3)
    state = af.TrainState.create(model, _Released(model.parameters(), lr=0.1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 3)),
                                         batch_size=4)
    step = af.compose(*transforms())(af.train_step(planning._mse))
    plan = af.plan(step, state, loader, world_size=2, trace=False)
    gc.collect()
    assert _Released.released == 0
    [problem] = [p for p in plan.problems if p.code == "optimizer-unplanned"]
    assert "_Released" in problem.what and "finalizer" in problem.what and not problem.error
    assert plan.memory is not None and plan.memory[0].params == 15 * 4  # the rest planned: 15 fp32 parameters
