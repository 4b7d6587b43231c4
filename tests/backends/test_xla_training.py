"""The XLA backend trains as the CPU backend does, on PJRT's CPU device, without host syncs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import accelfn as af
from tests.helpers.models import classification_data, make_mlp
from tests.helpers.xla import counts, flat, loss_fn, since

pytestmark = pytest.mark.xla


@pytest.fixture(scope="module")
def xla() -> af.backends.Backend:
    return af.backends.XLA(af.backends.LaunchEnv())


def adamw_state(seed: int = 0) -> af.TrainState:
    model = make_mlp(seed)
    return af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))


SEED_COMPOSITION = (af.shard_data(seed=3), af.replicate(), af.accumulate(2), af.clip(0.5))


def test_two_epochs_on_xla_match_the_cpu_backend(cpu, xla):
    """shard_data, replicate, accumulate(2), clip(0.5) and AdamW over 2 epochs of 42 samples
    (a 2-sample last micro-batch closing a partial window) give the CPU backend's parameters
    within 1e-4 and the same counters."""
    loader = DataLoader(classification_data(42), batch_size=4, shuffle=True)
    step = af.compose(*SEED_COMPOSITION)(af.train_step(loss_fn))
    on_cpu = af.run(step, adamw_state(), loader, backend=cpu, epochs=2, progress=False)
    on_xla = af.run(step, adamw_state(), loader, backend=xla, epochs=2, progress=False)

    assert on_xla.model.fc1.weight.device.type == "xla"
    assert (on_xla.step, on_xla.micro_step, on_xla.epoch) == (on_cpu.step, on_cpu.micro_step, on_cpu.epoch) == (12, 22, 2)
    torch.testing.assert_close(flat(on_xla.model), flat(on_cpu.model), rtol=0, atol=1e-4)
    assert not torch.equal(flat(on_cpu.model), flat(make_mlp()))


def test_prepare_moves_the_optimizer_with_the_parameters(xla):
    """Placing a model on XLA makes new Parameter objects; the optimizer (and its moments from
    earlier CPU training) follow them, and tied weights stay tied."""
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5, bias=False))
    model[1].weight = model[0].weight
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.arange(5)).sum().backward()
    optimizer.step()
    moment = optimizer.state[model[0].weight]["exp_avg"].clone()

    state, _ = xla.prepare(af.train_step(loss_fn), af.TrainState.create(model, optimizer))

    params = list(model.parameters())
    assert len(params) == 1 and model[1].weight is model[0].weight
    assert optimizer.param_groups[0]["params"] == params and params[0].device.type == "xla"
    moved = optimizer.state[params[0]]["exp_avg"]
    assert moved.device.type == "xla" and torch.equal(moved.cpu(), moment)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_xla_stays_within_its_tolerance_of_fp32(xla, precision):
    """Under with_precision, the forward computes in the low dtype on XLA, the loss falls, and
    after 24 SGD updates the parameters differ from fp32 training by less than the low
    dtype's epsilon (relative L2)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    seen: set[torch.dtype] = set()

    def recording_loss(model, batch):
        x, y = batch
        logits = model(x)
        seen.add(logits.dtype)
        return F.cross_entropy(logits, y)

    loader = DataLoader(classification_data(64), batch_size=8, shuffle=True)
    results, losses = {}, {}
    for name in ("fp32", precision):
        model = make_mlp()
        state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        step = af.compose(af.shard_data(), af.with_precision(name))(af.train_step(recording_loss))
        trace = []

        class Losses(af.Tracker):
            def log(self, metrics, step):
                trace.append(metrics["loss"])

            def close(self):
                pass

        state = af.run(step, state, loader, backend=xla, epochs=3, progress=False, trackers=[Losses()])
        results[name], losses[name] = flat(state.model), trace

    assert seen == {torch.float32, dtype}
    assert losses[precision][-1] < losses[precision][0]
    relative = (results[precision] - results["fp32"]).norm() / results["fp32"].norm()
    assert 0 < relative < torch.finfo(dtype).eps


