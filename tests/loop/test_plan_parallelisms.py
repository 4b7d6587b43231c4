"""``af.plan`` made in one process equals the real run under every parallelism, one row each
(``planning.PARALLEL``): tensor parallelism on 2 and 4 processes, FSDP2 x TP on a 2 x 2 mesh,
a pipeline on 2 and 4 processes and with ``replicate`` (PP x DP), ``invariant()``, DDP with the
fp16 compression hook, and DeepSpeed ZeRO 1, 2 and 3.

For each row the plan of this process (``world_size=W``) gives exactly each rank's updates
per epoch, the total updates and scheduler steps, each rank's parameter and optimizer bytes
(DeepSpeed's fp32 master partitions counted with the optimizer where they are a copy of their
own) and the collectives a steady update issues: kind, dtype and elements of each (DeepSpeed's:
kind and dtype; their sizes are its buckets', not planned). The runs are real ``accelfn launch``
processes (pooled: one scenario per world size), their collectives recorded by a dispatch mode
in the worker (``tests/workers/plan_checks.py``) that sees every c10d and functional collective.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

import pytest

import accelfn as af
from tests.helpers import planning
from tests.helpers.pool import Pools

TWO = ("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60")
FOUR = ("--backend", "cpu", "--nproc-per-node", "4", "--timeout-s", "60")
#: DeepSpeed's rows share the DeepSpeed tests' pool (DeepSpeed keeps its groups for a process's life)
DEEPSPEED = ("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "300")
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _rows(processes: int, deepspeed: bool = False) -> list[str]:
    return [name for name, (w, *_) in planning.PARALLEL.items()
            if w == processes and (name in planning.DEEPSPEED_ROWS) == deepspeed]


@pytest.fixture(scope="module")
def runs(pool: Pools) -> dict[str, list[dict[str, Any]]]:
    """Every row's real run, per rank (three pooled scenarios: 2 processes, 4, and DeepSpeed's)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for launch, names in ((TWO, _rows(2)), (FOUR, _rows(4))):
        ranks = pool.call(*launch, function="plan_checks:parallelisms", names=names, timeout_s=600)
        out.update({name: [rank[name] for rank in ranks] for name in names})
    if HAS_DEEPSPEED:
        from tests.helpers import deepspeed_programs as D
        from tests.helpers import launch as L

        names = _rows(2, deepspeed=True)
        ranks = pool.call(*DEEPSPEED, function="plan_checks:parallelisms", names=names, timeout_s=1700,
                          env=L.environment(TORCH_EXTENSIONS_DIR=D.EXTENSIONS))
        out.update({name: [rank[name] for rank in ranks] for name in names})
    return out


