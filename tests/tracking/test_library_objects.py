"""The Comet tracker (offline, read back from its archive) and each tracker's library object:
``TensorBoard.writer``, ``WandB.run``, ``MLflow.client``, ``Comet.experiment`` are the objects
``run`` logs through, so what a user adds with them lands in the same run."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch

import accelfn as af
from tests.helpers.events import read_scalars
from tests.helpers.models import classification_data, make_mlp
from tests.test_tracking import loss_fn


def train(trackers: list[Any], cpu: af.backends.Backend, *, epochs: int = 2) -> af.TrainState:
    model = make_mlp()
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.compose(af.accumulate(2))(af.train_step(loss_fn))
    loader = torch.utils.data.DataLoader(classification_data(32), batch_size=4)
    return af.run(step, state, loader, backend=cpu, epochs=epochs, trackers=trackers, progress=False,
                  config={"lr": 0.1, "model": {"hidden": 8}})


def comet_messages(directory: Path) -> list[dict[str, Any]]:
    """Every message of every offline archive under ``directory`` (Comet's messages.json)."""
    messages = []
    for archive in sorted(directory.glob("*.zip")):
        with zipfile.ZipFile(archive) as z:
            messages += [orjson.loads(line) for line in z.read("messages.json").splitlines()]
    return messages


@pytest.fixture
def comet_ml(monkeypatch):
    monkeypatch.setenv("COMET_ERROR_TRACKING_ENABLE", "false")  # read once, at its first import: no network
    pytest.importorskip("comet_ml", reason="the Comet tracker needs comet_ml (the dev extra has it)")
    import comet_ml

    return comet_ml


def test_comet_offline_experiment_holds_every_metric_at_its_step_and_the_config(tmp_path, cpu, comet_ml):
    """The archive's metric messages are the JSONL tracker's points, step for step; the
    config is there as parameters with dotted keys; nothing Comet logs on its own but its
    bookkeeping; a log after close continues the same experiment key."""
    comet = af.Comet("accelfn-tests", dir=tmp_path / "comet", mode="offline", name="first", tags=["t"])
    train([comet, af.JSONL(tmp_path / "m.jsonl")], cpu)
    lines = [orjson.loads(line) for line in (tmp_path / "m.jsonl").read_bytes().splitlines()]
    messages = comet_messages(tmp_path / "comet")
    metrics = [m["payload"]["metric"] for m in messages if m["type"] == "metric_msg"]
    logged = {(m["metricName"], m["step"]): m["metricValue"] for m in metrics if m["metricName"] in lines[0]}
    expected = {(name, line["step"]): value for line in lines for name, value in line.items() if name != "step"}
    assert logged.keys() == expected.keys() and len(lines) == 8
    assert [logged[key] for key in expected] == pytest.approx(list(expected.values()), rel=1e-12)
    params = {m["payload"]["param"]["paramName"]: m["payload"]["param"]["paramValue"]
              for m in messages if m["type"] == "parameter_msg" and m["payload"]["param"]["source"] == "manual"}
    assert params["lr"] == 0.1 and params["model.hidden"] == 8 and params["accelfn.world_size"] == 1
    assert params["accelfn.transforms.accumulate.num_micro_batches"] == 2
    key = comet.experiment_key
    assert key is not None and [p.stem.split("-")[0] for p in (tmp_path / "comet").glob("*.zip")] == [key]

    comet.log({"after": 1.0}, step=9)
    comet.close()
    assert comet.experiment_key == key
    assert sorted(p.stem.split("-")[0] for p in (tmp_path / "comet").glob("*.zip")) == [key, key]
    assert {"metricName": "after", "metricValue": 1.0, "step": 9, "epoch": None} in [
        m["payload"]["metric"] for m in comet_messages(tmp_path / "comet") if m["type"] == "metric_msg"]


def test_reading_comet_experiment_after_run_restarts_nothing(tmp_path, cpu, comet_ml):
    """After run (which ends the experiment), reading tracker.experiment gives the ended
    experiment (its key) and writes no second archive; a call on it that would log raises
    naming reopen(), which continues the same experiment into a second archive."""
    comet = af.Comet("accelfn-tests", dir=tmp_path / "comet", mode="offline")
    train([comet], cpu, epochs=1)
    key = comet.experiment_key
    assert comet.experiment.get_key() == key
    comet.close()
    assert [p.stem.split("-")[0] for p in (tmp_path / "comet").glob("*.zip")] == [key]
    with pytest.raises(RuntimeError, match=r"Comet.experiment.log_metric: the experiment \w+ has ended.*"
                                           r"tracker.reopen\(\)"):
        comet.experiment.log_metric("lost", 1.0, step=9)
    comet.reopen().log_metric("after", 1.0, step=9)
    comet.close()
    assert comet.experiment_key == key
    assert sorted(p.stem.split("-")[0] for p in (tmp_path / "comet").glob("*.zip")) == [key, key]
    assert {"metricName": "after", "metricValue": 1.0, "step": 9, "epoch": None} in [
        m["payload"]["metric"] for m in comet_messages(tmp_path / "comet") if m["type"] == "metric_msg"]


def test_comet_checks_its_arguments(tmp_path, comet_ml):
    with pytest.raises(ValueError, match=r"Comet\(mode='local'\): accepted values are 'online', 'offline'"):
        af.Comet(mode="local")  # type: ignore[arg-type]
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"^Comet\(dir='.*/file'\): .*/file is a file, not a directory"):
        af.Comet(dir=tmp_path / "file")


