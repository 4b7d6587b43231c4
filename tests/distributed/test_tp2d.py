"""2-D FSDP2 x TP (``shard_params()`` with ``tensor_parallel(size=2)``) on 4 real gloo processes.

One run of tests/workers/tp2d_checks.py records everything: the byte LM trained whole,
stopped after 2 updates with a checkpoint and resumed from it, exported, and evaluated. It runs
as ``__main__`` in the session's pool of started 4-process workers (its subject is 2-D
training, not the launch); the hand-written loop it is held to runs once for the module.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import accelfn as af
from tests.helpers import launch as _launch
from tests.helpers import tensor_parallel as T
from tests.helpers.pool import Pools

pytestmark = pytest.mark.multiprocess
WORLD = 4
FOUR = ("--backend", "cpu", "--nproc-per-node", str(WORLD), "--timeout-s", "60")


@pytest.fixture(scope="module")
def run(pool: Pools, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("tp2d")
    pool.launch(*FOUR, script="tp2d_checks.py", script_args=("--out", out), cwd=out)
    return {"json": _launch.read_ranks(out, WORLD), "out": out,
            "tensors": [load_file(out / f"ckpt_rank{r}.safetensors") for r in range(WORLD)]}


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """The hand-written 1-process loop of the 2-D run (AdamW over windows of 16 samples, clip
    0.3), run once for the module's tests: its model, grad norms and window losses."""
    losses: list[float] = []
    model, norms = T.hand_written("lm", data_world=2, accumulate=2, max_norm=T.CLIP_2D, losses=losses)
    return {"model": model, "norms": norms, "losses": losses}


def _part(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def test_correct_2d_runs_give_no_warning(run: dict[str, Any]) -> None:
    """The byte LM's runs and a tied transformers Llama's (tensor_parallel("auto") with
    shard_params(), 2 updates) on the (data 2, tensor 2) mesh give no warning on any rank (FSDP2
    warned that the Llama's output, a view that tensor parallelism's to_local made, could give
    wrong gradients)."""
    for rank in range(WORLD):
        assert run["json"][rank]["llama_step"] == 2
        assert run["json"][rank]["warnings"] == [], run["json"][rank]["warnings"]


def test_fsdp2_x_tp2_equals_a_hand_written_loop_and_holds_a_quarter_of_each_split_matrix(
        run: dict[str, Any], reference: dict[str, Any]) -> None:
    """On a (data 2, tensor 2) mesh with accumulate(2) + clip(0.3) the gathered parameters and
    logged grad norms equal a 1-process loop over windows of 16 samples (1e-5) on every rank;
    each rank holds 1/4 of every split weight matrix and 1/2 of every other parameter."""
    expected, norms = reference["model"].state_dict(), reference["norms"]
    for rank in range(WORLD):
        whole = _part(run["tensors"][rank], "whole.")
        assert whole.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(whole[name], value, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {name}")
        record = run["json"][rank]
        assert record["model_type"] == "FSDPByteLM"
        for name, full in record["full_numel"].items():
            split = any(f".{layer}" in name for layer in ("qkv.", "proj.weight", "mlp.0.", "mlp.2.weight"))
            assert record["local_numel"][name] * (4 if split else 2) == full, name
    logged = run["json"][0]["grad_norms"]  # the trackers are rank 0's
    torch.testing.assert_close(torch.tensor(logged), torch.tensor(norms), rtol=1e-5, atol=0)
    assert max(norms) > T.CLIP_2D  # some updates were clipped


def test_2d_metrics_are_reduced_over_the_data_dimension_only(run: dict[str, Any], reference: dict[str, Any]) -> None:
    """On the (data 2, tensor 2) mesh the logged loss of each update is the loss of its whole
    window of 16 samples (the mean over the 2 data shards, 1e-5), and each update counts its 16
    samples (8 at an epoch's end) once, not once per rank of a tensor-parallel group."""
    logged = run["json"][0]
    torch.testing.assert_close(torch.tensor(logged["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=0)
    windows = [float(min(16, T.NUM_SAMPLES - start)) for start in range(0, T.NUM_SAMPLES, 16)] * T.EPOCHS
    assert logged["samples_per_update"] == pytest.approx(windows, rel=1e-9)  # 16, 16, then the epoch's last 8


def test_evaluate_on_the_2d_mesh_gives_each_sample_once_in_order_on_every_rank(
        run: dict[str, Any], reference: dict[str, Any]) -> None:
    """af.evaluate of the 2-D model's per-sequence loss over the 40 sequences (batches of 3, the
    last ones ragged) returns, on all 4 ranks, 40 values in dataset order equal to the
    hand-written model's (1e-5): each tensor-parallel group reads one data shard, reported once."""
    x, y = T.data("lm").tensors
    with torch.no_grad():
        expected = T.byte_lm().per_sequence_loss(reference["model"], (x, y))
    for rank in range(WORLD):
        torch.testing.assert_close(run["tensors"][rank]["evaluated"], expected, rtol=1e-5, atol=1e-5)


def test_a_2d_run_resumed_from_its_checkpoint_is_bitwise_the_whole_run(run: dict[str, Any]) -> None:
    """Stopped after 2 updates (mid-epoch) and resumed by a fresh state, the 2-D run ends with
    bitwise the parameters and AdamW moments of the uninterrupted one, on every rank."""
    assert run["json"][0]["steps"] == [6, 2, 6] and run["json"][0]["stopped_epoch_micro_step"] == 4
    for rank in range(WORLD):
        for what in ("", "_optimizer"):
            whole, resumed = _part(run["tensors"][rank], f"whole{what}."), _part(run["tensors"][rank], f"resumed{what}.")
            assert whole.keys() == resumed.keys() and whole
            assert all(torch.equal(whole[k], resumed[k]) for k in whole), what


def test_a_2d_checkpoint_and_export_load_into_one_unsharded_process(run: dict[str, Any]) -> None:
    """The 2-D checkpoint loads into a 1-process state with the stopped run's gathered parameters
    (bitwise, step 2); save_model's weights load strictly into a fresh model."""
    state = af.load(run["out"] / "ckpt" / "step_00000002", into=T.make_state("lm"))
    stopped = _part(run["tensors"][0], "stopped.")
    assert state.step == 2 and all(torch.equal(state.model.state_dict()[k], stopped[k]) for k in stopped)
    model = T.make_model("lm")
    model.load_state_dict(load_file(run["out"] / "export" / "model.safetensors"), strict=True)
    whole = _part(run["tensors"][0], "whole.")
    assert all(torch.equal(model.state_dict()[k], whole[k]) for k in whole)


def test_a_tp_size_that_does_not_divide_the_world_is_refused_by_name(run: dict[str, Any]) -> None:
    """tensor_parallel(size=3) in a world of 4 raises ValueError naming the size and the world."""
    assert ("tensor_parallel(size=3): one copy of the model spans 3 ranks, and the world of 4 processes cannot be "
            "split") in run["json"][0]["size_error"]
