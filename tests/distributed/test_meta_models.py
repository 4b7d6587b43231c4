"""Models built on the meta device under shard_params and tensor_parallel: 2 pooled processes.

Each rank materializes only its own shards (accelfn/distributed/meta.py); the scenarios
are tests/workers/meta_checks.py's.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import accelfn as af
from tests.helpers.pool import Pools
from tests.workers import meta_checks as M

pytestmark = pytest.mark.multiprocess

LAUNCH = ("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "120")


def test_a_meta_model_materializes_the_parameters_of_a_normally_built_one(pool: Pools, tmp_path) -> None:
    """Built on meta after manual_seed(0), the model prepared under shard_params() and under
    tensor_parallel(size=2) has bitwise the full parameters of Net() built on the CPU after
    manual_seed(0), while each rank holds only its part (none of it on meta); af.load_model
    then reads a model.safetensors into the shards, bitwise."""
    torch.manual_seed(1)
    weights = M.Net().state_dict()
    save_file(weights, tmp_path / "model.safetensors")
    results = pool.call(*LAUNCH, function="meta_checks:initial", out=str(tmp_path),
                        weights=str(tmp_path / "model.safetensors"), timeout_s=300)
    torch.manual_seed(0)
    reference = M.Net().state_dict()
    total = sum(v.numel() for v in reference.values())
    for rank in range(2):
        tensors = load_file(tmp_path / f"meta_rank{rank}.safetensors")
        for layout in ("fsdp", "tp"):
            got = {k[len(layout) + 1:]: v for k, v in tensors.items() if k.startswith(layout + ".")}
            assert got.keys() == reference.keys()
            assert all(torch.equal(got[k], reference[k]) for k in reference), layout
            loaded = {k[len(layout) + 8:]: v for k, v in tensors.items() if k.startswith(layout + "_loaded.")}
            assert loaded.keys() == weights.keys()
            assert all(torch.equal(loaded[k], weights[k]) for k in weights), layout
            assert results[rank][layout]["on_meta"] is False
    assert sum(r["fsdp"]["local_numel"] for r in results) == total
    assert results[0]["tp"]["local_numel"] < total


def test_a_150m_parameter_meta_model_trains_sharded_below_the_memory_of_its_full_state(pool: Pools) -> None:
    """A 151M-parameter model built on meta takes one AdamW update under shard_params() on 2
    processes, each process's peak RSS (the process's own 0.25 GB included) staying below the
    full model's parameter + AdamW bytes (1.8 GB), with half of the parameters on each rank.
    (Sharded, a rank peaks near its start plus 3/4 of the full state, so the bound bites from
    about 1 GB of full state on: 151M parameters leave it about 0.2 GB of margin.)"""
    results = pool.call(*LAUNCH, function="meta_checks:big", width=4096, depth=9, timeout_s=600)
    for result in results:
        assert result["numel"] == 9 * (4096 * 4096 + 4096) > 150_000_000
        assert result["step"] == 1 and result["local_numel"] * 2 == result["numel"]
        assert result["peak_rss"] < result["full_bytes"], result
    print({r: (results[r]["rss_at_start"] >> 20, results[r]["peak_rss"] >> 20) for r in range(2)}, "MiB")


def test_a_meta_model_without_sharding_or_an_initializer_is_refused_by_name() -> None:
    """prepare() refuses a meta model whose step neither shards nor splits it, and one with a
    parameter of its own that no reset_parameters() initializes, before anything changes."""
    with torch.device("meta"):
        model = M.Net()
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.train_step(lambda m, b: m(b).sum())
    with pytest.raises(ValueError, match="has neither"):
        af.backends.CPU().prepare(step, state)

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        odd = Scaled()
    state = af.TrainState.create(odd, torch.optim.SGD(odd.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"<root> \(Scaled\) hold parameters"):
        af.backends.CPU().prepare(af.shard_params()(step), state)
    assert odd.scale.is_meta


def test_a_meta_built_transformers_llama_materializes_with_its_own_init_and_loads_save_pretrained(
        pool: Pools, tmp_path) -> None:
    """A tied transformers Llama built on meta and prepared under shard_params() or
    tensor_parallel("auto", size=2) on 2 processes materializes with its own init (no module needs
    a reset_parameters): the rotary inv_freq buffers recomputed (equal to a CPU build's), the
    RMSNorm weights ones, the linear and embedding weights drawn with std initializer_range (0.02),
    the tie kept; af.load_model then reads what save_pretrained wrote as several shards and an
    index (lm_head.weight and the rotary buffers in no file) and the logits equal the saved
    model's (1e-5)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    saved = transformers.LlamaForCausalLM(M.llama_config())
    saved.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    tokens = torch.randint(0, 64, M.TOKENS, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = saved(input_ids=tokens).logits
    results = pool.call(*LAUNCH, function="meta_checks:llama", out=str(tmp_path), weights=str(tmp_path / "hf"),
                        timeout_s=400)
    for rank in range(2):
        logits = load_file(tmp_path / f"llama_rank{rank}.safetensors")
        for layout in ("fsdp", "tp"):
            record = results[rank][layout]
            assert record["on_meta"] is False and record["tied"] is True
            assert record["inv_freq"] == saved.model.rotary_emb.inv_freq.tolist()
            assert record["original_inv_freq"] == saved.model.rotary_emb.inv_freq.tolist()
            assert record["norms_are_ones"]
            assert abs(record["linear_std"] - 0.02) < 0.002 and abs(record["linear_mean"]) < 0.002
            assert abs(record["embedding_std"] - 0.02) < 0.003
            torch.testing.assert_close(logits[f"{layout}.logits"], want, rtol=0, atol=1e-5)


def test_an_initializer_that_leaves_a_tensor_unset_is_refused_by_name() -> None:
    """Materializing a meta model whose module's reset_parameters() does not fill a buffer it
    holds raises ValueError naming the module and the buffer (it was left as uninitialized memory)."""

    class Half(torch.nn.Linear):
        def __init__(self) -> None:
            super().__init__(3, 3)
            self.register_buffer("scale", torch.ones(3))  # reset_parameters() does not know it

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), Half())
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings():  # one process shards nothing, as it says
        warnings.filterwarnings("ignore", r"\[shard-params-one-process\]", af.PlanWarning)
        with pytest.raises(ValueError, match=r"the initialization of 1 \(Half\) left scale unset"):
            af.backends.CPU().prepare(af.shard_params()(af.train_step(lambda m, b: m(b).sum())), state)


