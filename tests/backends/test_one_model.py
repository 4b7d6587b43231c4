"""What "the model" is across ranks: one run of tests/workers/one_model.py on 2 processes (in
the worker pool: its subject is the model, not the launch), each claim compared with a
reference written by hand in PyTorch here."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
import torch
from safetensors.torch import load_file

import accelfn as af
from tests.helpers import launch as _launch
from tests.helpers import programs as P
from tests.helpers import sharded as S
from tests.helpers.pool import Pools
from tests.workers.one_model import EVAL_X, Normed

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def run(pool: Pools, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("one_model")
    pool.launch("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60", script="one_model.py",
                script_args=("--out", out), cwd=out)
    return {"json": _launch.read_ranks(out, 2), "tensors": [load_file(out / f"rank{r}.safetensors") for r in range(2)],
            "out": out}


def _reference(tensors: dict[str, torch.Tensor], prefix: str) -> torch.nn.Module:
    """A plain (unsharded, fp32) Blocks model holding the gathered parameters under ``prefix``."""
    model = S.Blocks()
    model.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
    return model


@pytest.mark.parametrize("layout", ["root", "units"])
def test_forwards_outside_training_run_in_fp32_under_shard_params_and_bf16(run: dict[str, Any], layout: str) -> None:
    """Under shard_params + bf16 (FSDP2 gathers bf16 parameters in training), af.evaluate, a loop
    over backend.eval_batches and a plain forward of the trained model give fp32 outputs equal
    to the gathered fp32 parameters' forward (1e-6; bf16 would be 1e-3 off), on both ranks; under
    backend.autocast(step) and evaluate(precision=step) the forward is bf16 autocast's, and the
    plain forward after that is fp32 again. One model sharded whole, one by Linear units with
    reshard_after_forward=False."""
    for rank in range(2):
        t = run["tensors"][rank]
        model = _reference(t, f"precision.{layout}.plain.")
        with torch.no_grad():
            fp32 = model(EVAL_X)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                bf16 = model(EVAL_X).float()
        assert (fp32 - bf16).abs().max() > 1e-3  # the two precisions are told apart
        assert run["json"][rank][f"precision.{layout}"]["dtypes"] == ["torch.float32", "torch.float32"]
        for name in ("evaluate", "forward", "forward_after"):
            torch.testing.assert_close(t[f"precision.{layout}.{name}"], fp32, rtol=1e-6, atol=1e-6, msg=name)
        order = [0, 2, 4, 6, 8, 1, 3, 5, 7, 9]  # each rank's every other sample, rank 0's first
        torch.testing.assert_close(t[f"precision.{layout}.eval_batches"], fp32[order], rtol=1e-6, atol=1e-6)
        for name in ("autocast", "evaluate_training"):
            torch.testing.assert_close(t[f"precision.{layout}.{name}"], bf16, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("layout", ["root", "units"])
def test_evaluating_in_a_hook_leaves_bf16_sharded_training_bitwise_unchanged(run: dict[str, Any], layout: str) -> None:
    """A hook evaluating after every update (fp32 forwards between bf16 training forwards) gives
    bitwise the parameters of the same run without it, and its last evaluation equals the fp32
    forward of the parameters it saw."""
    t = run["tensors"][0]
    plain = {k: v for k, v in t.items() if k.startswith(f"precision.{layout}.plain.")}
    assert plain
    for key, value in plain.items():
        assert torch.equal(t[key.replace(".plain.", ".hooked.")], value), key
    with torch.no_grad():
        reference = _reference(t, f"precision.{layout}.hooked.")(EVAL_X)
    # the last hook ran after the last update: the final parameters
    torch.testing.assert_close(t[f"precision.{layout}.hook_eval"], reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["replicate", "shard_params"])
def test_replicas_with_drifted_buffers_are_one_model_to_evaluate_save_and_hooks(run: dict[str, Any],
                                                                               layout: str) -> None:
    """Each rank's training forward updates its own BatchNorm statistics (the ranks' batches
    differ), but af.evaluate gives on both ranks, for every sample, the forward of the model
    af.save_model wrote (a plain BatchNorm model loading it, eval mode; 1e-6), the checkpoint
    af.save wrote holds the same buffers, and every hook call saw rank 0's running mean on both
    ranks: rank 0's buffers, as DDP's next forward would broadcast."""
    out = run["out"]
    model = Normed()
    model.load_state_dict(load_file(out / f"export_{layout}" / "model.safetensors"))
    model.eval()
    with torch.no_grad():
        reference = model(EVAL_X)
    for rank in range(2):
        t = run["tensors"][rank]
        torch.testing.assert_close(t[f"buffers.{layout}.evaluate"], reference, rtol=1e-6, atol=1e-6)
        assert torch.equal(t[f"buffers.{layout}.final_mean"], model.norm.running_mean)
        assert torch.equal(t[f"buffers.{layout}.hook_means"], run["tensors"][0][f"buffers.{layout}.hook_means"])
    assert run["tensors"][0][f"buffers.{layout}.hook_means"].shape[0] == 8  # one per update: 2 epochs of 4
    if layout == "replicate":  # the unsharded checkpoint's model file: the same buffers
        saved = load_file(out / f"ckpt_{layout}" / "model.safetensors")
        assert torch.equal(saved["norm.running_mean"], model.norm.running_mean)
        assert torch.equal(saved["norm.running_var"], model.norm.running_var)


def test_extra_states_that_differ_between_ranks_come_back_per_rank(run: dict[str, Any]) -> None:
    """A per-rank stream position in extra (rank r: 10 + 1000 r per update; 4 updates, a
    background checkpoint at step 4) resumes as each rank's own, 40 and 4040 (not rank 0's
    twice), with its Python int; a state equal on every rank stays shared: the manifest's
    extra holds rank 0's of both, each rank's entry only the offset."""
    for rank in range(2):
        entry = run["json"][rank]["extra.replicate"]
        assert entry["before"] == entry["after"] == [4 * (10 + 1000 * rank), 4, 4.0]
        assert entry["resumed_step"] == 4
    manifest = orjson.loads((run["out"] / "extra_replicate" / "step_00000004" / "manifest.json").read_bytes())
    assert set(manifest["extra"]) == {"offset", "shared"}
    assert [set(entry["extra"]) for entry in manifest["ranks"]] == [{"offset"}, {"offset"}]


def test_a_two_rank_checkpoint_with_per_rank_extra_loads_rank_0s_on_one_process(run: dict[str, Any]) -> None:
    """On one process (another world size) the checkpoint's per-rank extra is rank 0's."""
    from tests.workers.one_model import Offset, Shared

    state = P.make_state().replace(extra={"offset": Offset(), "shared": Shared()})
    loaded = af.load(run["out"] / "extra_replicate" / "step_00000004", into=state)
    assert (int(loaded.extra["offset"].position), loaded.extra["offset"].updates) == (40, 4)


def test_an_ema_of_each_ranks_shards_resumes_per_rank(run: dict[str, Any]) -> None:
    """Under shard_params an EMA of this rank's shards (to_local clones) resumes bitwise as
    each rank's own (rank 1's differ from rank 0's, so rank 0's would not do); an EMA of the
    DTensors themselves: tests/checkpoint/test_extra_dtensors.py."""
    t0, t1 = run["tensors"]
    num = run["json"][0]["extra.sharded"]["num"]
    assert num == 10 and run["json"][0]["extra.sharded"]["resumed_step"] == 4
    for i in range(num):
        for t in (t0, t1):
            assert torch.equal(t[f"extra.sharded.before.{i}"], t[f"extra.sharded.after.{i}"])
    assert any(not torch.equal(t0[f"extra.sharded.before.{i}"], t1[f"extra.sharded.before.{i}"])
               for i in range(num) if t0[f"extra.sharded.before.{i}"].shape == t1[f"extra.sharded.before.{i}"].shape)
