"""What run logs at each point: skipped updates, learning rates, losses of af.Loss (docs/05)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import accelfn as af
from tests.helpers.programs import mse
from tests.helpers.tracking import Recorder


def _fp16_overflowing_run(log_every: int):
    """fp16 + clip on inputs of 1e3: every update overflows the loss scale and is skipped."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.01))
    data = [(torch.randn(8, 4) * 1e3, torch.randn(8, 1)) for _ in range(6)]
    step = af.compose(af.with_precision("fp16"), af.clip(1.0))(
        af.train_step(lambda m, b: F.mse_loss(m(b[0]).float(), b[1])))
    record = Recorder()
    state = af.run(step, state, data, backend=af.backends.CPU(), trackers=[record], progress=False,
                   log_every=log_every)
    return state, record


def test_a_skipped_fp16_update_logs_skipped_and_no_grad_norm():
    """Six fp16 updates that overflow are logged with skipped 1, the halving loss scale and
    no grad_norm (not nan)."""
    state, record = _fp16_overflowing_run(log_every=1)
    assert state.step == 0 and state.transforms_state["skips"].num_skipped == 6
    assert [(step, sorted(m)) for step, m in record.points] == [
        (0, ["loss", "loss_scale", "lr", "rss_mib", "samples_per_s", "skipped", "updates_per_s"])] * 6
    assert [m["skipped"] for _, m in record.points] == [1] * 6
    assert [m["loss_scale"] for _, m in record.points] == [2.0**16 / 2**k for k in range(6)]


def _nonfinite_batches(bad: set[int]):
    """12 batches; those in ``bad`` have an inf target, so their update's gradient is not finite."""
    torch.manual_seed(0)
    batches = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(12)]
    return [(x, torch.full_like(y, math.inf) if k in bad else y) for k, (x, y) in enumerate(batches)]


@pytest.mark.parametrize("log_every", [1, 3, 4])
def test_skipped_counts_the_skipped_updates_of_each_logging_window(cpu, log_every):
    """With skip_nonfinite, updates 2, 3, 4 and 9 (of 12) skipped and log_every=3 logs
    skipped 2, 1, 1, 0 at the 3rd, 6th, 9th and 12th updates (4: 3, 0, 1); grad_norm is
    logged exactly at the log points whose own update was applied."""
    bad = {1, 2, 3, 8}
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.compose(af.skip_nonfinite(), af.clip(1.0))(af.train_step(mse))
    record = Recorder()
    state = af.run(step, state, _nonfinite_batches(bad), backend=cpu, trackers=[record], progress=False,
                   log_every=log_every)
    assert state.step == 12 - len(bad)
    ends = range(log_every, 13, log_every)  # the 1-based update each point is logged at
    expected = [sum(1 for k in range(end - log_every, end) if k in bad) for end in ends]
    assert [m["skipped"] for _, m in record.points] == expected
    assert ["grad_norm" in m for _, m in record.points] == [end - 1 not in bad for end in ends]
    assert [step for step, _ in record.points] == [end - sum(1 for k in bad if k < end) for end in ends]
    assert sum(expected) == state.transforms_state["skips"].num_skipped


def test_lr_is_the_first_parameter_group_the_update_uses(cpu):
    """A frozen backbone in group 0 (lr 0) and a head at 0.1 halved every 2 updates log
    lr 0.1, 0.1, 0.05, 0.05 (the head's), and each group's lr as lr/group0, lr/group1."""
    torch.manual_seed(0)
    backbone, head = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)
    model = torch.nn.Sequential(backbone, torch.nn.ReLU(), head)
    backbone.requires_grad_(False)
    optimizer = torch.optim.SGD([{"params": backbone.parameters(), "lr": 0.0},
                                 {"params": head.parameters(), "lr": 0.1}])
    state = af.TrainState.create(model, optimizer,
                                 scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5))
    record = Recorder()
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(4)]
    af.run(af.train_step(mse), state, data, backend=cpu, trackers=[record], progress=False)
    assert [(step, m["lr"], m["lr/group0"], m["lr/group1"]) for step, m in record.points] == [
        (1, 0.1, 0.0, 0.1), (2, 0.1, 0.0, 0.1), (3, 0.05, 0.0, 0.05), (4, 0.05, 0.0, 0.05)]


def test_groups_with_one_learning_rate_log_lr_alone(cpu):
    """Weight-decay and no-decay groups at one lr log only lr: the groups' lrs are logged
    when they differ."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW([{"params": [model.weight], "weight_decay": 0.1},
                                   {"params": [model.bias], "weight_decay": 0.0}], lr=0.01)
    record = Recorder()
    af.run(af.train_step(mse), af.TrainState.create(model, optimizer), [(torch.randn(8, 4), torch.randn(8, 1))],
           backend=cpu, trackers=[record], progress=False)
    assert [(step, sorted(m), m["lr"]) for step, m in record.points] == [
        (1, ["loss", "lr", "rss_mib", "samples_per_s", "updates_per_s"], 0.01)]


def test_a_metric_named_like_a_groups_lr_is_refused(cpu):
    """A metric named lr/group1 would hide a group's learning rate: refused, naming the rule."""
    model = torch.nn.Linear(4, 1)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.train_step(lambda m, b: (mse(m, b), {"lr/group1": 0.5}))
    with pytest.raises(ValueError) as error:
        af.run(step, state, [(torch.randn(8, 4), torch.randn(8, 1))], backend=cpu, progress=False)
    assert str(error.value) == (
        "loss_fn returned a metric named 'lr/group1', which accelfn reports itself; rename it (reserved: grad_norm, "
        "healed, items_per_s, loss, loss_scale, lr, micro_batches, num_items, num_samples, peak_device_mib, replays, "
        "replicas, rss_mib, samples_per_s, skipped, updates_per_s, and names starting with 'lr/')")
