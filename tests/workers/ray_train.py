"""Worker for tests/tracking/test_ray.py: accelfn under Ray Train's ``TorchTrainer``, on one
local Ray cluster started here (2 CPUs, 2 workers, gloo).

Usage: python tests/workers/ray_train.py OUT [RUN ...]
Runs ``<scenario>-whole`` (uninterrupted) and ``<scenario>-failed`` (rank 1 raises once at
step 10, a marker file says it did, and ``FailureConfig(max_failures=1)`` restarts the group
from the checkpoint Ray holds), with scenario ``replicate`` or ``shard_params``; by default
``replicate-whole``, ``replicate-failed`` and ``shard_params-failed`` (each TorchTrainer run
costs a worker group's start, so the uninterrupted reference is run once); ``<scenario>-async``
is the uninterrupted run with ``Checkpoints(asynchronous=True)``. Each run exports
its final weights (``af.save_model``) to OUT/<run>/weights and writes what Ray's ``Result``
holds to OUT/<run>.json; every attempt of every rank appends where it started to
OUT/<run>.starts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import ray
import ray.train
import torch
import torch.nn.functional as F
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch.utils.data import DataLoader, TensorDataset

import accelfn as af

FAIL_AT = 10  # rank 1 raises after this update (checkpoints every 4: resumes from step 8)
EPOCHS = 2  # 64 samples, batches of 4, 2 ranks: 8 updates an epoch, 16 in all


def train_loop(config: dict[str, Any]) -> None:
    out, run = Path(config["out"]), config["run"]
    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.25), torch.nn.Linear(8, 1))
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.05))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    parallel = af.shard_params() if config["scenario"] == "shard_params" else af.replicate()
    program = af.compose(af.shard_data(), parallel)(af.train_step(lambda m, b: F.mse_loss(m(b[0]), b[1])))
    marker = out / f"{run}.failed"

    def fail_once(state: af.TrainState, backend: Any) -> None:
        if config["fail"] and rank == 1 and state.step == FAIL_AT and not marker.exists():
            marker.touch()
            raise RuntimeError(f"injected failure on rank 1 at step {FAIL_AT}")

    with af.RayTrain.resume() as checkpoint:
        with open(out / f"{run}.starts", "a") as f:
            f.write(f"{rank} {'start' if checkpoint is None else checkpoint.name}\n")
        state = af.run(program, state, data, epochs=EPOCHS, checkpoints=af.Checkpoints(
            out / f"{run}-checkpoints", every_steps=4, asynchronous=config["async"]), resume=checkpoint,
            backend=af.backends.auto(),
            trackers=[af.RayTrain()], log_every=4, progress=False, hooks=[af.Hook(fail_once, every_steps=1)])
    af.save_model(state, out / f"{run}" / "weights")


def fit(out: Path, scenario: str, kind: str) -> None:
    run, fail = f"{scenario}-{kind}", kind == "failed"
    from tests.workers.ray_train import train_loop as by_name  # pickled by reference, not by value

    trainer = TorchTrainer(
        by_name,
        train_loop_config={"out": str(out), "run": run, "scenario": scenario, "fail": fail,
                           "async": kind == "async"},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(name=run, storage_path=str(out / "ray_results"),
                             failure_config=FailureConfig(max_failures=1 if fail else 0)),
    )
    result = trainer.fit()
    checkpoint = result.checkpoint
    (out / f"{run}.json").write_text(json.dumps({
        "metrics": {k: v for k, v in result.metrics.items() if isinstance(v, (int, float, str))},
        "checkpoint": None if checkpoint is None else checkpoint.path,
        "checkpoints": [c.path for c, _ in result.best_checkpoints],
        "error": None if result.error is None else repr(result.error),
    }))


def main() -> None:
    out = Path(sys.argv[1]).resolve()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for run in sys.argv[2:] or ["replicate-whole", "replicate-failed", "shard_params-failed"]:
            scenario, kind = run.split("-")
            fit(out, scenario, kind)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
