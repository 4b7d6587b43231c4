"""tensor_parallel over gloo: 2 pooled processes (one tensor-parallel group) vs one process.

One pooled scenario (tests/workers/tp_checks.py ``train``) trains the MLP and the byte LM of
``tests.helpers.tensor_parallel``; each test compares a part of it with a hand-written
single-process loop computed here.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import accelfn as af
from accelfn.distributed.mesh import Mesh
from tests.helpers import programs as P
from tests.helpers import tensor_parallel as T
from tests.helpers.pool import Pools

pytestmark = pytest.mark.multiprocess

LAUNCH = ("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60")


@pytest.fixture(scope="module")
def run(pool: Pools, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("tp_checks")
    results = pool.call(*LAUNCH, function="tp_checks:train", out=str(out), timeout_s=300)
    return {"json": results, "tensors": [load_file(out / f"rank{r}.safetensors") for r in range(2)]}


@pytest.mark.parametrize("kind", ["mlp", "lm"])
def test_tp2_equals_a_hand_written_one_process_loop(run: dict[str, Any], kind: str) -> None:
    """TP=2 on 2 processes with clip(1.0) ends, after 20 AdamW updates, with the parameters of
    a hand-written 1-process loop (1e-5) on both ranks, and logs its unsharded grad norms."""
    model, norms = T.hand_written(kind)
    reference = {k: v.detach() for k, v in model.state_dict().items()}
    for rank in range(2):
        got = {k[len(kind) + 1:]: v for k, v in run["tensors"][rank].items() if k.startswith(f"{kind}.")}
        assert got.keys() == reference.keys()
        for name, value in reference.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, msg=f"{kind} rank {rank} {name}")
    record = run["json"][0][kind]
    assert record["step"] == T.UPDATES == len(norms)
    torch.testing.assert_close(torch.tensor(record["grad_norms"]), torch.tensor(norms), rtol=1e-5, atol=0)
    assert max(norms) > T.CLIP  # some updates were clipped: the clip is part of what matched
    initial = T.make_model(kind).state_dict()
    assert all(not torch.allclose(initial[k], reference[k]) for k in reference)


def test_evaluate_of_a_tp_model_gives_each_sample_once_in_order_on_every_rank(run: dict[str, Any]) -> None:
    """af.evaluate of the TP=2 MLP over its 40 samples returns, on both ranks, 40 rows in dataset
    order equal to the hand-written model's outputs (1e-5): the group reads one shard, reported once."""
    model, _ = T.hand_written("mlp")
    x, _ = T.data("mlp").tensors
    with torch.no_grad():
        expected = model(x)
    for rank in range(2):
        torch.testing.assert_close(run["tensors"][rank]["evaluated"], expected, rtol=1e-5, atol=1e-5)


