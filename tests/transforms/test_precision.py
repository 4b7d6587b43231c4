"""Mixed precision: fp16 loss scaling with skipped updates, bf16 autocast, bf16-true."""

from __future__ import annotations

import math
import re
import sys

import orjson
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import accelfn as af
from accelfn.transforms import numerics
from accelfn.transforms.precision import LossScale, SkipCount
from tests.helpers.models import classification_data, loss_fn, make_mlp


def batches_with(bad: dict[int, float], n: int = 4, size: int = 4, seed: int = 2):
    """n micro-batches of the classification task; batch i gets one input set to ``bad[i]``."""
    dataset = classification_data(n * size, seed=seed)
    out = []
    for i, (x, y) in enumerate(DataLoader(dataset, batch_size=size)):
        if i in bad:
            x = x.clone()
            x[0, 0] = bad[i]
        out.append((x, y))
    return out


def adam_state(model, optimizer):
    return {k: v.clone() for p in model.parameters() for k, v in optimizer.state[p].items()
            if isinstance(v, torch.Tensor)}


def test_fp16_inf_batch_skips_the_update_and_halves_the_scale(cpu):
    """A batch with inf leaves parameters, Adam moments, the lr schedule and ``state.step``
    unchanged and halves the loss scale; later finite batches update normally."""
    model = make_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    step = af.with_precision("fp16", init_scale=2.0**10)(af.train_step(loss_fn))
    state, step_fn = cpu.prepare(step, af.TrainState.create(model, optimizer, scheduler=scheduler))
    data = batches_with({1: math.inf})

    state, metrics = step_fn(state, data[0])
    assert (state.step, metrics["skipped"], metrics["loss_scale"]) == (1, 0, 1024.0)
    params = [p.detach().clone() for p in model.parameters()]
    moments, lr = adam_state(model, optimizer), optimizer.param_groups[0]["lr"]

    state, metrics = step_fn(state, data[1])
    assert (state.step, metrics["skipped"], metrics["loss_scale"]) == (1, 1, 1024.0)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    after = adam_state(model, optimizer)
    assert all(torch.equal(moments[k], after[k]) for k in moments)
    assert optimizer.param_groups[0]["lr"] == lr and scheduler.last_epoch == 1
    assert state.transforms_state["loss_scale"].scale == 512.0
    assert state.transforms_state["skips"] == af.transforms.SkipCount(num_skipped=1, consecutive=1)

    for batch in data[2:]:
        state, metrics = step_fn(state, batch)
        assert metrics["skipped"] == 0
    assert state.step == 3 and scheduler.last_epoch == 3
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**3)
    assert state.transforms_state["skips"] == af.transforms.SkipCount(num_skipped=1, consecutive=0)
    assert not any(torch.equal(a, b) for a, b in zip(params, model.parameters()))


def test_fp16_skips_and_loss_scale_are_logged(tmp_path, cpu):
    """``skipped`` and ``loss_scale`` reach the trackers, one point per update."""
    model = make_mlp()
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.with_precision("fp16", init_scale=2.0**10)(af.train_step(loss_fn))
    state = af.run(step, state, batches_with({1: math.inf}), backend=cpu, trackers=[af.JSONL(tmp_path / "m.jsonl")],
                   progress=False)
    lines = [orjson.loads(line) for line in (tmp_path / "m.jsonl").read_bytes().splitlines()]
    assert [(d["step"], d["skipped"], d["loss_scale"]) for d in lines] == [
        (1, 0, 1024.0), (1, 1, 1024.0), (2, 0, 512.0), (3, 0, 512.0)]
    assert state.step == 3


def test_fp16_clips_unscaled_gradients(cpu):
    """At loss scale 2**16 a true gradient norm of 0.25 is reported as 0.25 and not clipped
    by clip(1.0): the update is exactly -lr * gradient."""
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=1.0))
    step = af.compose(af.with_precision("fp16"), af.clip(1.0))(af.train_step(
        lambda m, b: F.mse_loss(m(b[0]), b[1])))
    state, step_fn = cpu.prepare(step, state)
    assert state.transforms_state["loss_scale"].scale == 2.0**16
    # d/dw (w.x - 0.25)^2 at w = 0 is -0.5 * x = (-0.25, 0): norm 0.25
    state, metrics = step_fn(state, (torch.tensor([[0.5, 0.0]]), torch.tensor([[0.25]])))
    assert metrics["skipped"] == 0
    assert metrics["grad_norm"].item() == 0.25
    assert model.weight.tolist() == [[0.25, 0.0]]


