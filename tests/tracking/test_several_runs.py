"""Several ``af.run`` calls through the same tracker objects, read back with each library's own
reader: a retry by ``find_batch_size`` (a restart from step 0) leaves each step once, the
retry's, and gets a new MLflow/W&B/Comet run; phases and a ``run`` per epoch continue the
same run, each step once.

Readers: ``MlflowClient`` on the SQLite store; ``wandb leet inspect --json`` on the offline
run directories (one per ``wandb.init``, a resumed run has several with its id); the
``messages.json`` of Comet's offline archives; TensorBoard's ``EventAccumulator``; the JSONL
lines.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import torch

import accelfn as af
from tests.helpers.events import read_tensorboard
from tests.helpers.models import classification_data, make_mlp
from tests.helpers.tracking import Recorder
from tests.test_tracking import loss_fn


@pytest.fixture(scope="module")
def mlflow_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One MLflow store for the module's tests (creating its SQLite tables takes seconds)."""
    return tmp_path_factory.mktemp("mlflow")


@pytest.fixture
def trackers(tmp_path: Path, mlflow_dir: Path, monkeypatch: pytest.MonkeyPatch,
             request: pytest.FixtureRequest) -> dict[str, Any]:
    """One tracker of each kind under ``tmp_path`` (MLflow: an experiment of the test's own)."""
    monkeypatch.setenv("COMET_ERROR_TRACKING_ENABLE", "false")  # read once, at its first import: no network
    monkeypatch.setenv("WANDB_SILENT", "true")
    for module in ("mlflow", "wandb", "comet_ml"):
        pytest.importorskip(module, reason="the trackers need mlflow, wandb and comet_ml (the dev extra has them)")
    return {
        "jsonl": af.JSONL(tmp_path / "m.jsonl"),
        "tensorboard": af.TensorBoard(tmp_path / "tb"),
        "mlflow": af.MLflow(mlflow_dir, experiment=request.node.name),
        "wandb": af.WandB("several-runs", dir=tmp_path, mode="offline"),
        "comet": af.Comet("several-runs", dir=tmp_path / "comet", mode="offline"),
    }


def _wandb_records(tracker: af.WandB, run_id: str) -> list[dict[str, Any]]:
    """Every record of every offline directory of the W&B run ``run_id`` (one per init)."""
    records = []
    for run_dir in sorted((tracker.dir / "wandb").glob(f"offline-run-*-{run_id}")):
        records += [json.loads(line) for line in subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
            check=True, capture_output=True, text=True, stdin=subprocess.DEVNULL).stdout.splitlines()]
    return records


def _wandb_ids(tracker: af.WandB) -> set[str]:
    return {d.name.rsplit("-", 1)[1] for d in (tracker.dir / "wandb").glob("offline-run-*")}