def _numerics(run: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [run["json"][rank]["numerics"][name] for rank in range(2)]


def _max_diff(run: dict[str, Any], name: str, model: torch.nn.Module) -> float:
    """The largest difference of run ``name``'s gathered parameters from ``model``'s (the same on both ranks)."""
    diffs = []
    for rank in range(2):
        got = _part(run["tensors"][rank], f"{name}.")
        assert got.keys() == model.state_dict().keys()
        diffs += [float((got[k] - v).abs().max()) for k, v in model.state_dict().items()]
    return max(diffs)


def test_an_af_loss_with_ragged_item_counts_under_tp_is_the_items_mean_of_each_window(run: dict[str, Any]) -> None:
    """TP=2 with accumulate(2) and an af.Loss whose micro-batches hold ragged item counts ends,
    after 10 updates, equal (1e-5) to a 1-process loop over each window's summed loss divided by
    its items; the logged loss is that window loss and the logged items count each item once."""
    losses: list[float] = []
    model, _ = T.hand_written("mlp", accumulate=2, weighted=True, losses=losses)
    assert _max_diff(run, "items", model) < 1e-5
    records = _numerics(run, "items")
    assert [r["step"] for r in records] == [T.NUM_SAMPLES * T.EPOCHS // (2 * T.BATCH)] * 2
    points = records[0]["points"]  # rank 0's trackers
    torch.testing.assert_close(torch.tensor([p["loss"] for p in points]), torch.tensor(losses), rtol=1e-5, atol=0)
    x, _ = T.data("mlp").tensors
    counts = T.item_counts(x)
    expected_items = []
    for epoch in range(T.EPOCHS):  # the items of each window of 8 samples, in shard_data's order
        sampler = torch.utils.data.DistributedSampler(T.data("mlp"), num_replicas=1, rank=0, shuffle=True,
                                                      seed=P.SHARD_SEED)
        sampler.set_epoch(epoch)
        order = list(sampler)
        expected_items += [float(counts[order[i:i + 8]].sum()) for i in range(0, len(order), 8)]
        micro = [float(counts[order[i:i + 4]].sum()) for i in range(0, len(order), 4)]
        assert any(a != b for a, b in zip(micro[::2], micro[1::2]))  # ragged: a mean of means would differ
    assert [p["items_per_update"] for p in points] == pytest.approx(expected_items, rel=1e-9)


def test_an_inf_gradient_on_one_tp_rank_skips_the_update_on_every_rank(run: dict[str, Any]) -> None:
    """Under TP=2 with fp16 loss scaling and with skip_nonfinite, an inf in rank 1's shard of one
    gradient at update 5 skips that update on both ranks: both apply 19 of 20 and count one skip,
    their copies of the replicated bias stay equal, the fp16 loss scale halves once (256 -> 128)
    on both, grad_norm is not logged for it; the runs equal 1-process loops without update 5
    (skip_nonfinite to 1e-5, fp16 to the fp16 autocast loop's 1e-4)."""
    for name in ("fp16", "skip"):
        records = _numerics(run, name)
        assert [r["step"] for r in records] == [T.UPDATES - 1] * 2
        assert [r["num_skipped"] for r in records] == [1, 1]
        assert records[0]["bias"] == records[1]["bias"]
        points = records[0]["points"]
        assert [p["skipped"] for p in points] == [float(i == T.POISONED_UPDATE - 1) for i in range(T.UPDATES)]
        assert ["grad_norm" in p for p in points] == [i != T.POISONED_UPDATE - 1 for i in range(T.UPDATES)]
    fp16 = _numerics(run, "fp16")
    assert [r["loss_scale"] for r in fp16] == [128.0, 128.0]
    assert [p["loss_scale"] for p in fp16[0]["points"]] == [256.0] * T.POISONED_UPDATE + [128.0] * (
        T.UPDATES - T.POISONED_UPDATE)
    skipped, _ = T.hand_written("mlp", skip=T.POISONED_UPDATE - 1)
    whole, _ = T.hand_written("mlp")
    assert _max_diff(run, "skip", skipped) < 1e-5 and _max_diff(run, "skip", whole) > 1e-2
    fp16_loop, _ = T.hand_written("mlp", skip=T.POISONED_UPDATE - 1, autocast=torch.float16)
    assert _max_diff(run, "fp16", fp16_loop) < 1e-4


def test_bf16_under_tp_trains_as_the_one_process_bf16_autocast_loop(run: dict[str, Any]) -> None:
    """with_precision("bf16") under TP=2 runs the forward in bf16: after 20 updates its fp32
    parameters are within bf16's rounding (1e-3) of a 1-process torch.autocast(bfloat16) loop and
    further than 1e-4 from the fp32 loop (which the fp32 TP run matches to 1e-5)."""
    bf16, _ = T.hand_written("mlp", autocast=torch.bfloat16)
    fp32, _ = T.hand_written("mlp")
    assert _max_diff(run, "bf16", bf16) < 1e-3 < _max_diff(run, "bf16", fp32) * 10
    assert all(v.dtype == torch.float32 for v in _part(run["tensors"][0], "bf16.").values())
    assert [r["step"] for r in _numerics(run, "bf16")] == [T.UPDATES] * 2


def test_each_rank_holds_half_of_every_split_layer_and_reads_the_whole_batch(run: dict[str, Any]) -> None:
    """The plan's column-wise layers keep half of the rows, row-wise ones half of the columns
    (DTensors; in the byte LM each block's qkv, proj and MLP: one of the 2 heads per rank), the
    rest (embedding, positions, norms) stays whole; the optimizer holds the model's parameters, and each
    update counts its 4 samples once (the 2 ranks of the group read the same batch)."""
    for rank in range(2):
        mlp = run["json"][rank]["mlp"]
        assert mlp["local_shapes"] == {"0.weight": [16, 4], "0.bias": [16], "2.weight": [1, 16], "2.bias": [1]}
        assert set(mlp["types"].values()) == {"DTensor"}
        lm = run["json"][rank]["lm"]
        for block in ("blocks.0", "blocks.1"):  # the whole block: attention by heads (1 of 2 each), and MLP
            assert {k: v for k, v in lm["local_shapes"].items() if k.startswith(block + ".") and "norm" not in k} == {
                f"{block}.qkv.weight": [24, 16], f"{block}.qkv.bias": [24], f"{block}.proj.weight": [16, 8],
                f"{block}.proj.bias": [16], f"{block}.mlp.0.weight": [32, 16], f"{block}.mlp.0.bias": [32],
                f"{block}.mlp.2.weight": [16, 32], f"{block}.mlp.2.bias": [16]}
        split = {k for k, v in lm["types"].items() if v == "DTensor"}
        assert split == {f"blocks.{i}.{p}" for i in (0, 1) for p in (
            "qkv.weight", "qkv.bias", "proj.weight", "proj.bias", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight",
            "mlp.2.bias")}
        for kind in ("mlp", "lm"):
            assert run["json"][rank][kind]["optimizer_params_are_model_params"] is True
            assert all(abs(n - T.BATCH) < 1e-9 for n in run["json"][rank][kind]["samples_per_update"])


def test_clip_over_plain_tensors_and_dtensors_on_two_meshes_is_the_global_norm(pool: Pools) -> None:
    """Gradients that are plain, sharded, replicated, sharded on another (2-D) mesh and Partial
    clip to the exact global 2-norm and inf-norm of the whole gradients, each counted once."""
    for result in pool.call(*LAUNCH, function="tp_checks:clip_mixed"):
        assert result["types"] == ["Tensor", "DTensor", "DTensor", "DTensor", "DTensor"]
        assert result["norm"] == pytest.approx(result["expected_norm"], rel=1e-6)
        assert result["inf_norm"] == pytest.approx(result["expected_inf_norm"], rel=1e-6)
        assert result["expected_norm"] > 1.0 and result["clipped_error"] < 1e-6


def test_tensor_parallel_validates_its_arguments() -> None:
    """tensor_parallel refuses an unknown style, a non-'auto' string, an empty plan, size 0 and
    replicate(), naming the argument."""
    with pytest.raises(ValueError, match="style of 'a' is 'diagonal'"):
        af.tensor_parallel({"a": "diagonal"}, size=2)
    with pytest.raises(ValueError, match="must be 'auto'"):
        af.tensor_parallel("mine", size=2)
    with pytest.raises(ValueError, match="names no module"):
        af.tensor_parallel({}, size=2)
    with pytest.raises(ValueError, match="size"):
        af.tensor_parallel({"a": "colwise"}, size=0)
    with pytest.raises(af.TransformError, match="shard_params"):
        af.compose(af.replicate(), af.tensor_parallel({"a": "colwise"}, size=2))(af.train_step(P.mse))
    step = af.tensor_parallel({"a": "colwise"}, size=2)(af.train_step(P.mse))
    assert Mesh.of(step, 4).data_coordinates(3) == (1, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel\(size=2\): one copy of the model spans 2 ranks, and the "
                                         "world of 3 processes cannot be split"):
        Mesh.of(step, 3)


@pytest.fixture(scope="module")
def saved(pool: Pools, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("tp_ckpt")
    results = pool.call(*LAUNCH, function="tp_checks:checkpoints", out=str(out), timeout_s=300)
    return {"out": out, "json": results,
            "tensors": [load_file(out / f"ckpt_rank{r}.safetensors") for r in range(2)]}


def _part(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def test_a_tp_run_resumed_mid_epoch_from_its_checkpoint_is_bitwise_the_whole_run(saved: dict[str, Any]) -> None:
    """TP=2 with accumulate(2): stopped after 3 updates (mid-epoch), checkpointed, and resumed by
    a fresh state, it ends with bitwise the parameters and AdamW moments of the uninterrupted run."""
    assert saved["json"][0]["steps"] == [10, 3, 10] and saved["json"][0]["stopped_epoch_micro_step"] == 6
    for rank in range(2):
        tensors = saved["tensors"][rank]
        for what in ("", "_optimizer"):
            whole, resumed = _part(tensors, f"whole{what}."), _part(tensors, f"resumed{what}.")
            assert whole.keys() == resumed.keys() and whole
            assert all(torch.equal(whole[k], resumed[k]) for k in whole), what


def test_a_tp_checkpoint_loads_into_one_unsharded_process(saved: dict[str, Any]) -> None:
    """The DCP checkpoint of the TP=2 run loads into a plain 1-process state (this one) with the
    stopped run's gathered parameters and AdamW moments, bitwise, at step 3."""
    path = saved["out"] / "ckpt" / "step_00000003"
    state = af.load(path, into=T.make_state("lm"))
    assert state.step == 3
    stopped = _part(saved["tensors"][0], "stopped.")
    got = state.model.state_dict()
    assert got.keys() == stopped.keys()
    assert all(torch.equal(got[k], stopped[k]) for k in stopped)
    moments = _part(saved["tensors"][0], "stopped_optimizer.")
    names = {id(p): n for n, p in state.model.named_parameters()}
    loaded = {f"{names[id(p)]}/{k}": v for p, e in state.optimizer.state.items() for k, v in e.items() if k != "step"}
    assert loaded.keys() == moments.keys() and moments
    assert all(torch.equal(loaded[k], moments[k]) for k in moments)


def test_save_model_from_a_tp_state_loads_strictly_into_a_fresh_model(saved: dict[str, Any]) -> None:
    """af.save_model of the TP=2 state writes full weights that a fresh unsharded byte LM loads
    with load_state_dict(strict=True), equal to the run's gathered parameters."""
    weights = load_file(saved["out"] / "export" / "model.safetensors")
    model = T.make_model("lm")
    model.load_state_dict(weights, strict=True)
    whole = _part(saved["tensors"][0], "whole.")
    assert all(torch.equal(model.state_dict()[k], whole[k]) for k in whole)


def test_auto_takes_a_transformers_models_own_plan(pool: Pools) -> None:
    """tensor_parallel("auto", size=2) splits a tiny transformers Llama by its _tp_plan (its four
    Hugging Face style names): each rank keeps half of q_proj's rows, of the embedding's rows
    (embedding_rowwise) and of lm_head's (colwise_gather_output), and the logits equal the
    unsplit model's (1e-5). The other documented plan forms, in the same launch: a dict with
    "sequence_parallel" and ParallelStyle objects trains 3 updates equal to the unsplit model
    (1e-5); a plan function gets the group's 1-D mesh and splits the model as it says."""
    for result in pool.call(*LAUNCH, function="tp_checks:auto", timeout_s=300):
        assert result["q_local"] == [16, 32] and result["q_full"] == [32, 32]
        assert result["embed_local"] == [32, 32] and result["lm_head_local"] == [32, 32]
        assert result["max_diff"] < 1e-5
        assert result["sp_step"] == 3 and result["sp_diff"] < 1e-5
        assert result["sp_local"] == {"0.weight": [8, 8], "0.bias": [8], "2.weight": [8, 8], "2.bias": [8],
                                      "3.weight": [8], "3.bias": [8]}
        assert result["fn_meshes"] == [[1, 2, ["tensor"]]] and result["fn_local"] == [8, 8]
        assert result["fn_diff"] < 1e-5


def test_auto_keeps_tied_weights_tied_and_equals_a_one_process_loop(pool: Pools, tmp_path: Any) -> None:
    """tensor_parallel("auto", size=2) with clip(1.0) on a transformers Llama whose embeddings are
    tied (its plan splits the embedding's and lm_head's vocabulary rows alike), and on an LM whose
    own plan leaves its tied embedding out ("auto" splits it as its output layer), ends after 6
    SGD-momentum updates equal (1e-5) to a 1-process loop under every parameter name: the tie
    is kept (one parameter, each rank half of its rows, in the optimizer once, so lm_head trains),
    and the export loads into a fresh model with the trained values."""
    pytest.importorskip("transformers")
    results = pool.call(*LAUNCH, function="tp_checks:tied", out=str(tmp_path), timeout_s=300)
    tied = {"llama": ["model.embed_tokens.weight", "lm_head.weight"], "lm": ["emb.weight", "head.weight"]}
    for kind in ("llama", "lm"):
        initial = dict(T.tied_model(kind).named_parameters(remove_duplicate=False))
        reference = {n: p.detach() for n, p in T.tied_hand_written(kind).named_parameters(remove_duplicate=False)}
        assert not torch.equal(initial[tied[kind][1]], reference[tied[kind][1]])  # the output layer trained
        for rank in range(2):
            record = results[rank][kind]
            assert record["step"] == T.TIED_UPDATES and record["tied"] == tied[kind]
            assert record["optimizer_holds_each_parameter_once"]
            assert record["tied_local"] == [32, record["tied_full"][1]] and record["tied_full"][0] == 64
            got = _part(load_file(tmp_path / f"tied-rank{rank}.safetensors"), f"{kind}.")
            assert got.keys() == reference.keys()
            for name, value in reference.items():
                torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5, msg=f"{kind} rank {rank} {name}")
        fresh = T.tied_model(kind)
        fresh.load_state_dict(load_file(tmp_path / f"export-{kind}" / "model.safetensors"), strict=False)
        params = dict(fresh.named_parameters(remove_duplicate=False))
        assert params[tied[kind][0]] is params[tied[kind][1]]
        for name, value in reference.items():
            torch.testing.assert_close(params[name].detach(), value, rtol=0, atol=1e-5)


def test_plans_that_leave_a_split_activation_where_a_whole_one_is_meant_are_refused_on_every_rank(
        pool: Pools) -> None:
    """On 2 ranks, af.run of a plan whose layouts do not fit raises ValueError on both ranks, naming
    the module and its style, before any update and with every parameter as it was: a 'rowwise'
    layer given a whole input (the styles swapped), a 'colwise' one given a split input, a loss
    computed from a split model output (the head 'colwise', which trained each rank on its half of
    the outputs); and a plan function that splits one name of a tied weight only."""
    expected = {
        "swapped": r"'blocks\.0\.up' is 'rowwise', which takes its input split along the last dimension over the 2 "
                   r"ranks .*but its input is whole",
        "head": r"the loss is computed from a model output that is split over the 2 ranks .*comes from 'head' "
                r"\('colwise'\).*ColwiseParallel\(output_layouts=Replicate\(\)\)",
        "unsplit_into_colwise": r"'blocks\.0\.down' is 'colwise', which takes its whole input, but its input is split "
                                r"over the 2 ranks, computed from the output of 'blocks\.0\.up' \('colwise'\)",
    }
    for result in pool.call(*LAUNCH, function="tp_checks:misuse", timeout_s=200):
        for variant, pattern in expected.items():
            record = result[variant]
            assert record["raised"] is not None and record["raised"].startswith("ValueError: tensor_parallel(plan=...)")
            assert re.search(pattern, record["raised"]), record["raised"]
            assert record["updates"] == 0 and record["changed"] == []
        assert re.search(r"split the tied weight emb\.weight = head\.weight two ways", result["tied_function"]["raised"])


def test_styles_on_modules_they_cannot_split_and_tied_weights_split_two_ways_are_refused_before_any_change() -> None:
    """prepare() refuses, naming the pattern, the modules and the fix, with the model as it was: a
    'colwise' wildcard that matches containers (the layers inside suggested), a plan that splits
    GPT-2's Conv1D layers (why it cannot be split), and a dict plan that splits one name of a
    tied weight ('head') and leaves the other ('emb') whole."""
    blocks = T.Blocks()
    state = af.TrainState.create(blocks, torch.optim.SGD(blocks.parameters(), lr=0.1))
    before = list(state.model.parameters())
    with pytest.raises(ValueError, match=r"'blocks\.\*' is 'colwise' and matches 'blocks\.0' \(ModuleDict\), "
                                         r"'blocks\.1' \(ModuleDict\); torch's ColwiseParallel splits nn\.Linear and "
                                         r"nn\.Embedding layers only; name the layers inside it, e\.g\. 'blocks\.\*\.up', "
                                         r"'blocks\.\*\.down'"):
        af.backends.CPU().prepare(af.tensor_parallel({"blocks.*": "colwise"}, size=1)(af.train_step(P.mse)), state)
    assert list(state.model.parameters()) == before and not any(hasattr(p, "to_local") for p in before)
    tied = T.TiedLM()
    state = af.TrainState.create(tied, torch.optim.SGD(tied.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"'emb\.weight' and 'head\.weight' are one tied weight, and the plan splits "
                                         r"it two ways: 'emb\.weight' \(left whole\), 'head\.weight' \('colwise'\)"):
        af.backends.CPU().prepare(af.tensor_parallel({"head": "colwise"}, size=1)(af.train_step(P.mse)), state)
    assert tied.head.weight is tied.emb.weight and not hasattr(tied.emb.weight, "to_local")
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64,
                                                                n_positions=16))
    state = af.TrainState.create(gpt2, torch.optim.SGD(gpt2.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"'transformer\.h\.\*\.mlp\.c_fc' is 'colwise' and matches "
                                         r"'transformer\.h\.0\.mlp\.c_fc' \(Conv1D\).*transformers' Conv1D \(GPT-2's "
                                         r"layers\) holds its weight transposed.*no tensor-parallel plan for Conv1D"):
        af.backends.CPU().prepare(af.tensor_parallel({"transformer.h.*.mlp.c_fc": "colwise",
                                                      "transformer.h.*.mlp.c_proj": "rowwise"}, size=1)(
            af.train_step(P.mse)), state)


def test_auto_refuses_a_style_it_does_not_map_by_name() -> None:
    """"auto" with a model whose own plan names a style accelfn does not map (transformers'
    "local_colwise") raises NotImplementedError naming the module and the style, before any change."""
    state = T.make_state("mlp")
    state.model._tp_plan = {"0": "colwise", "2": "local_colwise"}  # type: ignore[assignment]
    before = [p for p in state.model.parameters()]
    with pytest.raises(NotImplementedError, match="gives '2' the style 'local_colwise'"):
        af.backends.CPU().prepare(af.tensor_parallel("auto", size=1)(af.train_step(P.mse)), state)
    assert list(state.model.parameters()) == before and not any(hasattr(p, "to_local") for p in before)


def test_auto_without_a_plan_and_a_pattern_matching_nothing_are_refused_before_any_change() -> None:
    """prepare() refuses "auto" for a model without _tp_plan, and a pattern that matches no
    module, naming them, and leaves the model's parameters as they were."""
    state = T.make_state("mlp")
    before = [p for p in state.model.parameters()]
    with pytest.raises(ValueError, match="Sequential has none"):
        af.backends.CPU().prepare(af.tensor_parallel("auto", size=1)(af.train_step(P.mse)), state)
    with pytest.raises(ValueError, match="'blocks.0' matches no module"):
        af.backends.CPU().prepare(af.tensor_parallel({"blocks.0": "colwise"}, size=1)(af.train_step(P.mse)), state)
    assert list(state.model.parameters()) == before


def test_a_manifest_describes_plans_and_units_that_are_code() -> None:
    """The manifest's record of a program whose tensor_parallel plan holds a ParallelStyle or is
    a function, or whose shard_params units are a predicate or classes, is JSON naming them
    (it raised 'not JSON serializable' before), the same in any process."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    from accelfn.checkpoint import _format

    def record(*transforms: Any) -> Any:
        return _format.transforms_record(af.compose(*transforms)(af.train_step(P.mse)))

    def parallelize(model: torch.nn.Module, mesh: Any) -> None:
        pass

    assert record(af.tensor_parallel({"0": ColwiseParallel()}, size=2))[0]["plan"] == [["0", "ColwiseParallel"]]
    assert record(af.tensor_parallel(parallelize, size=2))[0]["plan"].endswith("parallelize")
    assert record(af.shard_params(units={torch.nn.Linear, torch.nn.LayerNorm}))[0]["units"] == ["LayerNorm", "Linear"]
    assert record(af.shard_params(units=lambda name, m: True))[0]["units"].endswith("<lambda>")


def test_a_tp_checkpoint_resumes_mid_epoch_in_one_unsharded_process(saved: dict[str, Any]) -> None:
    """The TP=2 checkpoint written after 3 updates (micro-batch 6 of epoch 0, one data shard)
    resumes in one plain process at that same micro-batch (the group read one shard) and ends
    equal to the hand-written 1-process loop (1e-5)."""
    step = af.compose(af.shard_data(seed=P.SHARD_SEED), af.accumulate(2), af.clip(T.CLIP))(
        af.train_step(T.loss("lm")))
    with pytest.warns(UserWarning, match="TensorParallel"):  # another program: said once, as for any layout
        state = af.run(step, T.make_state("lm"), T.loader("lm"), backend=af.backends.CPU(), epochs=T.EPOCHS,
                       resume=saved["out"] / "ckpt" / "step_00000003", progress=False)
    model, _ = T.hand_written("lm", accumulate=2)
    assert state.step == 10
    for name, value in model.state_dict().items():
        torch.testing.assert_close(state.model.state_dict()[name], value, rtol=1e-5, atol=1e-5, msg=name)



def test_byte_lm_refuses_a_tp_size_that_does_not_divide_its_heads(tmp_path: Any) -> None:
    """examples/byte_lm.py's --tp splits the attention by heads: tp_plan and main(tp=3) with 4
    heads raise ValueError naming both and the sizes that divide, before anything runs."""
    lm = T.byte_lm()
    message = (r"--tp 3: tensor parallelism splits the attention by heads, and the 4 heads \(--heads\) cannot be "
               r"divided over 3 ranks; use a --tp that divides --heads \(one of 1, 2, 4\)")
    with pytest.raises(ValueError, match=message):
        lm.tp_plan(lm.Config(heads=4), 3)
    with pytest.raises(ValueError, match=message):
        lm.main(lm.Config(heads=4), run_dir=str(tmp_path / "run"), tp=3, progress=False)
    assert not (tmp_path / "run").exists()
    assert lm.tp_plan(lm.Config(heads=4), 2) == lm.TP_PLAN
