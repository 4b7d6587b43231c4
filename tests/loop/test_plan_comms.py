"""``af.plan``'s collectives per update are what a real 2-process run issues: kind, dtype and
elements of each, under replicate + accumulate(4) + clip (DDP buffers and bucket), replicate with
several DDP buckets, shard_params + clip (FSDP2 all-gathers and reduce-scatters per unit, the clip
norm), shard_params + accumulate(2) + fp16 (fp16 gathers, fp32 reductions, the non-finite
check) and shard_params + fp8 with float8 all-gathers (float8 weights gathered beside bf16
biases as bytes, the amax all-reduce), with the metric reductions of one logged update.

Instrumented in the worker (tests/workers/plan_checks.py): the torch.distributed functions
FSDP2 and accelfn call (all_gather_single, reduce_scatter_single, all_reduce, broadcast,
_broadcast_coalesced, and DTensor's functional all_reduce) are wrapped to record each call, and DDP gets a comm hook that records
each bucket and all-reduces it as DDP's default hook does; an optimizer step pre-hook cuts the
record into updates.
"""

from __future__ import annotations

import pytest

import accelfn as af
from tests.helpers import planning
from tests.helpers.pool import Pools

TWO = ("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60")


@pytest.fixture(scope="module")
def two_processes(pool: Pools):
    """Both ranks' planned collectives and the recorded ones of every program (one pooled scenario)."""
    return pool.call(*TWO, function="plan_checks:comms", timeout_s=300)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", planning.COMMS)
def test_planned_collectives_are_what_a_real_update_issues(two_processes, name):
    """Between consecutive optimizer steps, each rank issues exactly the planned collectives
    (one update's and one log's), each of the planned kind, dtype and number of elements."""
    for rank in two_processes:
        result = rank[name]
        assert len(result["windows"]) == 3
        for window in result["windows"]:
            assert sorted(map(tuple, window)) == sorted(map(tuple, result["planned"]))


def test_wire_bytes_follow_the_ring_algorithms():
    """An all-reduce of B bytes sends 2(W-1)/W B per rank, an all-gather or reduce-scatter of a
    whole of B bytes (W-1)/W B, over the W ranks it spans."""
    state = planning.memory_state("adamw")
    plan = af.plan(planning.comms_program("shard_params-clip"), state, planning.memory_loader(), world_size=4,
                   trace=False)
    for c in plan.comms:
        factor = 2 if c.kind == "all_reduce" else 1
        assert c.wire_bytes == factor * 3 * c.bytes // 4
    # rows padded to a multiple of 4: root 8x3 + 8 + 8x7 + 8 + 8 (frozen scale) = 104, blocks 8x7 + 8 = 64
    assert [c.elements for c in plan.comms if c.kind == "all_gather"] == [104, 64, 64, 64, 64]
