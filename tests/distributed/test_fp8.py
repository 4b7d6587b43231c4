"""with_precision("fp8") under shard_params on 2 gloo processes with float8 all-gathers (issue 36,
Acceptance 2).

One launch of tests/workers/fp8_checks.py records 50 updates in bf16 and in fp8 (loss curves),
a run stopped at update 25, saved and resumed in a fresh state (and in the trained one), and a
save_model export; each test checks one part of it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import fp8 as H
from tests.helpers import launch as _launch
from tests.helpers.pool import Pools

pytestmark = [pytest.mark.multiprocess, H.requires_fp8]


@pytest.fixture(scope="module")
def run(pool: Pools, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("fp8_checks")
    pool.launch("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60", script="fp8_checks.py",
                script_args=("--out", out), cwd=out, timeout_s=600)
    return {"out": out, "json": _launch.read_ranks(out, 2),
            "tensors": [load_file(out / f"rank{r}.safetensors") for r in range(2)]}


def _prefixed(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def test_fp8_stays_within_the_documented_tolerance_of_bf16_over_50_updates(run: dict[str, Any]) -> None:
    """Each of the 50 logged fp8 losses is within H.TOLERANCE (5%, docs/03) of bf16's at the same
    update, the curve falls as bf16's does, and it is not bf16's (the matmuls ran in float8)."""
    bf16, fp8 = run["json"][0]["bf16_losses"], run["json"][0]["fp8_losses"]
    assert len(bf16) == len(fp8) == H.UPDATES
    assert run["json"][0]["fp8_step"] == H.UPDATES
    relative = [abs(a - b) / b for a, b in zip(fp8, bf16)]
    assert max(relative) <= H.TOLERANCE, relative
    assert fp8[-1] < fp8[0] / 5 and bf16[-1] < bf16[0] / 5
    assert fp8 != bf16


def test_weights_are_all_gathered_in_float8_and_stay_fp32_shards(run: dict[str, Any]) -> None:
    """Under float8_all_gather, FSDP2 all-gathers float8 e4m3 (the converted weights) and bf16
    (biases, the head) where bf16 gathers only bf16; every converted weight's shard is torchao's
    float8-cast wrapper over fp32 data; the head stays an nn.Linear."""
    for rank in range(2):
        r = run["json"][rank]
        assert r["bf16_gathered"] == ["bfloat16"]
        assert r["fp8_gathered"] == ["bfloat16", "float8_e4m3fn"]
        assert r["fp8_param_dtypes"] == ["torch.float32"]
        assert r["fp8_layers"] == {"inp": "Float8Linear", "blocks.0.up": "Float8Linear",
                                   "blocks.0.down": "Float8Linear", "blocks.1.up": "Float8Linear",
                                   "blocks.1.down": "Float8Linear", "head": "Linear"}
        wrapped = {n for n, t in r["fp8_local_weight_types"].items() if t == "WeightWithDynamicFloat8CastTensor"}
        assert wrapped == {f"{n}.weight" for n, t in r["fp8_layers"].items() if t == "Float8Linear"}


def test_a_checkpoint_resumes_bitwise(run: dict[str, Any]) -> None:
    """Stopped at update 25, saved, loaded into a fresh state (other initial weights) and into
    the trained state, training to 50 gives bitwise the uninterrupted run's losses, parameters
    and optimizer state on both ranks."""
    for rank in range(2):
        r, tensors = run["json"][rank], run["tensors"][rank]
        assert r["resumed_from"] == H.RESUME_AT and r["resumed_step"] == H.UPDATES
        assert r["resumed_optimizer_equal"] is True
        straight = _prefixed(tensors, "fp8.")
        for prefix in ("resumed.", "reloaded."):
            again = _prefixed(tensors, prefix)
            assert again.keys() == straight.keys()
            assert all(torch.equal(again[k], straight[k]) for k in straight), (rank, prefix)
    losses = run["json"][0]
    assert losses["resumed_losses"] == losses["reloaded_losses"] == losses["fp8_losses"][H.RESUME_AT:]


def test_the_export_holds_fp32_weights_that_load_into_the_unconverted_model(run: dict[str, Any]) -> None:
    """save_model writes the gathered fp32 master weights; a plain Net (nn.Linear layers) loads
    them strictly and equals the trained fp8 model's parameters."""
    weights = load_file(run["out"] / "export" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float32}
    model = H.Net()
    model.load_state_dict(weights, strict=True)
    straight = _prefixed(run["tensors"][0], "fp8.")
    assert model.state_dict().keys() == straight.keys()
    assert all(torch.equal(model.state_dict()[k], straight[k]) for k in straight)
