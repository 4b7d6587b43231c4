"""Hooks inside ``run``: values logged at the right steps, state in ``TrainState.extra``
surviving a crash and ``resume="auto"``, early stopping at the right update, and a
per-epoch ``run`` loop with ``resume="auto"`` that retrains nothing."""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import accelfn as af
from tests.helpers import hooked


def jsonl(path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def points(lines: list[dict[str, Any]], name: str) -> list[tuple[int, float]]:
    return [(line["step"], line[name]) for line in lines if name in line]


def test_an_epoch_end_hook_logs_what_evaluate_gives_after_each_epoch(tmp_path, cpu):
    """The evaluation hook logs val/loss at steps 4, 8, 12 with exactly the values af.evaluate
    gives after 1, 2 and 3 epochs of training without hooks; the every-3-steps hook logs at 3,
    6, 9, 12."""
    hooked.train(cpu, 2 * hooked.PER_RANK_BATCH, trackers=[af.JSONL(tmp_path / "m.jsonl")])
    log = jsonl(tmp_path / "m.jsonl")
    assert points(log, "hook/step") == [(3, 3.0), (6, 6.0), (9, 9.0), (12, 12.0)]
    step = af.compose(af.shard_data(seed=3), af.replicate())(af.train_step(lambda m, b: F.mse_loss(m(b[0]), b[1])))
    loader = DataLoader(hooked.P.regression_data(hooked.NUM_SAMPLES), batch_size=6, shuffle=True)
    state, expected = hooked.P.make_state(), []
    for epoch in range(1, 4):
        state = af.run(step, state, loader, backend=cpu, epochs=epoch, progress=False)
        errors = af.evaluate(lambda m, b: (m(b[0]) - b[1]) ** 2, state, hooked.val_loader(6), backend=cpu)
        expected.append((state.step, errors.mean().item()))
    assert points(log, "val/loss") == expected


def test_crash_and_resume_auto_on_one_process_logs_each_step_once(tmp_path, cpu):
    """A run that crashes after step 7 and resumes from the checkpoint of step 5 logs steps 6..12
    and its hooks' points once, and ends with the uninterrupted run's parameters (bitwise)."""
    whole = hooked.train(cpu, 6, trackers=[af.JSONL(tmp_path / "whole.jsonl")])
    checkpoints = af.Checkpoints(tmp_path / "ckpt", every_steps=hooked.CHECKPOINT_EVERY)
    with pytest.raises(hooked.Crash):
        hooked.train(cpu, 6, trackers=[af.JSONL(tmp_path / "crashed.jsonl")], checkpoints=checkpoints,
                     crash_at=hooked.CRASH_AT)
    resumed = hooked.train(cpu, 6, trackers=[af.JSONL(tmp_path / "resumed.jsonl")], checkpoints=checkpoints,
                           resume="auto")
    log, whole_log = jsonl(tmp_path / "resumed.jsonl"), jsonl(tmp_path / "whole.jsonl")
    assert [s for s, _ in points(jsonl(tmp_path / "crashed.jsonl"), "loss")] == list(range(1, 8))
    assert [s for s, _ in points(log, "loss")] == list(range(6, 13))
    for name in ("loss", "val/loss", "hook/step"):
        assert points(log, name) == [p for p in points(whole_log, name) if p[0] > 5]
    assert hooked.flat_parameters(resumed) == hooked.flat_parameters(whole)


class Patience:
    """Early stopping's state, kept in TrainState.extra so that a checkpoint holds it."""

    def __init__(self) -> None:
        self.best, self.bad_epochs = float("inf"), 0

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_epochs": self.bad_epochs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.bad_epochs = state["best"], state["bad_epochs"]


VAL_BY_EPOCH = [5.0, 4.0, 4.5, 4.6, 4.7, 4.8, 4.9, 5.0]  # best after epoch 2; patience 2 ends epoch 4


def early_stopping(state: af.TrainState, backend: af.backends.Backend) -> dict[str, float] | af.Stop:
    value = VAL_BY_EPOCH[state.epoch - 1]  # state.epoch: epochs finished at an epoch's end
    patience: Patience = state.extra["patience"]
    if value < patience.best:
        patience.best, patience.bad_epochs = value, 0
    else:
        patience.bad_epochs += 1
    if patience.bad_epochs >= 2:
        return af.Stop(f"val has not improved for {patience.bad_epochs} epochs", {"val": value})
    return {"val": value}


def train_with_patience(tmp_path, cpu, *, crash_at: int | None = None, resume: str | None = None,
                        hooks: tuple[af.Hook, ...] | None = None, every_steps: int = 4,
                        epochs: int = len(VAL_BY_EPOCH), **options: Any) -> af.TrainState:
    calls = [0]

    def loss_fn(model, batch):
        if calls[0] == crash_at:
            raise RuntimeError("crash")
        calls[0] += 1
        return F.mse_loss(model(batch[0]), batch[1])

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.01), extra={"patience": Patience()})
    data = [(torch.randn(3, 2), torch.randn(3, 1)) for _ in range(4)]  # 4 updates per epoch
    return af.run(af.train_step(loss_fn), state, data, backend=cpu, epochs=epochs, progress=False,
                  hooks=[af.Hook(early_stopping, at_epoch_end=True)] if hooks is None else list(hooks),
                  trackers=[af.JSONL(tmp_path / "m.jsonl")],
                  checkpoints=af.Checkpoints(tmp_path / "ckpt", every_steps=every_steps), resume=resume, **options)


