"""shard_params (FSDP2) over gloo: 2 real processes started by `accelfn launch` vs 1 process.

One launch of tests/workers/shard_checks.py (2 processes) records everything; each test
compares one part of it with a single-process reference computed here, most of them a
hand-written PyTorch loop.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import fsdp_dtypes as D
from tests.helpers import launch as _launch
from tests.helpers import programs as P
from tests.helpers import sharded as S
from tests.helpers.pool import Pools

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def run(pool: Pools, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("shard_checks")
    pool.launch("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60", script="shard_checks.py",
                script_args=("--out", out), cwd=out)
    return {"json": _launch.read_ranks(out, 2), "tensors": [load_file(out / f"rank{r}.safetensors") for r in range(2)]}


def _with_prefix(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


@pytest.mark.parametrize("optimizer", S.OPTIMIZERS)
def test_two_sharded_processes_equal_a_hand_written_loop_with_twice_the_batch(run: dict[str, Any],
                                                                               optimizer: str) -> None:
    """2 processes x batch 3 under shard_params + accumulate(2) + clip(1.0) give, on both ranks,
    the gathered parameters and the logged grad_norm of a hand-written 1-process loop over
    windows of 12 samples (1e-5), and both ranks gather bitwise identical parameters."""
    model, norms = S.hand_written(optimizer)
    reference = {k: v.detach() for k, v in model.state_dict().items()}
    gathered = [_with_prefix(run["tensors"][rank], f"train.{optimizer}.") for rank in range(2)]
    for rank in range(2):
        assert gathered[rank].keys() == reference.keys()
        for name, value in reference.items():
            torch.testing.assert_close(gathered[rank][name], value, rtol=1e-5, atol=1e-5,
                                       msg=f"{optimizer} rank {rank} {name}")
        assert gathered[rank].keys() == gathered[1 - rank].keys()
        assert all(torch.equal(gathered[rank][k], gathered[1 - rank][k]) for k in reference)
    logged = run["json"][0][f"train.{optimizer}"]["grad_norms"]
    assert len(logged) == len(norms) == 6
    torch.testing.assert_close(torch.tensor(logged), torch.tensor(norms), rtol=1e-5, atol=0)
    assert min(norms) > S.CLIP  # every update was clipped: the clip is part of what matched
    initial = S.make_state(optimizer).model.state_dict()
    assert all(not torch.allclose(initial[k], reference[k]) for k in reference)


def test_units_resharding_and_per_micro_batch_reduction_do_not_change_the_result(run: dict[str, Any]) -> None:
    """shard_params(units=Linear, reshard_after_forward=False, reduce_every_micro_batch=True)
    makes every Linear a unit and still equals the hand-written AdamW loop (1e-5)."""
    model, _ = S.hand_written("adamw")
    for rank in range(2):
        got = _with_prefix(run["tensors"][rank], "options.")
        for name, value in model.state_dict().items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {name}")
        assert run["json"][rank]["options_units"] == ["FSDPBlocks", "FSDPLinear"]


def test_clip_value_under_shard_params_equals_the_hand_written_loop(run: dict[str, Any]) -> None:
    """clip_value(0.05) clamps each rank's gradient shards as clip_grad_value_ clamps the whole
    gradient: SGD parameters equal the hand-written loop's (1e-5)."""
    model, _ = S.hand_written("sgd", clip_value=S.CLIP_VALUE)
    unclipped, _ = S.hand_written("sgd")
    for rank in range(2):
        got = _with_prefix(run["tensors"][rank], "clip_value.")
        for name, value in model.state_dict().items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {name}")
    assert any(not torch.allclose(a, b) for a, b in zip(model.parameters(), unclipped.parameters()))


def test_a_prepared_state_holds_the_same_root_module_with_dtensor_shards(run: dict[str, Any]) -> None:
    """After prepare, state.model is the user's module (class FSDPBlocks), every parameter is a
    DTensor of which each rank holds about half, the optimizer's parameters are the model's, and
    its moments are DTensors too."""
    full = sum(p.numel() for p in S.Blocks().parameters())
    local = []
    for rank in range(2):
        r = run["json"][rank]["train.adamw"]
        assert r["model_type"] == "FSDPBlocks"
        assert r["param_types"] == r["optimizer_state_types"] == ["DTensor"]
        assert r["model_params_are_optimizer_params"] is True
        assert r["full_numel"] == full
        local.append(r["local_numel"])
    assert sum(local) == full and max(local) < 0.55 * full


def test_run_called_twice_on_a_sharded_state_continues_it(run: dict[str, Any]) -> None:
    """af.run to epoch 1 and then again to epoch 2 on the same sharded state (a second prepare)
    ends with exactly the parameters of one run over 2 epochs."""
    for rank in range(2):
        once = _with_prefix(run["tensors"][rank], "train.adamw.")
        twice = _with_prefix(run["tensors"][rank], "twice.")
        assert twice.keys() == once.keys()
        for name in once:
            assert torch.equal(twice[name], once[name]), name


