"""DTensors in TrainState.extra (an EMA of a sharded model) through the sharded checkpoint:
one pooled 2-process scenario (tests/workers/extra_dtensors.py), its checkpoint also loaded
here into one unsharded process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from safetensors.torch import load_file

import accelfn as af
from tests.workers.extra_dtensors import EMA, make_state

pytestmark = pytest.mark.multiprocess

OWN = ("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60")


@pytest.fixture(scope="module")
def scenario(pool: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("extra_dtensors")
    results = pool.call(*OWN, function="extra_dtensors:check", out=str(out), cwd=out, timeout_s=300)
    return {"results": results, "tensors": [load_file(out / f"rank{r}.safetensors") for r in range(2)], "out": out}


def test_an_ema_of_dtensors_in_extra_resumes_bitwise_on_every_rank(scenario: dict[str, Any]) -> None:
    """An EMA holding DTensor clones of the sharded parameters, checkpointed at step 4 and
    resumed with resume="auto" into a fresh state (whose EMA is empty), ends at step 8 with
    each rank's EMA shards and model bitwise those of the uninterrupted run; af.load of the
    step-4 checkpoint gives each rank its own EMA shards of step 4 exactly, as DTensors, with
    the EMA's plain update count; the two ranks' shards differ (rank 0's would not do)."""
    results, (t0, t1) = scenario["results"], scenario["tensors"]
    num = results[0]["num"]
    assert num == 10
    for r, t in enumerate((t0, t1)):
        assert results[r]["steps"] == [8, 4, 8, 4]
        assert results[r]["updates"] == [8, 4, 8, 4]
        assert results[r]["types"] == ["DTensor"]
        for i in range(num):
            assert torch.equal(t[f"resumed.local.{i}"], t[f"whole.local.{i}"]), (r, i)
            assert torch.equal(t[f"loaded.local.{i}"], t[f"half.local.{i}"]), (r, i)
        for key in (k for k in t if k.startswith("whole.model.")):
            assert torch.equal(t[key.replace("whole.", "resumed.")], t[key])
    assert not torch.equal(t0["half.local.0"], t1["half.local.0"])
    manifest = orjson.loads((scenario["out"] / "ckpt" / "step_00000004" / "manifest.json").read_bytes())
    assert manifest["format_version"] == 6
    assert sorted(manifest["sharded"]["extra"]) == [f"extra/ema/shadow/{i}" for i in range(num)]
    assert manifest["extra"]["ema"]["shadow"] == [None] * num


def test_the_sharded_ema_loads_whole_into_one_unsharded_process(scenario: dict[str, Any]) -> None:
    """The 2-rank checkpoint's EMA of DTensors loads into an unsharded state (an empty EMA) in
    this one process as plain full tensors equal to the gathered EMA, bitwise."""
    loaded = af.load(Path(scenario["out"]) / "ckpt" / "step_00000004", into=make_state())
    ema = loaded.extra["ema"]
    assert isinstance(ema, EMA) and ema.updates == 4
    full = scenario["tensors"][0]
    assert [type(t) for t in ema.shadow] == [torch.Tensor] * len(ema.shadow)
    for i, t in enumerate(ema.shadow):
        assert torch.equal(t, full[f"half.full.{i}"]), i


def test_a_dtensor_in_extra_of_an_unsharded_model_is_refused_before_writing(scenario: dict[str, Any]) -> None:
    """Under replicate (the model not sharded), af.save of a state whose extra holds a DTensor
    raises on every rank, naming where it is and what to keep instead, and writes nothing."""
    for result in scenario["results"]:
        message = result["refused"]
        assert message is not None and message.startswith("extra['ema'].state_dict()['shadow'][0] is a DTensor"), message
        assert "model is not sharded" in message and "t.full_tensor()" in message
        assert result["replicated_written"] is False