def test_early_stopping_stops_at_the_right_update_also_after_a_resume(tmp_path, cpu, capfd):
    """Patience 2 after the best epoch (2) stops the run at the end of epoch 4, step 16, with the
    stopping value logged; a run crashed in epoch 4 and resumed from step 12 stops at step 16
    too, since the patience counter came back from the checkpoint's extra."""
    state = train_with_patience(tmp_path / "a", cpu)
    assert (state.step, state.epoch) == (16, 4)
    assert points(jsonl(tmp_path / "a" / "m.jsonl"), "val") == [(4, 5.0), (8, 4.0), (12, 4.5), (16, 4.6)]
    assert "accelfn: stopped at step 16: val has not improved for 2 epochs" in capfd.readouterr().err
    with pytest.raises(RuntimeError, match="crash"):
        train_with_patience(tmp_path / "b", cpu, crash_at=14)
    state = train_with_patience(tmp_path / "b", cpu, resume="auto")
    assert (state.step, state.extra["patience"].bad_epochs) == (16, 2)
    assert points(jsonl(tmp_path / "b" / "m.jsonl"), "val") == [(4, 5.0), (8, 4.0), (12, 4.5), (16, 4.6)]


def _weights(state: af.TrainState) -> list[torch.Tensor]:
    return [p.detach().clone() for p in state.model.parameters()]


def test_a_rerun_of_a_job_that_stopped_early_trains_nothing_more(tmp_path, cpu, capfd):
    """The job stops at step 16 (patience); the same command again with resume="auto" (a
    requeue, a restart after a crash in code after training) resumes at 16 and stops there:
    no update, no logged point, the weights bitwise the first run's, state.stopped says why.
    With continue_after_stop=True it trains on, bitwise as a job without the stopping hook
    (hand-written patience kept alone) trained 5 epochs."""
    first = train_with_patience(tmp_path, cpu)
    assert first.stopped == af.Stopped(16, "val has not improved for 2 epochs")
    logged = jsonl(tmp_path / "m.jsonl")
    again = train_with_patience(tmp_path, cpu, resume="auto")
    assert (again.step, again.epoch, again.stopped) == (16, 4, first.stopped)
    assert all(torch.equal(a, b) for a, b in zip(_weights(again), _weights(first)))
    assert jsonl(tmp_path / "m.jsonl") == logged
    assert ("accelfn: nothing to train: this run stopped at step 16 (val has not improved for 2 epochs); "
            "pass run(..., continue_after_stop=True) to train on") in capfd.readouterr().err
    on = train_with_patience(tmp_path, cpu, resume="auto", continue_after_stop=True)
    assert on.step == 20 and on.stopped == af.Stopped(20, "val has not improved for 3 epochs")
    whole = train_with_patience(tmp_path / "whole", cpu, hooks=(), epochs=5)
    assert whole.stopped is None and whole.step == 20
    assert all(torch.equal(a, b) for a, b in zip(_weights(on), _weights(whole)))


