"""Hybrid sharding (``shard_params(shard_size=2)``, a 2-D FSDP2 mesh) on 4 real gloo processes.

One run of tests/workers/hybrid_checks.py records everything: 2 copies of the model, each
sharded over 2 ranks, trained whole, and stopped after 3 updates and resumed from its checkpoint.
It runs as ``__main__`` in the session's pool of started 4-process workers (its subject is
hybrid sharding, not the launch); the refusal on nodes of unequal size starts two launchers of
its own.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import accelfn as af
from tests.helpers import launch as _launch
from tests.helpers import sharded as S
from tests.helpers.pool import Pools

pytestmark = pytest.mark.multiprocess
WORLD = 4
FOUR = ("--backend", "cpu", "--nproc-per-node", str(WORLD), "--timeout-s", "60")


@pytest.fixture(scope="module")
def run(pool: Pools, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("hybrid")
    pool.launch(*FOUR, script="hybrid_checks.py", script_args=("--out", out), cwd=out)
    return {"json": _launch.read_ranks(out, WORLD), "tensors": [load_file(out / f"rank{r}.safetensors")
                                                                for r in range(WORLD)], "out": out}


def _part(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}


def test_four_processes_in_two_sharded_copies_equal_a_hand_written_loop_with_four_times_the_batch(run) -> None:
    """4 processes x batch 3, each copy of the model sharded over 2 of them (mesh 2 x 2), with
    SGD + accumulate(2) + clip(1.0): the gathered parameters and the logged grad norms are a
    hand-written 1-process loop's over windows of 24 samples (1e-5), the same bitwise on every
    rank, and each rank holds half of the model."""
    model, norms = S.hand_written("sgd", world_size=WORLD)
    reference = {k: v.detach() for k, v in model.state_dict().items()}
    whole = [_part(t, "whole.") for t in run["tensors"]]
    for name, value in reference.items():
        torch.testing.assert_close(whole[0][name], value, rtol=1e-5, atol=1e-5, msg=name)
    assert all(torch.equal(whole[r][k], whole[0][k]) for r in range(WORLD) for k in reference)
    torch.testing.assert_close(torch.tensor(run["json"][0]["grad_norms"]), torch.tensor(norms), rtol=1e-5, atol=0)
    assert min(norms) > S.CLIP  # every update was clipped: the norm over one copy's shards is what matched
    for rank in run["json"]:
        assert rank["mesh"] == [2, 2]
        assert rank["local_numel"] <= 0.55 * rank["full_numel"]
    assert sum(r["local_numel"] for r in run["json"][:2]) == run["json"][0]["full_numel"]


def test_a_hybrid_checkpoint_resumes_bitwise_and_loads_into_one_unsharded_process(run) -> None:
    """Stopped after 3 updates with a checkpoint and resumed from it by a fresh state (another
    seed), the run ends bitwise like the whole one; the checkpoint, loaded into one unsharded
    process, holds bitwise the parameters the stopped run gathered."""
    for tensors in run["tensors"]:
        assert _part(tensors, "resumed.").keys() == _part(tensors, "whole.").keys()
        assert all(torch.equal(_part(tensors, "resumed.")[k], v) for k, v in _part(tensors, "whole.").items())
    assert [r["resumed_step"] for r in run["json"]] == [4] * WORLD
    loaded = af.load(run["out"] / "checkpoints" / "step_00000003", into=S.make_state("sgd", seed=2))
    stopped = _part(run["tensors"][0], "stopped.")
    assert loaded.step == 3
    assert all(torch.equal(loaded.model.state_dict()[k], v) for k, v in stopped.items())


def test_a_sharded_state_is_not_sharded_again_with_other_options(run) -> None:
    """Preparing the trained (2 x 2) state with shard_params() (all 4 ranks in one group) is
    refused on every rank, naming the option that differs."""
    assert [r["reshard_error"] for r in run["json"]] == [
        "this state's model is sharded already, and shard_params() asks for another layout (shard_size=2 before, "
        "None now); a model is sharded once: give the step the shard_params(...) it was prepared with, or build the "
        "state again (a new model and optimizer) to shard it otherwise"] * WORLD


def test_evaluate_leaves_a_model_that_keeps_its_gathered_parameters_sharded(run) -> None:
    """With reshard_after_forward=False, the forwards of af.evaluate (no backward) would keep every
    parameter gathered; evaluate shards them again, so the model still holds its DTensor shards
    (the optimizer's parameters) and af.save writes a sharded checkpoint that loads."""
    for rank in run["json"]:
        after = rank["after_evaluate"]
        assert after == {**after, "param_types": ["DTensor"], "optimizer_params_are_model_params": True,
                         "evaluated": 9}
        assert after["local_numel"] <= 0.55 * rank["full_numel"]
    files = sorted(p.name for p in (run["out"] / "after_evaluate" / "dcp").iterdir())
    assert len(files) == WORLD
    af.load(run["out"] / "after_evaluate", into=S.make_state("adamw", seed=3))


def test_nodes_of_unequal_size_refuse_shard_size_node_on_every_rank(tmp_path) -> None:
    """shard_size="node" on a node of 2 processes and a node of 1 (two launchers on loopback):
    every rank raises the same ValueError before anything changes, instead of building
    different meshes and waiting for each other."""
    port = _launch.free_port()
    procs = [_launch.start("launch", "--backend", "cpu", "--nnodes", "2", "--node-rank", str(node),
                           "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port),
                           "--timeout-s", "60", _launch.WORKERS / "hybrid_nodes.py", "--out", tmp_path, cwd=tmp_path)
             for node, nproc in ((0, 2), (1, 1))]
    for proc in procs:
        _launch.assert_ok(_launch.finish(proc))
    ranks = _launch.read_ranks(tmp_path, 3)
    assert [r["local_world_size"] for r in ranks] == [2, 2, 1]
    assert all(r["unsharded"] for r in ranks)
    for rank, r in enumerate(ranks):
        assert r["error"] == (
            f"shard_params(shard_size='node'): the nodes run from 1 to 2 processes (this rank, {rank}, has "
            f"LOCAL_WORLD_SIZE={r['local_world_size']}), so the ranks would split the world into groups of different "
            "sizes; start the same number of processes on every node, or give shard_size as a number that divides "
            "the world size")
