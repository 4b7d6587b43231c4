"""Transforms are validated, hashable values; composition is checked and order-free."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
import torch.nn.functional as F

import accelfn as af
from tests.helpers.models import make_mlp
from tests.helpers.programs import mse as loss_fn


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: af.accumulate(0), r"accumulate\(num_micro_batches=0\).*>= 1"),
        (lambda: af.accumulate(-3), r"accumulate\(num_micro_batches=-3\)"),
        (lambda: af.clip(-1), r"clip\(max_norm=-1.0\).*finite number > 0"),
        (lambda: af.clip(0.0), r"clip\(max_norm=0.0\)"),
        (lambda: af.clip(math.nan), r"clip\(max_norm=nan\)"),
        (lambda: af.clip(math.inf), r"clip\(max_norm=inf\)"),
        (lambda: af.clip(1.0, norm_type=0), r"clip\(norm_type=0.0\)"),
        (lambda: af.clip_value(-0.5), r"clip_value\(max_value=-0.5\)"),
        (lambda: af.with_precision("fp12"), r"'fp12'.*'fp32', 'bf16', 'fp16', 'bf16-true'"),
        (lambda: af.with_precision("bf16", init_scale=8.0), r"apply to 'fp16' only"),
        (lambda: af.with_precision("fp16", growth_factor=0.5), r"with_precision\(growth_factor=0.5\): must be > 1"),
        (lambda: af.with_precision("fp16", backoff_factor=2.0), r"with_precision\(backoff_factor=2.0\): must be < 1"),
        (lambda: af.with_precision("bf16", max_consecutive_skips=5), r"max_consecutive_skips\) apply to 'fp16' only"),
        (lambda: af.skip_nonfinite(max_consecutive_skips=0), r"max_consecutive_skips=0"),
        (lambda: af.shard_data(seed=-1), r"shard_data\(seed=-1\): must be >= 0"),
        (lambda: af.replicate(bucket_cap_mb=0), r"bucket_cap_mb"),
        (lambda: af.with_precision("fp16", growth_interval=0), r"with_precision\(growth_interval=0\): must be >= 1"),
        (lambda: af.with_precision("fp16", init_scale=-1.0), r"with_precision\(init_scale=-1.0\): must be a finite number > 0"),
    ],
)
def test_bad_values_fail_at_construction(make, message):
    """Each bad argument raises ValueError naming the argument and what is allowed."""
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    "make",
    [
        lambda: af.accumulate(2.0),
        lambda: af.accumulate(True),
        lambda: af.clip("1.0"),
        lambda: af.clip_value(None),
        lambda: af.with_precision(16),
        lambda: af.shard_data(drop_last=1),
        lambda: af.replicate(static_graph="yes"),
        lambda: af.with_precision("fp16", max_consecutive_skips=1.5),
        lambda: af.with_precision("fp16", growth_interval=True),
    ],
)
def test_wrong_types_fail_at_construction(make):
    """Arguments of the wrong type raise TypeError, before any conversion hides them."""
    with pytest.raises(TypeError):
        make()


def test_records_validate_when_built_directly():
    """The record classes validate too, not only the verbs."""
    with pytest.raises(ValueError, match="accumulate"):
        af.Accumulate(0)
    with pytest.raises(ValueError, match="clip"):
        af.Clip(max_norm=-2.0)


def test_duplicates_and_conflicts_raise_transform_error():
    """The same kind twice, clip with clip_value, fp16 with skip_nonfinite, and uneven shards
    under replicate raise TransformError naming both transforms."""
    base = af.train_step(loss_fn)
    with pytest.raises(af.TransformError, match=r"Accumulate\(num_micro_batches=2\).*already has"):
        af.compose(af.accumulate(2), af.accumulate(4))(base)
    with pytest.raises(af.TransformError, match="one clip transform per step"):
        af.compose(af.clip(1.0), af.clip_value(0.5))(base)
    with pytest.raises(af.TransformError, match="already skips updates"):
        af.compose(af.with_precision("fp16"), af.skip_nonfinite())(base)
    with pytest.raises(af.TransformError, match="would hang"):
        af.compose(af.shard_data(even_batches=False), af.replicate())(base)
    af.compose(af.shard_data(even_batches=False, drop_last=True), af.replicate())(base)


def test_compose_rejects_non_transforms():
    """Passing the verb instead of calling it is a TypeError that says how to fix it."""
    with pytest.raises(TypeError, match=r"call it: af.clip\(...\), not af.clip"):
        af.compose(af.clip)
    with pytest.raises(TypeError, match=r"takes transforms such as af.clip\(1.0\), got <function mse"):
        af.compose(loss_fn)
    with pytest.raises(TypeError, match="transforms a Step"):
        af.clip(1.0)(loss_fn)


def test_transforms_are_hashable_values():
    """Equal arguments make equal, hashable transforms, usable as dict keys and in sets."""
    assert af.clip(1.0) == af.clip(1.0) and hash(af.clip(1.0)) == hash(af.clip(1.0))
    assert af.accumulate(2) != af.accumulate(3)
    assert len({af.with_precision("fp16"), af.with_precision("fp16"), af.with_precision("bf16")}) == 2
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        af.clip(1.0).max_norm = 2.0


def test_compose_order_does_not_change_the_program():
    """Any order of the same transforms gives the same canonical ``step.transforms``."""
    transforms = [af.shard_data(), af.replicate(), af.with_precision("bf16"), af.accumulate(4), af.clip(1.0)]
    base = af.train_step(loss_fn)
    forward = af.compose(*transforms)(base).transforms
    backward = af.compose(*reversed(transforms))(base).transforms
    shuffled = af.compose(transforms[3], transforms[0], transforms[4], transforms[2], transforms[1])(base).transforms
    assert forward == backward == shuffled == tuple(transforms)


def test_applying_a_transform_never_mutates_the_step():
    """A Step is a value: applying a transform returns a new Step and leaves the old as it was."""
    base = af.train_step(loss_fn)
    clipped = af.clip(1.0)(base)
    assert base.transforms == () and clipped.transforms == (af.clip(1.0),)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        base.transforms = (af.clip(1.0),)


def test_train_state_fields_cannot_be_assigned():
    """TrainState is frozen; ``replace`` returns a new record and keeps the old one."""
    model = make_mlp()
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        state.step = 3
    with pytest.raises(TypeError):
        state.transforms_state["x"] = 1
    later = state.replace(step=3)
    assert (state.step, later.step) == (0, 3) and later.model is state.model


@pytest.mark.parametrize("transforms", [(), (af.accumulate(2),), (af.with_precision("fp16"),)])
def test_transforms_state_stays_one_read_only_mapping_over_many_steps(transforms, cpu):
    """Each step's state wraps its transforms_state once: a proxy is never nested in a proxy,
    so a lookup costs the same at step 30 as at step 1."""
    model = make_mlp()
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.compose(*transforms)(af.train_step(loss_fn))
    data = [(torch.randn(2, 6), torch.randn(2, 3)) for _ in range(30)]
    state = af.run(step, state, data, backend=cpu, progress=False)
    assert state.micro_step == 30
    assert repr(state.transforms_state).count("mappingproxy(") == 1


def test_train_state_create_checks_its_arguments():
    """An optimizer over foreign tensors, a scheduler of another optimizer, or a bad extra
    object are refused with a message saying what to do."""
    model = make_mlp()
    stranger = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="not a parameter of the model"):
        af.TrainState.create(model, torch.optim.SGD([stranger], lr=0.1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="another optimizer"):
        af.TrainState.create(model, optimizer, scheduler=torch.optim.lr_scheduler.StepLR(other, 1))
    with pytest.raises(TypeError, match="state_dict"):
        af.TrainState.create(model, optimizer, extra={"counter": 3})
    with pytest.raises(TypeError, match="torch.nn.Module"):
        af.TrainState.create("model", optimizer)


@pytest.mark.parametrize(
    ("loss", "error", "message"),
    [
        (lambda m, b: (m(b[0]) - b[1]) ** 2, ValueError, r"scalar loss tensor \(shape \(\)\), got a tensor of shape \(4, 3\)"),
        (lambda m, b: 1.0, ValueError, "got float"),
        (lambda m, b: F.mse_loss(m(b[0]), b[1]).detach(), ValueError, "does not require grad"),
        (lambda m, b: (F.mse_loss(m(b[0]), b[1]), 2.0, {}), TypeError, "tuple of 3 items"),
        (lambda m, b: (F.mse_loss(m(b[0]), b[1]), 0.5), TypeError, "tuple whose second item is a float"),
        (lambda m, b: (F.mse_loss(m(b[0]), b[1]), {"loss": 1.0}), ValueError, "metric named 'loss'"),
        (lambda m, b: (F.mse_loss(m(b[0]), b[1]), {"err": m(b[0])}), ValueError, r"metric 'err' is a tensor of shape \(4, 3\)"),
        (lambda m, b: (F.mse_loss(m(b[0]), b[1]), {"note": "x"}), TypeError, "metric 'note' must be a number"),
    ],
)
def test_bad_loss_values_are_named(loss, error, message, cpu):
    """A loss function returning a non-scalar or non-loss fails with a message that says how to fix it."""
    model = make_mlp()
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    data = [(torch.randn(4, 6), torch.randn(4, 3))]
    with pytest.raises(error, match=message):
        af.run(af.train_step(loss), state, data, backend=cpu, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_run_rejects_bad_arguments_before_touching_state(cpu):
    """Bad ``run`` arguments raise before the model moves or trains."""
    model = make_mlp()
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.train_step(loss_fn)
    data = [(torch.randn(4, 6), torch.randn(4, 3))]
    with pytest.raises(ValueError, match=r"epochs=0"):
        af.run(step, state, data, backend=cpu, epochs=0)
    with pytest.raises(ValueError, match=r"max_steps=0"):
        af.run(step, state, data, backend=cpu, max_steps=0)
    with pytest.raises(TypeError, match="backend"):
        af.run(step, state, data, backend="cpu")
    with pytest.raises(TypeError, match="Step first"):
        af.run(loss_fn, state, data, backend=cpu)
    with pytest.raises(TypeError, match="trackers"):
        af.run(step, state, data, backend=cpu, trackers=["tb"])
    assert state.step == 0


def test_advance_carries_every_field_it_does_not_change():
    """The interpreter's unchecked ``_advance`` sets the four fields it is given and copies
    every other field of TrainState, so a field added later cannot be silently dropped."""
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    state = af.TrainState.create(model, optimizer, scheduler=scheduler, extra={"sched": scheduler})
    state = state.replace(epoch=2, transforms_state={"skips": af.transforms.SkipCount(1, 0)})
    new = state._advance(step=5, micro_step=7, epoch_micro_step=3, transforms_state={"x": 1})
    changed = {"step": 5, "micro_step": 7, "epoch_micro_step": 3}
    for field in attrs.fields(af.TrainState):
        if field.name in changed:
            assert getattr(new, field.name) == changed[field.name]
        elif field.name == "transforms_state":
            assert dict(new.transforms_state) == {"x": 1}
            with pytest.raises(TypeError):
                new.transforms_state["y"] = 2
        else:
            assert getattr(new, field.name) is getattr(state, field.name), field.name


def test_train_state_checks_hold_for_replace_and_the_scheduler():
    """``replace`` checks the model against the optimizer as ``create`` does; an optimizer,
    a ReduceLROnPlateau or a DataParallel-wrapped model is refused with the fix."""
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = af.TrainState.create(model, optimizer)
    with pytest.raises(ValueError, match="a new model needs a new optimizer"):
        state.replace(model=make_mlp())
    with pytest.raises(TypeError, match="scheduler must be an lr scheduler"):
        af.TrainState.create(model, optimizer, scheduler=optimizer)
    with pytest.raises(TypeError, match=r"ReduceLROnPlateau steps on a validation metric.*scheduler.step\(metric\)"):
        af.TrainState.create(model, optimizer, scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer))
    with pytest.raises(TypeError, match=r"wrapped in DataParallel; pass the model itself \(model.module\)"):
        af.TrainState.create(torch.nn.DataParallel(model), optimizer)