def test_fp16_accumulate_clip_equals_grad_scaler_loop(monkeypatch, cpu):
    """fp16 + accumulate(2) + clip over 4 micro-batches makes 2 updates, unscales once per
    update, and equals the hand-written torch.amp.GradScaler loop."""
    data = batches_with({})
    expected = make_mlp()
    expected_optimizer = torch.optim.AdamW(expected.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for window in (data[:2], data[2:]):
        for x, y in window:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(expected(x), y)
            scaler.scale(loss / 2).backward()
        scaler.unscale_(expected_optimizer)
        torch.nn.utils.clip_grad_norm_(expected.parameters(), 0.5)
        scaler.step(expected_optimizer)
        scaler.update()
        expected_optimizer.zero_grad()

    calls = []
    original = numerics.unscale_and_check
    monkeypatch.setattr(numerics, "unscale_and_check", lambda *a: calls.append(1) or original(*a))
    model = make_mlp()
    state = af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    step = af.compose(af.with_precision("fp16", init_scale=2.0**10), af.accumulate(2), af.clip(0.5))(
        af.train_step(loss_fn))
    state = af.run(step, state, data, backend=cpu, progress=False)

    assert state.step == 2 and len(calls) == 2
    assert state.transforms_state["loss_scale"].scale == scaler.get_scale()
    for actual, wanted in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(actual, wanted, rtol=1e-6, atol=1e-7)


def test_bf16_autocasts_forward_keeps_fp32_master_weights(cpu):
    """bf16 on CPU with fp32 targets runs the forward in bf16, keeps parameters and gradients
    in fp32, and lands within bf16 tolerance of fp32 training (but not on it)."""
    dataset = classification_data(64)

    def train(transforms):
        model = make_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        dtypes = {"forward": set(), "grad": set()}
        model.fc1.register_forward_hook(lambda m, i, out: dtypes["forward"].add(out.dtype))
        optimizer.register_step_pre_hook(
            lambda opt, *a: dtypes["grad"].update(p.grad.dtype for p in model.parameters()))
        state = af.TrainState.create(model, optimizer)
        step = af.compose(*transforms)(af.train_step(lambda m, b: F.mse_loss(m(b[0]), b[1].float())))
        data = [(x, F.one_hot(y, 3)) for x, y in DataLoader(dataset, batch_size=8)]
        af.run(step, state, data, backend=cpu, epochs=3, progress=False)
        return model, dtypes

    bf16, bf16_dtypes = train([af.with_precision("bf16")])
    fp32, fp32_dtypes = train([])
    assert bf16_dtypes == {"forward": {torch.bfloat16}, "grad": {torch.float32}}
    assert fp32_dtypes == {"forward": {torch.float32}, "grad": {torch.float32}}
    for low, full in zip(bf16.parameters(), fp32.parameters()):
        assert low.dtype == torch.float32
        torch.testing.assert_close(low, full, rtol=2e-2, atol=1e-2)
    assert not all(torch.equal(a, b) for a, b in zip(bf16.parameters(), fp32.parameters()))


def test_bf16_true_trains_in_bf16(cpu):
    """bf16-true stores parameters in bf16, casts float inputs, and lowers the loss."""
    dataset = classification_data(32)
    model = make_mlp()
    state = af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    step = af.with_precision("bf16-true")(af.train_step(loss_fn))
    state, step_fn = cpu.prepare(step, state)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    losses = []
    for _ in range(30):
        state, metrics = step_fn(state, dataset.tensors)
        losses.append(metrics["loss"].item())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert losses[-1] < 0.7 * losses[0]

    # evaluation casts float inputs to the parameters' bf16 too (integer labels stay as they are)
    x, y = dataset.tensors
    seen = []
    outputs = af.evaluate(lambda m, b: seen.append((b[0].dtype, b[1].dtype)) or m(b[0]), state,
                          torch.utils.data.DataLoader(dataset, batch_size=8), backend=cpu)
    assert set(seen) == {(torch.bfloat16, y.dtype)}
    with torch.inference_mode():
        torch.testing.assert_close(outputs, model(x.to(torch.bfloat16)))


def test_loss_scale_grows_after_growth_interval(cpu):
    """After ``growth_interval`` finite updates in a row the scale doubles, and the growth
    tracker starts over."""
    model = make_mlp()
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.01))
    step = af.with_precision("fp16", init_scale=256.0, growth_interval=3)(af.train_step(loss_fn))
    state, step_fn = cpu.prepare(step, state)
    scales = []
    for batch in batches_with({}, n=5):
        state, _ = step_fn(state, batch)
        scales.append((state.transforms_state["loss_scale"].scale, state.transforms_state["loss_scale"].growth_tracker))
    assert scales == [(256.0, 1), (256.0, 2), (512.0, 0), (512.0, 1), (512.0, 2)]


def test_loss_scale_rule_matches_grad_scaler():
    """LossScale.adjust follows torch.amp.GradScaler's update over a sequence of finite and
    non-finite updates."""
    scaling = af.transforms.DynamicScaling(init_scale=8.0, growth_interval=2)
    ours = af.transforms.LossScale(8.0)
    scale = torch.tensor([8.0])
    tracker = torch.tensor([0], dtype=torch.int32)
    for finite in [True, True, False, True, True, True, False, False, True, True]:
        found_inf = torch.tensor([0.0 if finite else 1.0])
        torch._amp_update_scale_(scale, tracker, found_inf, 2.0, 0.5, 2)
        ours = ours.adjust(finite, scaling)
        assert (ours.scale, ours.growth_tracker) == (scale.item(), tracker.item())


