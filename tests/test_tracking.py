"""Trackers receive one point per optimizer update at x = state.step, every log_every updates."""

from __future__ import annotations

import orjson
import pytest
import torch
import torch.nn.functional as F

import accelfn as af
from tests._events import read_scalars
from tests.conftest import classification_data, make_mlp


def loss_fn(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits, y), {"acc": (logits.argmax(-1) == y).float().mean()}


@pytest.mark.parametrize("num_micro_batches", [1, 2])
def test_jsonl_and_tensorboard_log_per_update(tmp_path, cpu, num_micro_batches):
    """With log_every=2, both trackers hold the same points at steps 2, 4, ...; their count
    does not depend on accumulate(n), and the loss is the update's window mean."""
    dataset = classification_data(32)
    batch_size = 8 // num_micro_batches
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    state = af.TrainState.create(model, optimizer, scheduler=scheduler)
    step = af.compose(af.accumulate(num_micro_batches), af.clip(10.0))(af.train_step(loss_fn))
    jsonl, tb = af.JSONL(tmp_path / "m.jsonl"), af.TensorBoard(tmp_path / "tb")
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size)
    state = af.run(step, state, loader, backend=cpu, epochs=2, trackers=[jsonl, tb], progress=False, log_every=2)

    assert state.step == 8
    lines = [orjson.loads(line) for line in (tmp_path / "m.jsonl").read_bytes().splitlines()]
    assert [line["step"] for line in lines] == [2, 4, 6, 8]
    assert [line["lr"] for line in lines] == pytest.approx([0.1 * 0.5**s for s in (1, 3, 5, 7)])
    assert set(lines[0]) == {"step", "loss", "acc", "grad_norm", "lr", "samples_per_s"}
    (event_file,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    scalars = read_scalars(event_file)
    assert [s for s, _ in scalars["loss"]] == [2, 4, 6, 8]
    assert [v for _, v in scalars["loss"]] == pytest.approx([line["loss"] for line in lines], rel=1e-6)