def test_a_sharded_state_refuses_a_step_without_shard_params(run: dict[str, Any]) -> None:
    """prepare() of a sharded state with a plain train_step raises ValueError naming shard_params."""
    for rank in range(2):
        assert run["json"][rank]["unsharded_step_on_sharded_state"] == (
            "this state's model is sharded (it was prepared with shard_params()), so its step must "
            "include af.shard_params() too")


def test_evaluate_runs_the_sharded_forward_on_every_rank(run: dict[str, Any]) -> None:
    """af.evaluate of the sharded AdamW model over 9 samples in batches of 2 (rank 0 has one
    batch more) gives, on each rank, the hand-written model's predictions in dataset order."""
    model, _ = S.hand_written("adamw")
    x = P.IndexDataset(9).x
    with torch.no_grad():
        expected = model(x)
    for rank in range(2):
        tensors = run["tensors"][rank]
        assert tensors["evaluate.index"].tolist() == list(range(9))
        torch.testing.assert_close(tensors["evaluate.prediction"], expected, rtol=1e-5, atol=1e-5)


def test_evaluate_of_fewer_batches_than_ranks_gives_every_output(run: dict[str, Any]) -> None:
    """af.evaluate of the sharded model over a DataLoader of 1 sample, and over a list holding
    one batch of 3, on 2 ranks (rank 1 has no batch: it runs a copy of rank 0's, dropped)
    gives on each rank the hand-written model's outputs of every sample, as replicate() does."""
    model, _ = S.hand_written("adamw")
    with torch.no_grad():
        one, three = model(P.IndexDataset(1).x), model(P.IndexDataset(3).x)
    for rank in range(2):
        tensors = run["tensors"][rank]
        assert tensors["evaluate_one.index"].tolist() == [0]
        torch.testing.assert_close(tensors["evaluate_one.prediction"], one, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tensors["evaluate_list.prediction"], three, rtol=1e-5, atol=1e-5)


def test_lockstep_gives_a_rank_without_items_copies_of_another_ranks_first(run: dict[str, Any]) -> None:
    """backend.lockstep(replays=True) with two items on rank 0 and none on rank 1: both ranks
    yield twice; rank 1 yields rank 0's first item both times, marked as replays."""
    assert run["json"][0]["lockstep_empty_rank"] == [[[1.0, 2.0], "a", False], [[3.0, 4.0], "b", False]]
    assert run["json"][1]["lockstep_empty_rank"] == [[[1.0, 2.0], "a", True], [[1.0, 2.0], "a", True]]


@pytest.mark.parametrize("kind", ["unfreeze", "aux"])
def test_fsdp2_dtype_decisions_are_worked_around_under_bf16(run: dict[str, Any], kind: str) -> None:
    """shard_params + bf16: blocks frozen for a first run and unfrozen for a second
    (pytorch#186998: FSDP2 fixed their reduce dtype while frozen, and backward failed), and
    accumulate(2) with an auxiliary head used only on each window's last micro-batch
    (pytorch#196996: "FSDP reduce-scatter expects uniform gradient dtype"), both train on
    every rank to the one-process bf16-autocast loop's parameters (bf16 tolerance, 2e-2)."""
    expected = D.reference(kind)
    for rank in range(2):
        assert run["json"][rank][f"dtypes.{kind}"] == "trained"
        got = {k.removeprefix(f"dtypes.{kind}."): v for k, v in run["tensors"][rank].items()
               if k.startswith(f"dtypes.{kind}.")}
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=2e-2, msg=f"{kind} rank {rank} {name}")
    initial = D.build(kind).state_dict()
    trained = "blocks.0.weight" if kind == "unfreeze" else "aux.weight"  # trained only thanks to the workaround
    assert not torch.allclose(expected[trained], initial[trained])


def test_each_rank_holds_at_most_055_of_the_parameter_and_optimizer_bytes(run: dict[str, Any]) -> None:
    """With 4 equal blocks and AdamW after one update, each rank's local parameter + optimizer
    state bytes are at most 0.55 x the unsharded total counted here from the same tensors."""
    state = S.make_state("adamw", depth=4)
    P.mse(state.model, P.token_batches((4,), seed=0)[0]).backward()
    state.optimizer.step()
    unsharded = S.state_bytes(state)
    total = unsharded["params"] + unsharded["optimizer"]
    for rank in range(2):
        local = run["json"][rank]["memory"]
        assert local["params"] + local["optimizer"] <= 0.55 * total, (local, unsharded)
    assert sum(run["json"][rank]["memory"]["params"] for rank in range(2)) == unsharded["params"]


