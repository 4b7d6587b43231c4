"""af.RayTrain under a real local Ray cluster: Ray's Result holds accelfn's metrics and
checkpoints, and a worker failure restarts and resumes bitwise (tests/workers/ray_train.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

ROOT = Path(__file__).resolve().parents[2]
RUNS = ("replicate-whole", "replicate-failed", "shard_params-failed", "replicate-async")


@pytest.fixture(scope="module")
def ray_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One Ray cluster (one subprocess) running the three TorchTrainer runs of RUNS."""
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.train") is None:
        pytest.skip('Ray Train is not installed (pip install "accelfn[ray]"; .ci/run installs it where it can)')
    out = tmp_path_factory.mktemp("ray")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "workers" / "ray_train.py"), str(out), *RUNS],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return out


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(path / "weights" / "model.safetensors")


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("scenario", ["replicate", "shard_params"])
def test_ray_result_holds_metrics_and_checkpoints_and_a_failure_resumes_bitwise(ray_runs: Path, scenario: str) -> None:
    """Under TorchTrainer (2 gloo workers), af.RayTrain reports the run's metrics and each
    checkpoint to Ray from every rank, and a failure of rank 1 at step 10 restarts from Ray's
    step-8 checkpoint and ends bitwise equal to the uninterrupted replicate run (with 2 ranks
    in fp32, shard_params' reduce-scatter and replicate's all-reduce average the same two
    gradients, so an uninterrupted shard_params run ends there too)."""
    whole = json.loads((ray_runs / "replicate-whole.json").read_text())
    failed = json.loads((ray_runs / f"{scenario}-failed.json").read_text())
    for result in (whole, failed):
        assert result["error"] is None
        assert result["metrics"]["step"] == 16  # 2 epochs of 8 updates; the last report is the step-16 checkpoint
        assert {"loss", "samples_per_s"} <= set(result["metrics"])
        assert Path(result["checkpoint"]).name == "step_00000016"
        assert (Path(result["checkpoint"]) / "manifest.json").is_file()
        assert sorted(Path(p).name for p in result["checkpoints"]) == [
            "step_00000004", "step_00000008", "step_00000012", "step_00000016"]
    assert whole["metrics"]["loss"] == failed["metrics"]["loss"]
    # every rank of the first attempt started fresh, of the second from Ray's step-8 checkpoint
    assert sorted((ray_runs / "replicate-whole.starts").read_text().splitlines()) == ["0 start", "1 start"]
    assert (ray_runs / f"{scenario}-failed.failed").exists()
    assert sorted((ray_runs / f"{scenario}-failed.starts").read_text().splitlines()) == [
        "0 start", "0 step_00000008", "1 start", "1 step_00000008"]
    reference, resumed = _weights(ray_runs / "replicate-whole"), _weights(ray_runs / f"{scenario}-failed")
    assert reference.keys() == resumed.keys() and len(reference) == 4
    for name in reference:
        assert torch.equal(reference[name], resumed[name]), name


@pytest.mark.timeout(1000)
def test_background_checkpoints_reach_ray_complete(ray_runs: Path) -> None:
    """With Checkpoints(asynchronous=True), every checkpoint Ray copies to its storage is
    complete (af.load checks every file's checksum) and holds the synchronous run's state of
    its step, the weights file byte for byte: each is reported once its background write
    has ended, the last when the run ends."""
    import accelfn as af

    def load(path: Path) -> af.TrainState:
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.25), torch.nn.Linear(8, 1))
        return af.load(path, into=af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.05)))

    result = json.loads((ray_runs / "replicate-async.json").read_text())
    assert result["error"] is None
    assert result["metrics"]["step"] == 16 and Path(result["checkpoint"]).name == "step_00000016"
    stored = sorted(Path(p) for p in result["checkpoints"])
    assert [p.name for p in stored] == ["step_00000004", "step_00000008", "step_00000012", "step_00000016"]
    for path in stored:
        synchronous = ray_runs / "replicate-whole-checkpoints" / path.name
        assert (path / "model.safetensors").read_bytes() == (synchronous / "model.safetensors").read_bytes()
        got, expected = load(path), load(synchronous)
        assert got.step == expected.step == int(path.name.removeprefix("step_"))
        for a, b in zip(got.model.state_dict().values(), expected.model.state_dict().values()):
            assert torch.equal(a, b), path.name