@pytest.mark.parametrize(("make", "error", "message"), [
    (lambda: LossScale(0.0), ValueError, "LossScale(scale=0.0): must be a finite number > 0"),
    (lambda: LossScale(-2.0), ValueError, "LossScale(scale=-2.0): must be a finite number > 0"),
    (lambda: LossScale(math.inf), ValueError, "LossScale(scale=inf): must be a finite number > 0"),
    (lambda: LossScale(math.nan), ValueError, "LossScale(scale=nan): must be a finite number > 0"),
    (lambda: LossScale("big"), TypeError, "LossScale(scale=...) must be a number, got 'big'"),
    (lambda: LossScale(8.0, -1), ValueError, "LossScale(growth_tracker=-1): must be >= 0"),
    (lambda: LossScale(8.0, 1.0), TypeError, "LossScale(growth_tracker=...) must be an int, got 1.0"),
    (lambda: SkipCount(-1), ValueError, "SkipCount(num_skipped=-1): must be >= 0"),
    (lambda: SkipCount(3, -1), ValueError, "SkipCount(consecutive=-1): must be >= 0"),
    (lambda: SkipCount(1, 2), ValueError, "consecutive (2) must be <= num_skipped (1)"),
])
def test_loss_scale_and_skip_count_refuse_impossible_values(make, error, message):
    """A loss scale that is not a finite number > 0, a negative growth tracker or skip count,
    or more consecutive skips than skips in all, cannot be built."""
    with pytest.raises(error, match=re.escape(message)):
        make()


def test_loss_scale_stays_finite_and_positive_at_the_limits():
    """Growing a scale that would overflow keeps it (as GradScaler does), backing off one that
    would underflow to 0 leaves the smallest positive float; ordinary values move as usual."""
    scaling = af.transforms.DynamicScaling(growth_interval=1, backoff_factor=1e-300, min_scale=1e-300)
    top = LossScale(sys.float_info.max / 1.5, 0)
    assert top.adjust(True, scaling) == LossScale(sys.float_info.max / 1.5, 0)
    assert LossScale(1e-300).adjust(False, scaling) == LossScale(math.ulp(0.0), 0)
    assert LossScale(4.0, 0).adjust(True, scaling) == LossScale(8.0, 0)
    assert LossScale(4.0, 3).adjust(False, scaling) == LossScale(4.0 * 1e-300, 0)


def test_skip_nonfinite_skips_nan_update_in_fp32(cpu):
    """skip_nonfinite() in fp32 skips an update whose gradients hold NaN, with the same
    bookkeeping as fp16."""
    model = make_mlp()
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state, step_fn = cpu.prepare(af.skip_nonfinite()(af.train_step(loss_fn)), state)
    data = batches_with({1: math.nan})
    state, _ = step_fn(state, data[0])
    before = [p.detach().clone() for p in model.parameters()]
    state, metrics = step_fn(state, data[1])
    assert metrics["skipped"] == 1 and state.step == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    state, metrics = step_fn(state, data[2])
    assert metrics["skipped"] == 0 and state.step == 2
    assert state.transforms_state["skips"].num_skipped == 1


def test_consecutive_skips_stop_training(cpu):
    """After max_consecutive_skips non-finite updates in a row, run raises NonFiniteError."""
    model = make_mlp()
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.skip_nonfinite(max_consecutive_skips=3)(af.train_step(loss_fn))
    data = batches_with({0: math.nan, 1: math.nan, 2: math.nan, 3: math.nan})
    with pytest.raises(af.NonFiniteError, match="3 optimizer updates in a row"):
        af.run(step, state, data, backend=cpu, progress=False)


def test_fp16_scale_floor_stops_training(cpu):
    """An fp16 run whose every update overflows stops once the scale falls below its floor."""
    model = make_mlp()
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.with_precision("fp16", init_scale=2.0**-10)(af.train_step(loss_fn))
    data = batches_with({i: math.inf for i in range(8)}, n=8)
    with pytest.raises(af.NonFiniteError, match="below its floor"):
        af.run(step, state, data, backend=cpu, progress=False)


def test_unsupported_precision_fails_when_the_program_is_prepared():
    """A backend that cannot run a policy refuses it in ``prepare``, naming the backend, the
    policy and the supported set, before the state is touched (no silent fp32 fallback).

    The CPU backend runs all four policies, so a backend with a narrower set (as XLA on TPU,
    bf16 only) is modelled by restricting the CPU backend's declared set.
    """

    class Bf16Only(af.backends.CPU):
        supported_precisions = ("fp32", "bf16")

    backend = Bf16Only(af.backends.LaunchEnv())
    model = make_mlp()
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.with_precision("fp16")(af.train_step(loss_fn))
    with pytest.raises(NotImplementedError, match=r"cpu backend does not support with_precision\('fp16'\); supported: 'fp32', 'bf16'"):
        backend.prepare(step, state)
    assert "loss_scale" not in state.transforms_state