def test_a_stop_between_checkpoints_is_saved_and_a_per_epoch_loop_stops_too(tmp_path, cpu):
    """A stop at step 6 with checkpoints every 5 steps writes step 6's checkpoint, holding the
    stop (the manifest's "stopped"), so a rerun resumes there and neither trains nor calls the
    hook again; a run loop of one epoch per call on the live state, and af.load of the
    checkpoint into a fresh state, keep the stop as well."""
    calls: list[int] = []

    def stop_at_6(state: af.TrainState, backend: af.backends.Backend) -> af.Stop | None:
        calls.append(state.step)
        return af.Stop("enough") if state.step == 6 else None

    hooks = (af.Hook(stop_at_6, every_steps=3),)
    first = train_with_patience(tmp_path, cpu, hooks=hooks, every_steps=5)
    assert (first.step, first.stopped, calls) == (6, af.Stopped(6, "enough"), [3, 6])
    checkpoints = af.Checkpoints(tmp_path / "ckpt")
    assert checkpoints.steps() == [5, 6]
    manifest = orjson.loads((checkpoints.path_for(6) / "manifest.json").read_bytes())
    assert manifest["stopped"] == {"step": 6, "reason": "enough"}
    assert "stopped" not in orjson.loads((checkpoints.path_for(5) / "manifest.json").read_bytes())
    again = train_with_patience(tmp_path, cpu, hooks=hooks, every_steps=5, resume="auto")
    assert (again.step, calls) == (6, [3, 6])
    assert all(torch.equal(a, b) for a, b in zip(_weights(again), _weights(first)))
    looped = first
    for epochs in range(3, 6):  # one epoch per call, as in a loop of the user's own; the plan says it trains nothing
        with pytest.warns(af.PlanWarning, match=r"^\[nothing-to-train\] the state stopped at step 6 \(enough\)"):
            looped = af.run(af.train_step(lambda m, b: F.mse_loss(m(b[0]), b[1])), looped,
                            [(torch.randn(3, 2), torch.randn(3, 1))] * 4, backend=cpu, epochs=epochs, progress=False)
    assert looped.step == 6 and all(torch.equal(a, b) for a, b in zip(_weights(looped), _weights(first)))
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    fresh = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.01), extra={"patience": Patience()})
    assert af.load(checkpoints.path_for(6), into=fresh).stopped == af.Stopped(6, "enough")
    assert af.load(checkpoints.path_for(5), into=fresh).stopped is None
    with pytest.raises(TypeError, match=r"continue_after_stop=\.\.\.\) takes True or False, got 'yes'"):
        train_with_patience(tmp_path, cpu, hooks=hooks, resume="auto", continue_after_stop="yes")


def test_a_stop_asked_mid_epoch_by_an_every_steps_hook_ends_the_run_there(cpu):
    """A hook every 3 steps that returns af.Stop at step 6 ends the run at step 6, mid-epoch."""
    model = torch.nn.Linear(2, 1)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.01))
    data = [(torch.randn(3, 2), torch.randn(3, 1)) for _ in range(4)]
    hook = af.Hook(lambda s, b: af.Stop("enough") if s.step == 6 else None, every_steps=3)
    state = af.run(af.train_step(lambda m, b: F.mse_loss(m(b[0]), b[1])), state, data, backend=cpu, epochs=5,
                   progress=False, hooks=[hook])
    assert (state.step, state.epoch, state.epoch_micro_step) == (6, 1, 2)


def test_a_per_epoch_run_loop_with_resume_auto_retrains_nothing(tmp_path, cpu):
    """run(epochs=e + 1, resume='auto') called once per epoch (the shared case) keeps the live
    state, which is past the latest checkpoint: each step is logged once and the parameters
    equal one run of 3 epochs."""
    def job(epochs_per_call: list[int], path):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.01))
        data = DataLoader(TensorDataset(torch.randn(200, 4), torch.randn(200, 1)), batch_size=8, shuffle=True)
        step = af.shard_data()(af.train_step(lambda m, b: F.mse_loss(m(b[0]), b[1])))
        checkpoints = af.Checkpoints(path / "ckpt", every_steps=10)
        for epochs in epochs_per_call:
            state = af.run(step, state, data, backend=cpu, epochs=epochs, checkpoints=checkpoints, resume="auto",
                           trackers=[af.JSONL(path / "m.jsonl")], progress=False)
        return state, [line["step"] for line in jsonl(path / "m.jsonl")]

    looped, steps = job([1, 2, 3], tmp_path / "loop")
    once, _ = job([3], tmp_path / "once")
    assert steps == list(range(1, 76))
    assert torch.equal(looped.model.weight, once.model.weight) and torch.equal(looped.model.bias, once.model.bias)


def test_bad_hooks_are_refused_with_the_fix(cpu):
    """A hook without a trigger, a non-callable, a zero period, a single hook instead of a list,
    and a hook returning a string each get a clear error."""
    with pytest.raises(ValueError, match=re.escape("Hook(fn) needs a trigger: every_steps=<updates> and/or "
                                                   "at_epoch_end=True")):
        af.Hook(lambda s, b: None)
    with pytest.raises(TypeError, match=r"^Hook\(fn=...\) must be a function fn\(state, backend\) -> metrics or None, "
                       r"got 'val'$"):
        af.Hook("val", every_steps=1)
    with pytest.raises(ValueError, match=r"^Hook\(every_steps=0\): must be >= 1$"):
        af.Hook(lambda s, b: None, every_steps=0)
    model = torch.nn.Linear(2, 1)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.01))
    step = af.train_step(lambda m, b: F.mse_loss(m(b[0]), b[1]))
    data = [(torch.randn(3, 2), torch.randn(3, 1))]
    hook = af.Hook(lambda s, b: "fine", every_steps=1)
    with pytest.raises(TypeError, match=r"run\(hooks=...\) takes a list of af.Hook"):
        af.run(step, state, data, backend=cpu, hooks=hook, progress=False)
    with pytest.raises(TypeError, match=r"returned 'fine'; a hook returns a mapping of values to log"):
        af.run(step, state, data, backend=cpu, hooks=[hook], progress=False)
