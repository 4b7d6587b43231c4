"""Trackers receive one point per optimizer update at x = state.step, every log_every updates."""

from __future__ import annotations

import warnings

import orjson
import pytest
import torch
import torch.nn.functional as F

import accelfn as af
from tests.helpers.events import read_scalars
from tests.helpers.models import classification_data, make_mlp


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
    assert [line["lr"] for line in lines] == [0.1 * 0.5**s for s in (1, 3, 5, 7)]  # exactly the optimizer's floats
    assert set(lines[0]) == {"step", "loss", "acc", "grad_norm", "lr", "updates_per_s", "samples_per_s", "rss_mib"}
    (event_file,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    scalars = read_scalars(event_file)
    assert [s for s, _ in scalars["loss"]] == [2, 4, 6, 8]
    assert [v for _, v in scalars["loss"]] == pytest.approx([line["loss"] for line in lines], rel=1e-6)


def test_run_trains_in_train_mode_after_an_evaluation(cpu):
    """``run`` puts the model in train mode, so dropout is active again after ``model.eval()``."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.Dropout(0.5))
    modes = []

    def observed(m, batch):
        modes.append(m.training)
        return F.cross_entropy(m(batch[0]), batch[1])

    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = [(torch.randn(4, 6), torch.randint(0, 3, (4,)))] * 2
    for epochs in (1, 2):
        state = af.run(af.train_step(observed), state, data, backend=cpu, epochs=epochs, progress=False)
        state.model.eval()
    assert modes == [True, True, True, True]


def test_max_steps_alone_with_epochs_none(cpu):
    """``epochs=None`` trains by steps alone, over as many epochs as ``max_steps`` needs."""
    model = make_mlp()
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = [(torch.randn(4, 6), torch.randint(0, 3, (4,)))] * 3
    state = af.run(af.train_step(lambda m, b: F.cross_entropy(m(b[0]), b[1])), state, data, backend=cpu,
                   epochs=None, max_steps=7, progress=False)
    assert (state.step, state.epoch, state.epoch_micro_step) == (7, 2, 1)
    with pytest.raises(ValueError) as error:
        af.run(af.train_step(lambda m, b: F.cross_entropy(m(b[0]), b[1])), state, data, backend=cpu, epochs=None)
    assert str(error.value) == ("run(epochs=None) trains until max_steps, so it needs max_steps=<total optimizer "
                                "updates>; pass both, or an int for epochs")


def test_epochs_running_out_before_max_steps_warns_once(cpu):
    """run(max_steps=7) on 5 batches with the default epochs=1 stops at step 5 and warns once,
    naming both limits and epochs=None; reaching max_steps first, or epochs=None, does not warn."""
    model = make_mlp()
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.train_step(lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    data = [(torch.randn(4, 6), torch.randint(0, 3, (4,)))] * 5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = af.run(step, state, data, backend=cpu, max_steps=7, progress=False)
        assert state.step == 5
        af.run(step, state, data, backend=cpu, epochs=2, max_steps=7, progress=False)
        af.run(step, state, data, backend=cpu, epochs=None, max_steps=9, progress=False)
    assert [str(w.message) for w in caught] == [
        "run stopped after epochs=1 at step 5, before max_steps=7; pass epochs=None to train until max_steps "
        "(or more epochs)"]
    assert caught[0].category is RuntimeWarning and caught[0].filename == __file__


def test_empty_and_exhausted_data_warn(cpu):
    """An epoch that reads no batch (empty data, or a generator spent by an earlier epoch) warns."""
    model = make_mlp()
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.train_step(lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    with pytest.warns(RuntimeWarning, match="epoch 0 read no batches"):
        af.run(step, state, [], backend=cpu, progress=False)
    one_shot = ((torch.randn(4, 6), torch.randint(0, 3, (4,))) for _ in range(2))
    with pytest.warns(RuntimeWarning, match="epoch 1 read no batches.*one-shot iterator"):
        state = af.run(step, state, one_shot, backend=cpu, epochs=2, progress=False)
    assert state.step == 2


def test_trackers_must_be_a_list(tmp_path, cpu):
    """A single tracker instead of a list is refused before training, with the fix."""
    model = make_mlp()
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"trackers=\[af.JSONL"):
        af.run(af.train_step(lambda m, b: m(b).sum()), state, [], backend=cpu, trackers=af.JSONL(tmp_path / "m"))


def test_tracker_paths_are_checked_when_built(tmp_path):
    """A JSONL path that is a directory, or a TensorBoard logdir that is a file, fails at once."""
    with pytest.raises(ValueError, match="is a directory"):
        af.JSONL(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        af.TensorBoard(tmp_path / "file")


def test_jsonl_appending_after_a_partial_last_line_starts_a_new_line(tmp_path):
    """A file whose last line a killed run left unfinished keeps that fragment on its own line;
    the appended points are whole lines (a file ending with a newline gets none added)."""
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 0.5}\n{"step": 2, "lo')
    tracker = af.JSONL(path)
    tracker.log({"loss": 0.25}, 3)
    tracker.close()
    tracker = af.JSONL(path)
    tracker.log({"loss": 0.125}, 4)
    tracker.close()
    assert path.read_bytes().splitlines() == [b'{"step": 1, "loss": 0.5}', b'{"step": 2, "lo',
                                              b'{"step":3,"loss":0.25}', b'{"step":4,"loss":0.125}']