def test_load_model_reads_a_save_pretrained_directory_without_its_non_persistent_buffers(tmp_path) -> None:
    """af.load_model reads what save_pretrained wrote (shards and their index; tied lm_head.weight
    and the rotary embedding's non-persistent inv_freq in no file) into a plain transformers Llama
    built with another seed: every parameter equals the saved model's, bitwise, and inv_freq is
    the model's own."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    saved = transformers.LlamaForCausalLM(M.llama_config())
    saved.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(M.llama_config())
    af.load_model(af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1)), tmp_path / "hf")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.state_dict().items())
    assert torch.equal(model.model.rotary_emb.inv_freq, saved.model.rotary_emb.inv_freq)


def test_load_model_is_strict_about_names_and_shapes(tmp_path) -> None:
    """af.load_model loads save_model's folder into a plain model bitwise, and refuses weights
    with a missing, an unexpected or a misshapen tensor, naming it."""
    torch.manual_seed(2)
    source = M.Net()
    state = af.TrainState.create(source, torch.optim.SGD(source.parameters(), lr=0.1))
    af.save_model(state, tmp_path / "export")
    torch.manual_seed(3)
    model = M.Net()
    fresh = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    af.load_model(fresh, tmp_path / "export")
    assert all(torch.equal(fresh.model.state_dict()[k], v) for k, v in source.state_dict().items())
    weights = dict(source.state_dict())
    del weights["out.bias"]
    weights["extra"] = torch.zeros(1)
    save_file(weights, tmp_path / "odd.safetensors")
    with pytest.raises(af.CheckpointError, match=r"missing \['out.bias'\], unexpected \['extra'\]"):
        af.load_model(fresh, tmp_path / "odd.safetensors")
    weights = {**source.state_dict(), "out.bias": torch.zeros(2)}
    save_file(weights, tmp_path / "shape.safetensors")
    with pytest.raises(af.CheckpointError, match=r"out.bias has shape \(2,\)"):
        af.load_model(fresh, tmp_path / "shape.safetensors")