def test_tensorboard_writer_is_the_event_file_run_writes(tmp_path, cpu):
    """``tracker.writer`` is the writer of the run's event file while the run logs; after
    the run (which closes it) it opens the next file, which TensorBoard reads as the same run."""
    tb = af.TensorBoard(tmp_path / "tb")
    seen = []
    original = tb.log

    def log(metrics, step):
        original(metrics, step)
        seen.append(tb.writer.file_writer.event_writer._ev_writer._file_name)  # the file run just wrote to

    tb.log = log  # type: ignore[method-assign]
    train([tb], cpu, epochs=1)
    tb.writer.add_scalar("user/extra", 2.5, global_step=4)
    tb.close()
    files = {str(f): read_scalars(f) for f in (tmp_path / "tb").glob("events.out.tfevents.*")
             if not f.name.endswith(".hparams")}
    (run_file,) = set(seen)
    assert [s for s, _ in files.pop(run_file)["loss"]] == [1, 2, 3, 4]
    assert list(files.values()) == [{"user/extra": [(4, 2.5)]}]


def test_mlflow_client_and_wandb_run_are_the_runs_that_run_logs_to(tmp_path, cpu):
    pytest.importorskip("mlflow", reason="the MLflow tracker needs mlflow (the dev extra has it)")
    pytest.importorskip("wandb", reason="the W&B tracker needs wandb (the dev extra has it)")
    mlflow, wandb = af.MLflow(tmp_path / "mlflow"), af.WandB("accelfn-tests", dir=tmp_path, mode="offline")
    train([mlflow, wandb], cpu, epochs=1)
    assert [m.step for m in mlflow.client.get_metric_history(mlflow.run_id, "loss")] == [1, 2, 3, 4]
    mlflow.client.log_metric(mlflow.run_id, "user/extra", 2.5, step=4)
    assert mlflow.client.get_run(mlflow.run_id).data.metrics["user/extra"] == 2.5
    finished = wandb.run  # finished by af.run: read, not resumed
    assert finished.id == wandb.run_id and finished.project == "accelfn-tests"
    wandb.close()
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 1
    run = wandb.reopen()  # the same W&B run resumes
    assert run.id == wandb.run_id
    run.summary["user/extra"] = 2.5
    wandb.close()
