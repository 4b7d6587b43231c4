"""The order in which pytest-xdist hands the suite's work to its workers, so that they finish together.

``--dist loadscope`` (pyproject's addopts) keeps each test module on one worker (its pools
and module fixtures are started once) and hands out modules largest first by their number
of tests. Two things made one worker run minutes after the other had finished: the docs
pages (one module, each page seconds to minutes of real ``accelfn launch`` jobs) ran as one
unit on one worker, and a few modules of few but long multi-process tests came last.

``Scheduling`` changes only that: each docs page is a unit of its own (its page's blocks
still run in order, in one test); the modules that alone use a pool of the same launch
arguments (``SHARED_POOLS``) are one unit, so that its workers start once, not once per
xdist worker; and the units known to be long go first, longest first (``LONG``: seconds
measured in a run of the whole suite on 2 busy cores; only their order matters); the other
units follow as before, most tests first. Which tests run, and what they check, does not
change.
"""

from __future__ import annotations

from typing import Any

from xdist.scheduler import LoadScopeScheduling

#: units whose tests' whole time was long in a run of the suite on 2 cores (seconds; the
#: order is what counts): a module, or one docs page (``DOCS[page]``)
DOCS = "tests/docs/test_docs.py::test_every_code_block_runs_and_shows_its_real_output[{}]"
LONG: dict[str, float] = {
    # the optional engines' modules (run where .ci/run installs them): one long setup each
    "tests/tracking/test_ray.py": 190,
    "tests/backends/test_deepspeed.py": 150,
    "tests/cli/test_slurm.py": 70,
    "tests/cli/test_deepspeed_launch.py": 46,
    "tests/loop/test_preemption.py": 160,
    # the fault tests: real launches killed and started again (marked long)
    "tests/distributed/test_fault_tolerance.py": 150,
    "tests/cli/test_elastic.py": 115,
    DOCS.format("16-fault-tolerance"): 40,
    DOCS.format("04-backends-and-launching"): 142,
    "tests/distributed/test_exit.py": 142,
    "tests/transforms/test_invariant.py": 133,
    DOCS.format("07-troubleshooting"): 126,
    "tests/cli/test_selftest.py": 117,
    "tests/checkpoint/test_checkpoint.py": 81,
    "tests/checkpoint/test_sharded.py": 71,
    "tests/transforms/test_compile.py": 67,
    "tests/distributed/test_hybrid_sharding.py": 66,
    "tests/distributed/test_engine_processes.py": 59,
    DOCS.format("06-checkpoints"): 56,
    DOCS.format("02-tutorial"): 54,
    "tests/backends/test_multiprocess.py": 50,
    "tests/distributed/test_shard_params.py": 45,
    "tests/distributed/test_tensor_parallel.py": 42,
    DOCS.format("10-sharded-training"): 41,
    DOCS.format("12-clusters"): 40,
    "tests/cli/test_launch_function.py": 40,
    "tests/cli/test_launch_failures.py": 39,
    "tests/cli/test_launch.py": 39,
    "tests/loop/test_batch_size.py": 36,
    "tests/test_worker_pool.py": 36,
    "tests/loop/test_async_checkpoints.py": 36,
    DOCS.format("14-invariant"): 36,
    "tests/tracking/test_services.py": 35,
    "tests/loop/test_rank_mismatches.py": 35,
    "tests/distributed/test_meta_models.py": 32,
    "tests/checkpoint/test_concurrent_writers.py": 30,
    "tests/cli/test_plan_command.py": 30,
    "tests/distributed/test_tp2d.py": 29,
    "tests/distributed/test_pipeline.py": 40,
    "tests/loop/test_plan_memory.py": 25,
    DOCS.format("05-logging"): 28,
}


#: modules that share a pool no other module uses (tests/helpers/pool.py starts one per
#: distinct launch arguments in each xdist worker): one unit each, named for the pool
SHARED_POOLS: dict[str, str] = {
    "tests/checkpoint/test_sharded.py": "pool --nproc-per-node 2",
    "tests/checkpoint/test_save_model.py": "pool --nproc-per-node 2",
    "tests/loop/test_preemption.py": "pool --nproc-per-node 2",
    "tests/transforms/test_compile.py": "pool --nproc-per-node 2",
}


def _cost(unit: str) -> float:
    """A unit's known seconds (``LONG``; a pool's unit: the sum of its modules'), else 0."""
    return LONG.get(unit, 0) + sum(LONG.get(module, 0) for module, pool in SHARED_POOLS.items() if pool == unit)


class Scheduling(LoadScopeScheduling):
    """``--dist loadscope`` with each docs page a unit of its own, the modules of a pool of their own one unit,
    and the long units first."""

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.partition("::")[0]
        if module == DOCS.partition("::")[0]:
            return nodeid
        return SHARED_POOLS.get(module) or super()._split_scope(nodeid)

    _ordered = False

    def _assign_work_unit(self, node: Any) -> None:
        if not self._ordered:  # the first assignment: the work queue is full, in the base class's order
            self._ordered = True
            units = sorted(self.workqueue.items(), key=lambda unit: -_cost(unit[0]))  # stable sort
            self.workqueue.clear()
            self.workqueue.update(units)
        super()._assign_work_unit(node)
