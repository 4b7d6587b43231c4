"""Snapshots: detached CPU values of a TrainState that restore every field exactly."""

from __future__ import annotations

import random

import attrs
import numpy as np
import pytest
import torch

import accelfn as af
from accelfn.checkpoint._codec import Encoder, decode
from accelfn.checkpoint.snapshot import COUNTERS
from accelfn.errors import CheckpointError
from accelfn.transforms import Window
from accelfn.transforms.precision import LossScale, SkipCount
from tests.helpers.states import assert_same_state, build, loader, program


def _records() -> dict[str, object]:
    """One of every transform-state record, with tensors and non-default values in every field."""
    return {
        "loss_scale": LossScale(scale=1024.0, growth_tracker=3),
        "skips": SkipCount(num_skipped=5, consecutive=2),
        "window": Window(reference=8.0, count=torch.tensor(6.0), num_samples=6, loss_sum=torch.tensor(2.5),
                         metric_sums={"acc": torch.tensor(4.0), "tokens": 7.0}),
    }


def _busy_state() -> af.TrainState:
    """A state with every field away from its default: trained a step, counters, records, grads."""
    state = build(0, extra=True)
    step, cpu = program(), af.backends.CPU(af.backends.LaunchEnv())
    state, step_fn = cpu.prepare(step, state)
    for batch, last in list(cpu.batches(loader(), step, 0))[:3]:
        state, _ = step_fn(state, batch, flush=last)
    state.extra["counter"].seen, state.extra["counter"].history = 3, [0.5, float("inf")]
    return state.replace(step=11, micro_step=23, epoch=2, epoch_micro_step=3,
                         transforms_state=_records())


def _values(record: object) -> dict[str, object]:
    out = {}
    for f in attrs.fields(type(record)):
        value = getattr(record, f.name)
        if isinstance(value, dict):
            value = {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in value.items()}
        out[f.name] = (type(value).__name__, value.item() if isinstance(value, torch.Tensor) else value)
    return out


@pytest.mark.parametrize("kind", ["loss_scale", "skips", "window"])
def test_every_transform_record_round_trips_field_by_field(kind) -> None:
    """Each transform-state record, encoded to plain data and tensors and decoded, has every
    attrs field equal in type and value."""
    record = _records()[kind]
    encoder = Encoder()
    plain = encoder.encode(record, kind)
    back = decode(plain, encoder.tensors)
    assert type(back) is type(record)
    assert _values(back) == _values(record)


def test_snapshot_holds_every_trainstate_field() -> None:
    """Every TrainState field is in a snapshot: the parts, plus each counter (derived from attrs.fields)."""
    state = _busy_state()
    snap = af.snapshot(state)
    names = {f.name for f in attrs.fields(af.TrainState)}
    assert set(COUNTERS) == names - {"model", "optimizer", "scheduler", "transforms_state", "extra", "stopped",
                                     "data_state"}
    assert snap.stopped is None and snap.data_state is None
    assert af.snapshot(state.replace(stopped=af.Stopped(11, "enough"))).stopped == {"step": 11, "reason": "enough"}
    assert af.snapshot(state.replace(data_state={"state": [1, 2]})).data_state == {"state": [1, 2]}
    assert dict(snap.counters) == {"step": 11, "micro_step": 23, "epoch": 2, "epoch_micro_step": 3}
    assert set(snap.transforms_state) == {"loss_scale", "skips", "window"}
    assert set(snap.grads) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert snap.extra["counter"] == {"seen": 3, "history": [0.5, float("inf")]}


def test_snapshot_is_a_detached_cpu_copy() -> None:
    """Training on after a snapshot leaves the snapshot's tensors unchanged and shares no memory."""
    state = _busy_state()
    snap = af.snapshot(state)
    before = {k: v.clone() for k, v in snap.model.items()}
    live = {p.untyped_storage().data_ptr() for p in state.model.parameters()}
    assert all(v.device.type == "cpu" and v.untyped_storage().data_ptr() not in live for v in snap.model.values())
    with torch.no_grad():
        for p in state.model.parameters():
            p.add_(1.0)
    state.optimizer.state[state.model.fc1.weight]["exp_avg"].add_(1.0)
    assert all(torch.equal(before[k], snap.model[k]) for k in before)
    live_moment = state.optimizer.state[state.model.fc1.weight]["exp_avg"]
    assert not torch.equal(snap.optimizer["state"][0]["exp_avg"], live_moment)


def test_restore_puts_back_every_field_and_can_repeat() -> None:
    """Restoring a snapshot twice into a perturbed fresh state gives back parameters, optimizer
    and scheduler state, extra objects, counters, records, gradients and RNG each time."""
    state = _busy_state()
    snap = af.snapshot(state)
    draws = (torch.rand(3), random.random(), np.random.rand())
    af.restore(state, snap)  # rewinds the generators
    for _ in range(2):
        fresh = build(99, extra=True)
        torch.rand(5), random.random(), np.random.rand()
        restored = af.restore(fresh, snap)
        assert_same_state(restored, state)
        assert restored.extra["counter"].state_dict() == {"seen": 3, "history": [0.5, float("inf")]}
        for p, q in zip(restored.model.parameters(), state.model.parameters()):
            assert torch.equal(p.grad, q.grad)
        again = (torch.rand(3), random.random(), np.random.rand())
        assert torch.equal(again[0], draws[0]) and again[1:] == draws[1:]


def test_restore_after_an_update_drops_stale_gradients() -> None:
    """A snapshot taken between windows (no gradients) clears gradients left in the target."""
    state = build(0)
    snap = af.snapshot(state)
    state.model(torch.randn(2, 6)).sum().backward()
    restored = af.restore(state, snap)
    assert all(p.grad is None for p in restored.model.parameters())


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's own imports
def test_compiled_and_wrapped_models_use_the_unwrapped_names() -> None:
    """A torch.compile'd model's snapshot has the plain module's keys and restores into an
    uncompiled model."""
    plain = build(0)
    compiled_model = torch.compile(plain.model)
    compiled = af.TrainState.create(compiled_model, plain.optimizer)
    snap = af.snapshot(compiled)
    assert sorted(snap.model) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    other = build(5)
    other = af.TrainState.create(other.model, other.optimizer)
    af.restore(other, snap)
    assert torch.equal(other.model.fc1.weight, plain.model.fc1.weight)


def test_mismatched_snapshot_names_every_difference_and_changes_nothing() -> None:
    """Restoring into another architecture fails naming missing, unexpected, shape and dtype
    differences, and leaves the target untouched."""
    snap = af.snapshot(build(0))
    torch.manual_seed(3)
    model = torch.nn.ModuleDict({"fc1": torch.nn.Linear(6, 8), "head": torch.nn.Linear(16, 3)})
    model.fc1.bias.data = model.fc1.bias.data.double()
    target = af.TrainState.create(model, torch.optim.AdamW(model.parameters()))
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(CheckpointError) as error:
        af.restore(target, snap)
    message = str(error.value)
    assert "missing from the checkpoint (2): head.weight, head.bias" in message
    assert "unexpected in the checkpoint (2): fc2.weight, fc2.bias" in message
    assert "model 'fc1.weight': shape (16, 6) in the checkpoint, (8, 6) here" in message
    assert "scheduler: CosineAnnealingLR in the checkpoint, None here" in message
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_restore_rejects_wrong_types() -> None:
    """restore() names the wrong argument type."""
    with pytest.raises(TypeError, match="Snapshot second"):
        af.restore(build(0), {"model": {}})
    with pytest.raises(TypeError, match="TrainState"):
        af.snapshot(torch.nn.Linear(2, 2))
