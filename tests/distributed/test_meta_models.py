"""Models built on the meta device under shard_params and tensor_parallel: 2 pooled processes.

Each rank materializes only its own shards (accelfn/distributed/meta.py); the scenarios
are tests/workers/meta_checks.py's.
"""

from __future__ import annotations

from typing import Any

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


def test_a_200m_parameter_meta_model_trains_sharded_below_the_memory_of_its_full_state(pool: Pools) -> None:
    """A 201M-parameter model built on meta takes one AdamW update under shard_params() on 2
    processes, each process's peak RSS staying below the full model's parameter + AdamW bytes
    (2.4 GB), with half of the parameters on each rank."""
    results = pool.call(*LAUNCH, function="meta_checks:big", width=4096, depth=12, timeout_s=600)
    for result in results:
        assert result["numel"] == 12 * (4096 * 4096 + 4096) > 200_000_000
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
