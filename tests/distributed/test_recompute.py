"""``checkpoint_activations`` composed with every parallelism and numeric transform, on real
processes: the same program trained with and without recomputation ends with bitwise the same
parameters, with dropout in every block (tests/workers/recompute_checks.py, one pooled scenario
on 2 processes for all the compositions, one on 4 for hybrid sharding)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.workers.recompute_checks import CASES

pytestmark = pytest.mark.multiprocess

TWO = ("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60")
FOUR = ("--backend", "cpu", "--nproc-per-node", "4", "--timeout-s", "60")
BLOCKS = ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]


@pytest.fixture(scope="module")
def compositions(pool: Any) -> list[dict[str, Any]]:
    return pool.call(*TWO, function="recompute_checks:compositions", timeout_s=500)


def _check(case: str, result: dict[str, Any], rank: int) -> None:
    where = f"{case} on rank {rank}"
    assert result["step"] == result["plain_step"] >= 2, where
    assert result["differ"] == [] and result["num_params"] > 0, where
    assert result["names_equal"], where
    assert result["plain_recomputed"] == [], where
    recompute = CASES[case][2] if case in CASES else {}
    assert result["recomputed"] == (BLOCKS[1::2] if recompute.get("every") == 2 else BLOCKS), where
    if result["calls"] is not None and case != "pipeline":  # each recomputed block's layers run twice
        assert result["calls"] == result["plain_calls"] * (len(BLOCKS) + len(result["recomputed"])) // len(BLOCKS), where
    elif result["calls"] is not None:  # each rank runs its own stage's blocks (and the stage's shape inference)
        assert result["calls"] > result["plain_calls"], where


@pytest.mark.parametrize("case", sorted(CASES))
def test_training_with_recomputation_equals_training_without_it_bitwise(compositions: list[dict[str, Any]],
                                                                        case: str) -> None:
    """On 2 gloo processes, fp32 on the CPU, with dropout in every block, the program trained
    with checkpoint_activations (full, ops or every=2 as the case says) ends after several updates
    with each rank's parameters bitwise those of the same program without it, under the same names,
    and the recomputed blocks ran their layers twice per micro-batch (eager programs): under
    replicate with af.Loss, shard_params (full and ops), tensor_parallel (full and ops), pipeline
    (each stage its own blocks), compile (aot_eager: TorchDynamo and AOTAutograd through the
    recomputation), regional compilation under shard_params, invariant, and fp16/bf16 autocast."""
    for rank, result in enumerate(compositions):
        _check(case, result[case], rank)


def test_hybrid_sharding_with_recomputation_equals_it_without_bitwise(pool: Any) -> None:
    """On 4 processes, shard_params(shard_size=2) (2 copies, each sharded over 2 ranks) with
    checkpoint_activations() trains bitwise as without it, on every rank."""
    for rank, result in enumerate(pool.call(*FOUR, function="recompute_checks:hybrid", timeout_s=300)):
        _check("hybrid", result["hybrid"], rank)
