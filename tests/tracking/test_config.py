"""``run(config=...)`` hands the hyperparameters, with what accelfn knows, once to every tracker
that takes a configuration: TensorBoard's hparams here (MLflow and W&B: test_services.py)."""

from __future__ import annotations

import struct
from typing import Any

import pytest
import torch
from tensorboardX.proto import event_pb2, plugin_hparams_pb2
from torch.utils.data import DataLoader, TensorDataset

import accelfn as af
from tests.helpers.programs import mse


def hparams_of(path) -> dict[str, Any]:
    """The hparams of the session-start summary in one event file."""
    data, offset = path.read_bytes(), 0
    while offset < len(data):
        (length,) = struct.unpack_from("<Q", data, offset)
        event = event_pb2.Event.FromString(data[offset + 12: offset + 12 + length])
        offset += 12 + length + 4
        for value in event.summary.value:
            if value.metadata.plugin_data.plugin_name == "hparams":
                plugin = plugin_hparams_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
                if plugin.HasField("session_start_info"):
                    hparams = plugin.session_start_info.hparams
                    return {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in hparams.items()}
    raise AssertionError(f"no hparams in {path}")


class Collector:
    """A tracker that keeps what it is given."""

    def __init__(self) -> None:
        self.configs: list[dict[str, Any]] = []
        self.steps: list[int] = []

    def log(self, metrics, step):
        self.steps.append(step)

    def log_config(self, config):
        self.configs.append(config)

    def close(self):
        pass


def test_config_reaches_tensorboard_hparams_and_every_config_tracker_once(tmp_path, cpu):
    """A run with config writes it (flattened, with accelfn's transforms, world size, backend,
    precision, batch size and versions) as TensorBoard hparams beside the scalars, and hands
    the nested mapping once to a tracker with log_config, before its first point."""
    data = DataLoader(TensorDataset(torch.randn(12, 3), torch.randn(12, 1)), batch_size=4)
    model = torch.nn.Linear(3, 1)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.compose(af.accumulate(2), af.clip(1.0), af.with_precision("bf16"))(
        af.train_step(mse))
    collector = Collector()
    af.run(step, state, data, backend=cpu, progress=False, config={"lr": 0.1, "net": {"width": 3}, "flag": True},
           trackers=[af.TensorBoard(tmp_path / "tb"), collector])
    (config,) = collector.configs
    assert collector.steps == [1, 2]
    assert config["accelfn"] == {
        "version": af.__version__, "torch_version": torch.__version__, "backend": "cpu", "world_size": 1,
        "precision": "bf16", "batch_size": 4,
        "transforms": {"with_precision": {"policy": {"name": "bf16", "param_dtype": "torch.float32",
                                                      "compute_dtype": "torch.bfloat16", "scaling": None,
                                                      "float8": None}},
                       "accumulate": {"num_micro_batches": 2}, "clip": {"max_norm": 1.0, "norm_type": 2.0}},
    }
    (hparams_file,) = (tmp_path / "tb").glob("*.hparams")
    hparams = hparams_of(hparams_file)
    assert hparams["lr"] == 0.1 and hparams["net.width"] == 3 and hparams["flag"] is True
    assert hparams["accelfn.transforms.accumulate.num_micro_batches"] == 2
    assert hparams["accelfn.backend"] == "cpu" and hparams["accelfn.transforms.with_precision.policy.scaling"] == "None"


def test_without_config_no_tracker_gets_one(tmp_path, cpu):
    """run without config calls no log_config and writes no hparams file."""
    model = torch.nn.Linear(3, 1)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    collector = Collector()
    af.run(af.train_step(lambda m, b: m(b).pow(2).mean()), state, [torch.randn(2, 3)], backend=cpu,
           progress=False, trackers=[af.TensorBoard(tmp_path / "tb"), collector])
    assert collector.configs == [] and list((tmp_path / "tb").glob("*.hparams")) == []


def test_a_bad_config_is_refused_before_training(cpu):
    """A config that is not a mapping, or that uses accelfn's own key, is refused with the fix."""
    model = torch.nn.Linear(3, 1)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.train_step(lambda m, b: m(b).pow(2).mean())
    with pytest.raises(TypeError, match=r"run\(config=...\) takes a mapping of hyperparameters"):
        af.run(step, state, [torch.randn(2, 3)], backend=cpu, config=[("lr", 0.1)])
    with pytest.raises(ValueError, match="has a key 'accelfn', which is where run puts what it knows"):
        af.run(step, state, [torch.randn(2, 3)], backend=cpu, config={"accelfn": 1})
    assert state.step == 0


def test_mlflow_and_wandb_trackers_check_their_arguments(tmp_path):
    """MLflow needs one of dir and tracking_uri, and a directory; WandB a known mode."""
    pytest.importorskip("mlflow", reason="the MLflow tracker needs mlflow (the dev extra has it)")
    pytest.importorskip("wandb", reason="the W&B tracker needs wandb (the dev extra has it)")
    with pytest.raises(ValueError, match=r"give one of them, a directory for a local store"):
        af.MLflow()
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"^MLflow\(dir='.*/file'\): .*/file is a file, not a directory; give a directory"):
        af.MLflow(tmp_path / "file")
    assert af.MLflow(tmp_path / "m").uri == f"sqlite:///{tmp_path / 'm' / 'mlflow.db'}"
    with pytest.raises(ValueError, match=r"WandB\(mode='local'\): accepted values are 'online', 'offline'"):
        af.WandB(mode="local")  # type: ignore[arg-type]
