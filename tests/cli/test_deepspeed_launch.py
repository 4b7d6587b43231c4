"""``accelfn launch --deepspeed CFG`` and the DeepSpeed launch-config keys (docs/DeepSpeed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from accelfn.cli.config import DEEPSPEED_ENV, LaunchConfig
from tests.helpers import deepspeed_programs as D
from tests.helpers import launch as _launch


def test_launch_keys_fill_the_config_over_the_file(tmp_path: Path) -> None:
    """zero_stage, offload devices and gradient_accumulation_steps of the launch config are set
    over the file's values and reach the workers as one JSON config; without any, nothing is set."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1, "reduce_bucket_size": 100}, "steps_per_print": 5}))
    config = LaunchConfig(deepspeed_config_file=str(path), zero_stage=3, offload_param_device="cpu",
                          gradient_accumulation_steps=4)
    assert json.loads(config.worker_env()[DEEPSPEED_ENV]) == {
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 100, "offload_param": {"device": "cpu"}},
        "steps_per_print": 5, "gradient_accumulation_steps": 4}
    assert DEEPSPEED_ENV not in LaunchConfig().worker_env()


@pytest.mark.timeout(1200)  # a first run on a machine JIT-builds DeepSpeed's shm_comm op (minutes)
def test_launch_deepspeed_trains_an_unchanged_script(tmp_path: Path) -> None:
    """`accelfn launch --deepspeed cfg.json` of a replicate() script that sets no accumulation
    trains under the file's ZeRO stage and its gradient_accumulation_steps of 2: its parameters
    equal the hand-written loop of 2-micro-batch updates to 1e-5."""
    pytest.importorskip("deepspeed",
                        reason="DeepSpeed is not installed (after torch: pip install --no-build-isolation deepspeed)")
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 2}))
    out = tmp_path / "out.json"
    _launch.launch("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "300", "--deepspeed", cfg,
                   script="deepspeed_script.py", script_args=(out, D.epochs(2)), cwd=tmp_path,
                   env=_launch.environment(TORCH_EXTENSIONS_DIR=D.EXTENSIONS), timeout_s=900)
    got = json.loads(out.read_text())
    assert (got["engine"], got["stage"], got["step"]) == ("DeepSpeedEngine", 2, D.UPDATES)
    expected, _ = D.hand_written(2, None)
    for name, value in expected.items():
        torch.testing.assert_close(torch.tensor(got["params"][name], dtype=torch.float64), value.double().flatten(),
                                   rtol=0, atol=1e-5)