def logged(trackers: dict[str, Any], name: str, wandb_records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """The (step, value) points of ``name`` each tracker's current run holds, read back by its
    library's reader, in the order they were logged (W&B: one row per step; MLflow and Comet
    by step)."""
    jsonl = [orjson.loads(line) for line in trackers["jsonl"].path.read_bytes().splitlines()]
    mlflow, comet = trackers["mlflow"], trackers["comet"]
    history = mlflow.client.get_metric_history(mlflow.run_id, name)
    rows = [r["history"] for r in wandb_records if r["type"] == "history"]
    messages = [m for archive in sorted(comet.dir.glob(f"{comet.experiment_key}*.zip"))
                for m in comet_messages_of(archive) if m["type"] == "metric_msg"]
    return {
        "jsonl": [(line["step"], line[name]) for line in jsonl if name in line],
        "tensorboard": read_tensorboard(trackers["tensorboard"].logdir)[name],
        "mlflow": sorted((m.step, m.value) for m in history),
        "wandb": [(r["step"]["num"], r["item"][name]) for r in rows if name in r["item"]],
        "comet": sorted((m["payload"]["metric"]["step"], m["payload"]["metric"]["metricValue"]) for m in messages
                        if m["payload"]["metric"]["metricName"] == name),  # archives: in no order
    }


def comet_messages_of(archive: Path) -> list[dict[str, Any]]:
    """The messages of one Comet offline archive (its messages.json)."""
    with zipfile.ZipFile(archive) as z:
        return [orjson.loads(line) for line in z.read("messages.json").splitlines()]


def check_points(trackers: dict[str, Any], expected: list[tuple[int, float]], name: str = "loss") -> dict[str, Any]:
    """Every tracker's run holds ``expected`` (each step once), TensorBoard as float32;
    returns the W&B run's config."""
    wandb = trackers["wandb"]
    records = _wandb_records(wandb, wandb.run_id)
    for kind, points in logged(trackers, name, records).items():
        want = [(s, float(np.float32(v))) for s, v in expected] if kind == "tensorboard" else expected
        assert [s for s, _ in points] == [s for s, _ in want], kind
        assert [v for _, v in points] == pytest.approx([v for _, v in want], rel=1e-12), kind
    config: dict[str, Any] = {}
    for run in [r["run"] for r in records if r["type"] == "run"]:
        config.update(run["config"]["update"])
    return config


def _close(trackers: dict[str, Any]) -> None:
    for tracker in trackers.values():
        tracker.close()


def train(trackers: list[Any], cpu: af.backends.Backend, batch_size: int, *, state: af.TrainState | None = None,
          fail_above: int | None = None, **totals: int | None) -> af.TrainState:
    """The MLP on 128 samples; with ``fail_above``, a batch larger than that runs out of memory
    (simulated) at the third update, after two logged points."""
    if state is None:
        model = make_mlp()
        state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []

    def loss(model: torch.nn.Module, batch: Any) -> Any:
        calls.append(1)
        if fail_above is not None and len(batch[0]) > fail_above and len(calls) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
        return loss_fn(model, batch)

    loader = torch.utils.data.DataLoader(classification_data(128), batch_size=batch_size)
    return af.run(af.train_step(loss), state, loader, backend=cpu, trackers=trackers, progress=False,
                  config={"lr": 0.1}, **totals)


def test_a_find_batch_size_retry_logs_each_step_once_the_attempts_that_trained(trackers, cpu):
    """find_batch_size from 32 with attempts at 32 and 16 running out of memory after 2 logged
    updates: every tracker's run holds steps 1..16 once with the values of the batch-8 run
    alone; MLflow, W&B and Comet hold three runs, the earlier two with their own batch size
    and 2 points; nothing fails (MLflow params of another value)."""
    reference = Recorder()
    train([reference], cpu, 8, epochs=1)
    expected = [(step, metrics["loss"]) for step, metrics in reference.points]
    assert [s for s, _ in expected] == list(range(1, 17))

    state = af.find_batch_size(lambda bs: train(list(trackers.values()), cpu, bs, fail_above=8, epochs=1), start=32)
    assert state.step == 16
    _close(trackers)
    config = check_points(trackers, expected)

    mlflow = trackers["mlflow"]
    runs = mlflow.client.search_runs([mlflow.client.get_run(mlflow.run_id).info.experiment_id])
    by_batch = {r.data.params["accelfn.batch_size"]: r for r in runs}
    assert sorted(by_batch, key=int) == ["8", "16", "32"] and by_batch["8"].info.run_id == mlflow.run_id
    for failed in ("16", "32"):
        assert [m.step for m in mlflow.client.get_metric_history(by_batch[failed].info.run_id, "loss")] == [1, 2]
    wandb = trackers["wandb"]
    assert len(_wandb_ids(wandb)) == 3 and config["accelfn"]["batch_size"] == 8
    comet = trackers["comet"]
    assert len({p.stem.split("-")[0] for p in comet.dir.glob("*.zip")}) == 3


def test_a_run_per_epoch_then_a_phase_continue_the_same_run_with_each_step_once(trackers, cpu):
    """run(epochs=e + 1) once per epoch, twice, then a phase to step 40 at twice the batch:
    every tracker's run holds steps 1..40 once with the values run logged, in one run (id,
    key) per tracker; MLflow keeps the first batch size and adds the phase's as
    accelfn.batch_size/from_step_32; W&B's config has the latest."""
    record = Recorder()
    state = train([*trackers.values(), record], cpu, 8, epochs=1)
    ids = trackers["mlflow"].run_id, trackers["wandb"].run_id, trackers["comet"].experiment_key
    state = train([*trackers.values(), record], cpu, 8, state=state, epochs=2)
    state = train([*trackers.values(), record], cpu, 16, state=state, epochs=None, max_steps=40)
    _close(trackers)
    assert (trackers["mlflow"].run_id, trackers["wandb"].run_id, trackers["comet"].experiment_key) == ids
    expected = [(step, metrics["loss"]) for step, metrics in record.points]
    assert [s for s, _ in expected] == list(range(1, 41))
    config = check_points(trackers, expected)
    mlflow = trackers["mlflow"]
    params = mlflow.client.get_run(mlflow.run_id).data.params
    assert params["accelfn.batch_size"] == "8" and params["accelfn.batch_size/from_step_32"] == "16"
    assert params["lr"] == "0.1" and not any(key.startswith("lr/") for key in params)
    assert len(_wandb_ids(trackers["wandb"])) == 1 and config["accelfn"]["batch_size"] == 16