def _plan(name: str) -> af.Plan:
    processes = planning.PARALLEL[name][0]
    step, state, loader = planning.parallel_program(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return af.plan(step, state, loader, world_size=processes, epochs=planning.PARALLEL_EPOCHS)


def _skip_missing(name: str) -> None:
    if name in planning.DEEPSPEED_ROWS and not HAS_DEEPSPEED:
        pytest.skip("DeepSpeed is not installed (pip install --no-build-isolation 'accelfn[deepspeed]')")


@pytest.mark.multiprocess
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", list(planning.PARALLEL))
def test_plan_counts_and_bytes_are_the_runs(runs, name: str) -> None:
    """The plan made in one process gives each rank's updates per epoch, the total updates (which
    ``af.count_updates`` gives on every rank too), the scheduler's steps, each rank's parameter and
    optimizer bytes of the real run, and under ``invariant()`` the flat gradient buffers its
    partial sums hold at once (counted in the run as storages of that size alive together)."""
    _skip_missing(name)
    plan = _plan(name)
    assert plan.memory is not None
    for rank, run in enumerate(runs[name]):
        assert [u for e in plan.epochs for u in [e.updates[rank]] * e.num_epochs] == run["updates"], rank
        assert plan.total_updates == run["total"] == run["counted"], rank
        assert plan.scheduler_steps == run["scheduler"], rank
        assert (plan.memory[rank].params, plan.memory[rank].optimizer) == (run["params"], run["optimizer"]), rank
        assert plan.memory[rank].partial_sums == run["partial_sums"], rank


@pytest.mark.multiprocess
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", list(planning.PARALLEL))
def test_planned_collectives_are_what_a_steady_update_issues(runs, name: str) -> None:
    """Between the 2nd and 3rd optimizer steps rank 0 issues the planned collectives of one update
    and one log: each of the planned kind, dtype and number of elements (DeepSpeed's: kind and
    dtype, each kind it issues planned and none more)."""
    _skip_missing(name)
    plan = _plan(name)
    window = [tuple(c) for c in runs[name][0]["window"]]
    planned = [(c.kind, str(c.dtype), c.elements) for c in plan.comms for _ in range(c.count)]
    if name in planning.DEEPSPEED_ROWS:
        assert {(k, d) for k, d, _ in window} == {(k, d) for k, d, _ in planned}
    else:
        assert sorted(window) == sorted(planned)


@pytest.mark.parametrize("name", list(planning.PARALLEL))
def test_under_accelfn_plan_the_script_sees_the_planned_world(name: str) -> None:
    """Under ``accelfn plan`` (a backend standing for W processes) the backend's world size is W
    and ``af.count_updates`` counts what ``af.plan`` plans for W, under every parallelism (no
    error for tensor or pipeline parallelism; DeepSpeed need not be installed)."""
    from accelfn.backends.cpu import CPU
    from accelfn.distributed.env import LaunchEnv

    processes = planning.PARALLEL[name][0]
    backend = CPU(LaunchEnv(plan_world_size=processes, plan_local_world_size=processes))
    assert (backend.world_size, backend.rank) == (processes, 0)
    step, state, loader = planning.parallel_program(name)
    counted = af.count_updates(step, loader, backend=backend, epochs=planning.PARALLEL_EPOCHS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = af.plan(step, state, loader, backend=backend, epochs=planning.PARALLEL_EPOCHS, trace=False)
    assert plan.world_size == processes and counted.total == plan.total_updates == _plan(name).total_updates


def test_what_the_plan_cannot_model_is_a_named_not_planned_warning() -> None:
    """A PowerSGD comm hook, a tensor-parallel plan function and DeepSpeed's bucket sizes are each
    a ``not-planned`` warning naming them, with no number planned in their place (no DDP bucket
    all-reduce, DeepSpeed's collectives without elements); ``run`` does not warn of them."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    step, state, loader = planning.parallel_program("replicate-fp16-hook")
    powersgd = af.compose(af.shard_data(), af.replicate(comm_hook=powerSGD_hook.powerSGD_hook))(
        af.train_step(planning._mse))
    plan = af.plan(powersgd, state, loader, world_size=2, trace=False)
    [problem] = [p for p in plan.problems if p.code == "not-planned"]
    assert "powerSGD_hook" in problem.what and not problem.error
    assert not any("DDP bucket" in c.what for c in plan.comms)

    def split_it(model, mesh):  # a plan function, torchtitan's style: what it splits, no rule says
        pass

    step, state, loader = planning.parallel_program("tensor_parallel-2")
    custom = af.compose(af.shard_data(), af.tensor_parallel(split_it, size=1))(af.train_step(planning._mse))
    plan = af.plan(custom, state, loader, world_size=1, trace=False)
    named = [p.what for p in plan.problems if p.code == "not-planned"]
    assert any("split_it" in what and "split of" in what for what in named), named
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        af.run(custom, state, loader, backend=af.backends.CPU(), max_steps=1, progress=False)
    assert not [w for w in caught if "not-planned" in str(w.message)]

    step, state, loader = planning.parallel_program("zero-1")
    plan = af.plan(step, state, loader, world_size=2, trace=False)
    assert any("DeepSpeed's own collectives" in p.what for p in plan.problems if p.code == "not-planned")
    assert {c.elements for c in plan.comms if c.what.startswith("DeepSpeed") and c.kind != "all_reduce"} == {None}


def test_offloaded_bytes_are_named_and_left_out_of_the_device_check() -> None:
    """``shard_params(offload=True)`` keeps parameters, gradients and optimizer state in host
    memory, DeepSpeed's ``offload_optimizer`` the optimizer state and ``offload_param`` the
    parameter partitions: each plan names those bytes in ``offloaded``, and a device that holds
    the rest (``device_peak``) but not the whole peak is no ``exceeds-device-memory`` error."""
    step, state, loader = planning.parallel_program("tensor_parallel-2")
    offload = af.compose(af.shard_data(), af.shard_params(offload=True))(af.train_step(planning._mse))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = af.plan(offload, state, loader, world_size=2, trace=False)
    assert plan.memory is not None
    m = plan.memory[0]
    assert m.offloaded == m.params + m.grads + m.optimizer > 0
    assert m.device_peak == m.peak - m.offloaded
    for device_memory, refused in ((m.device_peak, False), (m.device_peak - 1, True)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            checked = af.plan(offload, state, loader, world_size=2, trace=False, device_memory=device_memory)
        assert any(p.code == "exceeds-device-memory" for p in checked.problems) == refused

    step, state, loader = planning.parallel_program("zero-3-offload")
    plan = af.plan(step, state, loader, world_size=2, trace=False)
    assert plan.memory is not None
    m = plan.memory[0]
    partitions = sum(-(-p.numel() // 2) for p in state.model.parameters())  # ceil(numel / W) each
    assert m.params == 4 * partitions  # none persistent: threshold 0
    assert m.offloaded == m.optimizer + m.params
