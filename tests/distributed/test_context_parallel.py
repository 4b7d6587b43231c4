"""``context_parallel(size=2)`` on real gloo processes: each sequence split over 2 ranks, attention
through torch's ring, equal to full attention in one process.

One run of tests/workers/cp_checks.py on the worker pool of 2 processes and one on the pool of
4 (their subject is the training, not the launch) record everything: the
small causal transformer of ``tests.helpers.context_parallel`` trained 2 SGD updates per
scenario (mean or counted loss, with and without load balancing, folded into shard_params or
replicate, with tensor_parallel), a length that does not divide, and (on 4) a checkpointed run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import context_parallel as C
from tests.helpers import launch as _launch
from tests.helpers.pool import Pools

pytestmark = pytest.mark.multiprocess


def _launched(pool: Pools, out: Path, world: int) -> dict[str, Any]:
    """cp_checks.py on the pool of ``world`` processes (the 60 s pools other modules use too)."""
    pool.launch("--backend", "cpu", "--nproc-per-node", str(world), "--timeout-s", "60", script="cp_checks.py",
                script_args=("--out", out), cwd=out, timeout_s=240)
    return {"json": _launch.read_ranks(out, world),
            "tensors": [load_file(out / f"rank{r}.safetensors") for r in range(world)]}


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory, pool: Pools) -> dict[str, Any]:
    return _launched(pool, tmp_path_factory.mktemp("cp2"), 2)


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory, pool: Pools) -> dict[str, Any]:
    return _launched(pool, tmp_path_factory.mktemp("cp4"), 4)


def _equal_to_full_attention(run: dict[str, Any], expected: set[str]) -> None:
    references = {loss: C.reference(loss) for loss in C.LOSSES}
    for rank, (record, tensors) in enumerate(zip(run["json"], run["tensors"])):
        assert set(record["losses"]) == expected
        for name, losses in record["losses"].items():
            ref_losses, ref_grads, ref_params = references[name.split("_")[0]]
            torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                                       torch.tensor(ref_losses, dtype=torch.float64), rtol=0, atol=1e-5,
                                       msg=f"rank {rank} {name} losses")
            for n, g in ref_grads.items():
                torch.testing.assert_close(tensors[f"{name}.grad.{n}"], g, rtol=0, atol=1e-5,
                                           msg=f"rank {rank} {name} grad {n}")
            for n, p in ref_params.items():
                torch.testing.assert_close(tensors[f"{name}.param.{n}"], p, rtol=0, atol=1e-5,
                                           msg=f"rank {rank} {name} param {n}")


def test_cp2_equals_full_attention_with_and_without_load_balancing(two: dict[str, Any]) -> None:
    """On 2 processes, CP=2 with a mean loss and with an af.Loss of unevenly ignored targets, load
    balanced and not, under shard_params and under replicate: every rank's losses, first-update
    gradients and parameters after 2 updates equal full attention in one process (1e-5, fp32)."""
    _equal_to_full_attention(two, {f"{loss}_{lb}_{fold}" for loss in C.LOSSES for lb in ("lb", "nolb")
                                   for fold in ("shard", "replicate")})


def test_cp_x_fsdp_2x2_and_cp_x_tp_on_4_processes_equal_full_attention(four: dict[str, Any]) -> None:
    """On 4 processes, CP=2 x FSDP2 over 2 data shards (mean and counted losses) and CP=2 x TP=2
    under shard_params: losses, gradients and parameters equal full attention in one process (1e-5)."""
    _equal_to_full_attention(four, {"mean_lb_shard", "counted_lb_shard", "mean_lb_shard_tp"})


def test_a_length_that_does_not_divide_is_refused_before_anything_changes(two: dict[str, Any],
                                                                          four: dict[str, Any]) -> None:
    """A batch of length 9 is refused by the step function with a ValueError naming the length and
    the multiple, the state's step and parameters unchanged; CP without shard_params or replicate
    is refused by prepare, the model untouched."""
    for record in two["json"] + four["json"]:
        assert "length 9" in record["length_error"] and "multiple of" in record["length_error"]
        assert record["unchanged_after_error"]
        assert "add shard_params()" in record["no_reduction_error"]
        assert record["fresh_untouched"]


def test_a_cp_x_fsdp_run_resumes_from_its_checkpoint_bitwise(four: dict[str, Any]) -> None:
    """af.run under shard_data + CP=2 x FSDP2 on 4 processes, stopped after 3 updates with a
    checkpoint and resumed into a fresh state, ends with the whole run's parameters, bit for bit."""
    for tensors in four["tensors"]:
        assert int(tensors["run.whole.step"]) == int(tensors["run.resumed.step"]) == 4
        assert int(tensors["run.stopped.step"]) == 3
        names = [k[len("run.whole."):] for k in tensors if k.startswith("run.whole.") and not k.endswith(".step")]
        assert names
        for n in names:
            assert torch.equal(tensors[f"run.whole.{n}"], tensors[f"run.resumed.{n}"]), n
        assert any(not torch.equal(tensors[f"run.whole.{n}"], tensors[f"run.stopped.{n}"]) for n in names)