def test_optimizer_state_from_before_prepare_is_sharded_with_the_parameters(run: dict[str, Any]) -> None:
    """AdamW moments present before prepare (one unsharded update) gather back exactly, and a
    sharded update on two halves of the data then equals a second full-batch update (1e-6)."""
    state = S.make_state("adamw")
    x, y = P.regression_data().tensors
    P.mse(state.model, (x, y)).backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    moments = [state.optimizer.state[p] for p in state.model.parameters()]
    P.mse(state.model, (x, y)).backward()
    state.optimizer.step()
    reference = {k: v.detach() for k, v in state.model.state_dict().items()}
    for rank in range(2):
        tensors = run["tensors"][rank]
        assert sum(1 for k in tensors if k.startswith("restate.") and k.endswith(".exp_avg")) == len(moments)
        params = _with_prefix(tensors, "restate.")
        for name, value in reference.items():
            torch.testing.assert_close(params[name], value, rtol=1e-6, atol=1e-6, msg=f"rank {rank} {name}")
    # the moments recorded right after prepare are those of the first update
    first = S.make_state("adamw")
    P.mse(first.model, (x, y)).backward()
    first.optimizer.step()
    for i, p in enumerate(first.model.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            for rank in range(2):
                assert torch.equal(run["tensors"][rank][f"restate.{i}.{key}"], first.optimizer.state[p][key])


@pytest.mark.parametrize(("policy", "dtype"), [("bf16", "float32"), ("fp16", "float32"), ("bf16-true", "bfloat16")])
def test_bf16_and_fp16_under_shard_params_lower_the_loss_on_every_rank(run: dict[str, Any], policy: str,
                                                                        dtype: str) -> None:
    """24 updates under shard_params + with_precision(policy) bring every rank's mean loss over
    its last 8 updates below half that of its first 8; the sharded parameters stay fp32 under
    the mixed policies (master weights) and are bf16 under bf16-true."""
    for rank in range(2):
        r = run["json"][rank][f"precision.{policy}"]
        losses = r["losses"]
        assert len(losses) == 24
        assert sum(losses[-8:]) < 0.5 * sum(losses[:8]), losses
        assert r["param_dtype"] == f"torch.{dtype}"


def test_an_fp16_overflow_in_one_ranks_shard_is_skipped_on_every_rank(run: dict[str, Any]) -> None:
    """An fp16 overflow confined to rank 0's gradient shard (rank 1's shards are finite) skips
    the update on both ranks: same skipped flags and loss scales, neither rank's shard moves."""
    zero, one = run["json"][0]["fp16_skip"], run["json"][1]["fp16_skip"]
    assert zero["local_finite"] == [True, False, True]
    assert one["local_finite"] == [True, True, True]
    for r in (zero, one):
        assert r["skipped"] == [0, 1, 0]
        assert r["loss_scales"] == [1024.0, 1024.0, 512.0]
        assert r["moved"] == [True, False, True]
        assert (r["step"], r["skips"]) == (2, 1)


def test_loss_counts_are_summed_over_sharded_ranks(run: dict[str, Any]) -> None:
    """af.Loss under shard_params with 2 and 10 (then 7 and 1, 4 and 4) tokens on the 2 ranks
    equals one process over all 12 tokens (1e-6)."""
    state = P.make_state()
    model, optimizer = state.model, state.optimizer
    for k, counts in enumerate(P.TOKEN_COUNTS):
        both = P.token_batches(counts, seed=100 + k)
        torch.nn.functional.mse_loss(model(torch.cat([b[0] for b in both])), torch.cat([b[1] for b in both])).backward()
        optimizer.step()
        optimizer.zero_grad()
    for rank in range(2):
        got = _with_prefix(run["tensors"][rank], "tokens.")
        for name, value in model.state_dict().items():
            torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-6, msg=f"rank {rank} {name}")


@pytest.mark.parametrize("model", ["narrow", "blocks"])
@pytest.mark.parametrize("norm", ["inf", "2"])
def test_clip_over_parameters_with_fewer_rows_than_ranks_equals_the_hand_written_loop(run: dict[str, Any],
                                                                                      model: str, norm: str) -> None:
    """clip(1.0) with the inf-norm and the 2-norm where rank 1's shards are empty (Linear(4, 1):
    all of them; Blocks: its output layer's) runs on both ranks (the inf-norm of an empty shard
    has no identity) and gives the logged grad norms and, on both ranks, the parameters of a
    hand-written 1-process loop with clip_grad_norm_ of that norm."""
    expected_model, norms = S.hand_written("sgd", norm_type=float(norm), narrow=model == "narrow")
    reference = {k: v.detach() for k, v in expected_model.state_dict().items()}
    key = f"narrow_clip.{model}.{norm}"
    logged = run["json"][0][key]["grad_norms"]
    torch.testing.assert_close(torch.tensor(logged), torch.tensor(norms), rtol=1e-5, atol=0)
    for rank in range(2):
        gathered = _with_prefix(run["tensors"][rank], key + ".")
        assert gathered.keys() == reference.keys()
        for name, value in reference.items():
            torch.testing.assert_close(gathered[name], value, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {name}")
    assert run["json"][1][key]["empty_shards"] == 2  # the 1-row weight and the 1-element bias
    assert run["json"][0][key]["empty_shards"] == 0
    assert len(norms) == 6 and min(norms) > S.CLIP  # every update was clipped