def test_bf16_true_keeps_bf16_parameters_on_xla(cpu, xla):
    """with_precision("bf16-true") stores parameters in bfloat16 on the XLA device and ends
    within one bfloat16 rounding of the CPU backend's bf16-true run."""
    loader = DataLoader(classification_data(32), batch_size=8)
    step = af.with_precision("bf16-true")(af.train_step(loss_fn))
    runs = {}
    for name, backend in (("cpu", cpu), ("xla", xla)):
        model = make_mlp()
        state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        runs[name] = af.run(step, state, loader, backend=backend, epochs=2, progress=False)
    assert {p.dtype for p in runs["xla"].model.parameters()} == {torch.bfloat16}
    torch.testing.assert_close(flat(runs["xla"].model), flat(runs["cpu"].model),
                               rtol=torch.finfo(torch.bfloat16).eps, atol=1e-3)


def test_fp16_overflow_skips_the_update_on_xla(xla):
    """An inf input under fp16 skips that update on XLA (parameters unchanged, step not
    counted) and halves the loss scale."""
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = af.with_precision("fp16", init_scale=2.0**10)(af.train_step(loss_fn))
    state, step_fn = xla.prepare(step, af.TrainState.create(model, optimizer))
    x, y = classification_data(8)[:]
    bad = x.clone()
    bad[0, 0] = math.inf

    state, metrics = step_fn(state, xla.place((x, y)))
    assert (state.step, int(metrics["skipped"]), metrics["loss_scale"]) == (1, 0, 1024.0)
    before = flat(model)
    state, metrics = step_fn(state, xla.place((bad, y)))
    assert (state.step, int(metrics["skipped"]), metrics["loss_scale"]) == (1, 1, 1024.0)
    assert state.transforms_state["loss_scale"].scale == 512.0
    assert torch.equal(flat(model), before)


def test_micro_batches_launch_one_cached_graph_and_read_nothing(xla):
    """After a warm-up epoch, each micro-batch (accumulating or updating) launches exactly one
    already compiled graph and reads nothing back to the host; reading a metric is what reads
    the device."""
    loader = DataLoader(classification_data(32), batch_size=4, shuffle=True)  # 8 micro-batches
    step = af.compose(*SEED_COMPOSITION)(af.train_step(loss_fn))
    state, step_fn = xla.prepare(step, adamw_state())

    def epoch(number):
        nonlocal state
        costs, metrics = [], {}
        before = counts()
        for batch, last in xla.batches(loader, step, number):
            state, out = step_fn(state, batch, flush=last)
            metrics = out or metrics
            costs.append(since(before))
            before = counts()
        return costs, metrics

    epoch(0)  # compiles the accumulating and the updating graph
    costs, metrics = epoch(1)
    assert state.step == 8
    assert costs == [{"graphs": 1, "compilations": 0, "host_reads": 0}] * 8

    before = counts()
    loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
    assert since(before)["host_reads"] == 2 and loss > 0 and grad_norm > 0


class HostReads(af.Tracker):
    """Records, at each log point, how many device-to-host reads happened so far."""

    def __init__(self) -> None:
        self.at_log = []

    def log(self, metrics, step):
        self.at_log.append(counts()["host_reads"])

    def close(self):
        pass


def test_run_reads_the_device_only_at_log_points(xla):
    """``run(log_every=4)`` reads as much from the device between two log points as
    ``log_every=1`` does: the updates in between read nothing."""
    loader = DataLoader(classification_data(64), batch_size=4, shuffle=True)  # 16 updates per epoch
    step = af.compose(af.shard_data(), af.clip(0.5))(af.train_step(loss_fn))
    reads_per_period = {}
    for log_every in (1, 4):
        tracker = HostReads()
        af.run(step, adamw_state(), loader, backend=xla, epochs=2, progress=False, log_every=log_every,
               trackers=[tracker])
        assert len(tracker.at_log) == 32 // log_every
        periods = {b - a for a, b in zip(tracker.at_log, tracker.at_log[1:])}
        assert len(periods) == 1
        reads_per_period[log_every] = periods.pop()
    assert reads_per_period[4] == reads_per_period[1] > 0
