"""``run`` with the seed transforms equals the hand-written PyTorch loop (DESIGN.md §3)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

import accelfn as af
from accelfn.backends._interpreter import InterpreterStepFn, PlainStepFn
from tests.helpers.models import classification_data, loss_fn, make_mlp


def build(optimizer_name: str, with_scheduler: bool):
    model = make_mlp()
    if optimizer_name == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5) if with_scheduler else None
    return model, optimizer, scheduler


def hand_loop(model, optimizer, scheduler, dataset, *, batch_size, epochs, num_micro_batches=1,
              max_norm=None, max_value=None, shuffle_seed=None):
    """The plain PyTorch loop that each composition must reproduce.

    A window's gradient is the mean over its samples: each micro-batch's mean loss is
    weighted by its share of the window's samples (a partial window by its true size).
    """
    for epoch in range(epochs):
        if shuffle_seed is None:
            loader = DataLoader(dataset, batch_size=batch_size)
        else:
            sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=shuffle_seed)
            sampler.set_epoch(epoch)
            loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
        batches = list(loader)
        for start in range(0, len(batches), num_micro_batches):
            window = batches[start:start + num_micro_batches]
            total = sum(len(x) for x, _ in window)
            for x, y in window:
                loss = F.cross_entropy(model(x), y)
                (loss * (len(x) / total)).backward()
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if max_value is not None:
                torch.nn.utils.clip_grad_value_(model.parameters(), max_value)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad()


# name -> (transforms, hand-loop options, dataset size)
CASES = {
    "none": ([], {}, 40),
    "shard_data": ([af.shard_data(seed=3)], {"shuffle_seed": 3}, 40),
    "replicate": ([af.replicate()], {}, 40),
    "with_precision_fp32": ([af.with_precision("fp32")], {}, 40),
    "accumulate": ([af.accumulate(4)], {"num_micro_batches": 4}, 40),
    "clip": ([af.clip(0.5)], {"max_norm": 0.5}, 40),
    "clip_value": ([af.clip_value(0.05)], {"max_value": 0.05}, 40),
    "skip_nonfinite": ([af.skip_nonfinite()], {}, 40),
    # 38 samples at batch 4: the last micro-batch has 2 samples and closes a partial window
    "composed": (
        [af.shard_data(seed=3), af.replicate(), af.with_precision("fp32"), af.accumulate(3), af.clip(0.5)],
        {"shuffle_seed": 3, "num_micro_batches": 3, "max_norm": 0.5},
        38,
    ),
}


@pytest.mark.parametrize("with_scheduler", [False, True], ids=["no_scheduler", "steplr"])
@pytest.mark.parametrize("optimizer_name", ["adamw", "sgd"])
@pytest.mark.parametrize("case", list(CASES))
def test_run_equals_hand_written_loop(case, optimizer_name, with_scheduler, cpu):
    """Two epochs of ``run`` give the hand-written loop's parameters to rtol 1e-6."""
    transforms, options, size = CASES[case]
    dataset = classification_data(size)
    shuffle = "shuffle_seed" in options

    model, optimizer, scheduler = build(optimizer_name, with_scheduler)
    hand_loop(model, optimizer, scheduler, dataset, batch_size=4, epochs=2, **options)

    ours, our_optimizer, our_scheduler = build(optimizer_name, with_scheduler)
    state = af.TrainState.create(ours, our_optimizer, scheduler=our_scheduler)
    step = af.compose(*transforms)(af.train_step(loss_fn))
    loader = DataLoader(dataset, batch_size=4, shuffle=shuffle)
    state = af.run(step, state, loader, backend=cpu, epochs=2, progress=False)

    windows = math.ceil(math.ceil(size / 4) / options.get("num_micro_batches", 1))
    assert state.step == 2 * windows
    for (name, expected), actual in zip(model.named_parameters(), state.model.parameters()):
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-7, msg=name)
    if with_scheduler:
        assert our_scheduler.last_epoch == scheduler.last_epoch == state.step


def test_accumulate_equals_larger_batch(cpu):
    """``accumulate(4)`` at batch 2 gives the parameters of batch 8 without accumulation."""
    dataset = classification_data(48)
    results = []
    for transforms, batch_size in (([af.accumulate(4)], 2), ([], 8)):
        model, optimizer, _ = build("adamw", False)
        state = af.TrainState.create(model, optimizer)
        step = af.compose(*transforms)(af.train_step(loss_fn))
        state = af.run(step, state, DataLoader(dataset, batch_size=batch_size), backend=cpu,
                       epochs=2, progress=False)
        assert state.step == 12
        results.append(torch.cat([p.detach().flatten() for p in state.model.parameters()]))
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-7)


def test_partial_window_is_normalized_by_its_true_size(cpu):
    """10 micro-batches under accumulate(4) make 3 updates; the third averages 2 micro-batches
    (it equals one batch of their 4 samples), and StepLR advances once per update."""
    dataset = classification_data(20)
    model, optimizer, _ = build("sgd", False)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    state = af.TrainState.create(model, optimizer, scheduler=scheduler)
    step = af.accumulate(4)(af.train_step(loss_fn))
    state = af.run(step, state, DataLoader(dataset, batch_size=2), backend=cpu, epochs=1, progress=False)

    assert (state.step, state.micro_step, state.epoch, state.epoch_micro_step) == (3, 10, 1, 0)
    assert scheduler.last_epoch == 3
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    assert "window" not in state.transforms_state

    # by hand: batches of 8, 8 and 4 samples, each one plain mean-loss update
    expected, expected_optimizer, _ = build("sgd", False)
    expected_scheduler = torch.optim.lr_scheduler.StepLR(expected_optimizer, step_size=1, gamma=0.5)
    for x, y in DataLoader(dataset, batch_size=8):
        F.cross_entropy(expected(x), y).backward()
        expected_optimizer.step()
        expected_scheduler.step()
        expected_optimizer.zero_grad()
    for actual, wanted in zip(state.model.parameters(), expected.parameters()):
        torch.testing.assert_close(actual, wanted, rtol=1e-6, atol=1e-7)


def test_clip_is_one_global_norm_over_all_parameter_groups(cpu):
    """With two parameter groups, ``clip`` scales all gradients by one factor from the global
    norm (reported as ``grad_norm``), as ``clip_grad_norm_`` over every parameter does."""
    dataset = classification_data(16)

    def make():
        model = make_mlp()
        groups = [{"params": model.fc1.parameters(), "lr": 0.05}, {"params": model.fc2.parameters(), "lr": 0.2}]
        return model, torch.optim.SGD(groups, lr=0.1)

    expected, expected_optimizer = make()
    norms = []
    for x, y in DataLoader(dataset, batch_size=4):
        F.cross_entropy(expected(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(expected.parameters(), 0.1).item())
        expected_optimizer.step()
        expected_optimizer.zero_grad()

    model, optimizer = make()
    seen = []
    step = af.clip(0.1)(af.train_step(loss_fn))
    state, step_fn = cpu.prepare(step, af.TrainState.create(model, optimizer))
    for batch, last in cpu.batches(DataLoader(dataset, batch_size=4), step, 0):
        state, metrics = step_fn(state, batch, flush=last)
        seen.append(metrics["grad_norm"].item())

    assert seen == pytest.approx(norms, rel=1e-6)
    assert min(norms) > 0.1  # every update was clipped, so per-group clipping would differ
    for actual, wanted in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(actual, wanted, rtol=1e-6, atol=1e-7)


class TokenModel(torch.nn.Module):
    """Scores each token's 4 features into 5 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def summed_loss(model, batch):
    x, y = batch  # x: (tokens, 4), y: (tokens,)
    return af.Loss(total=F.cross_entropy(model(x), y, reduction="sum"), count=len(y))


def test_loss_counts_weight_micro_batches_like_one_big_batch(cpu):
    """Micro-batches of 1, 1, 1 and 9 tokens under accumulate(4), each returning af.Loss,
    equal one batch of all 12 tokens (and differ from a mean of the 4 means)."""
    g = torch.Generator().manual_seed(5)
    sizes = [1, 1, 1, 9]
    x = torch.randn(12, 4, generator=g)
    y = torch.randint(0, 5, (12,), generator=g)
    micro_batches = list(zip(x.split(sizes), y.split(sizes)))

    def train(step, data):
        torch.manual_seed(0)
        model = TokenModel()
        state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.5))
        state = af.run(step, state, data, backend=cpu, epochs=1, progress=False)
        assert state.step == 1
        return model.proj.weight.detach().clone()

    ours = train(af.accumulate(4)(af.train_step(summed_loss)), micro_batches)
    one_batch = train(af.train_step(loss_fn), [(x, y)])
    torch.testing.assert_close(ours, one_batch, rtol=1e-6, atol=1e-7)

    torch.manual_seed(0)
    naive = TokenModel()  # what a mean of the 4 micro-batch means would give
    (sum(F.cross_entropy(naive(xb), yb) for xb, yb in micro_batches) / 4).backward()
    with torch.no_grad():
        naive.proj.weight -= 0.5 * naive.proj.weight.grad
    assert not torch.allclose(naive.proj.weight, one_batch, rtol=1e-3, atol=1e-4)


def test_loss_counts_that_differ_from_the_leading_dimension(cpu):
    """af.Loss weights micro-batches by their counted items (non-padding tokens), not by rows:
    two padded sequences of 1 and 7 real tokens equal one batch of the 8 real tokens."""
    g = torch.Generator().manual_seed(7)
    lengths = [1, 7]
    x = torch.randn(2, 7, 4, generator=g)  # (sequences, padded length, features)
    y = torch.randint(0, 5, (2, 7), generator=g)
    mask = torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]

    def masked_loss(model, batch):
        xb, yb, mb = batch
        per_token = F.cross_entropy(model(xb).flatten(0, 1), yb.flatten(), reduction="none")
        return af.Loss(total=(per_token * mb.flatten()).sum(), count=mb.sum())

    def train(step, data):
        torch.manual_seed(0)
        model = TokenModel()
        state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.5))
        af.run(step, state, data, backend=cpu, epochs=1, progress=False)
        return model.proj.weight.detach().clone()

    per_sequence = [(x[i:i + 1], y[i:i + 1], mask[i:i + 1]) for i in range(2)]
    ours = train(af.accumulate(2)(af.train_step(masked_loss)), per_sequence)
    flat = [(x[mask], y[mask])]
    reference = train(af.train_step(loss_fn), flat)
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-7)
    naive = train(af.accumulate(2)(af.train_step(lambda m, b: masked_loss(m, b).total / masked_loss(m, b).count)),
                  per_sequence)
    assert not torch.allclose(naive, reference, rtol=1e-4, atol=1e-5)


def test_metrics_report_the_window_mean_loss(cpu):
    """The logged loss of an update is the mean over the window's samples, not the last
    micro-batch's, so it does not depend on ``n``."""
    dataset = classification_data(16)
    model = make_mlp()
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.0))
    step = af.accumulate(4)(af.train_step(loss_fn))
    state, step_fn = cpu.prepare(step, state)
    seen = None
    for batch, last in cpu.batches(DataLoader(dataset, batch_size=4), step, 0):
        state, metrics = step_fn(state, batch, flush=last)
        if metrics:
            seen = metrics
    x, y = dataset.tensors
    expected = F.cross_entropy(model(x), y)
    assert seen["loss"].item() == pytest.approx(expected.item(), rel=1e-6)
    assert seen["num_samples"] == 16


def test_unsharded_shuffled_loader_is_read_like_a_hand_written_loop(cpu, monkeypatch):
    """Without shard_data, ``run`` iterates a shuffled DataLoader exactly once per epoch and
    nowhere else, so from the same global seed it sees the hand-written loop's batch order
    and reaches its parameters."""
    dataset = classification_data(40)
    loader = DataLoader(dataset, batch_size=4, shuffle=True)

    model, optimizer, _ = build("adamw", False)
    torch.manual_seed(5)
    for _ in range(2):
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()

    ours, our_optimizer, _ = build("adamw", False)
    state = af.TrainState.create(ours, our_optimizer)
    iterations = []
    original_iter = DataLoader.__iter__

    def counting_iter(self):
        iterations.append(self)
        return original_iter(self)

    monkeypatch.setattr(DataLoader, "__iter__", counting_iter)
    torch.manual_seed(5)
    state = af.run(af.train_step(loss_fn), state, loader, backend=cpu, epochs=2, progress=False)
    assert len(iterations) == 2
    for (name, expected), actual in zip(model.named_parameters(), state.model.parameters()):
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-7, msg=name)


def test_bad_loss_counts_are_refused_and_an_empty_window_has_zero_gradient(cpu):
    """af.Loss refuses negative, non-numeric or non-scalar counts and totals at
    construction; a window of 0 counted items (all padding) gives a zero gradient instead
    of NaN parameters."""
    total = torch.tensor(1.0, requires_grad=True)
    with pytest.raises(ValueError, match=r"Loss\(count=-3\)"):
        af.Loss(total=total, count=-3)
    with pytest.raises(TypeError, match="count"):
        af.Loss(total=total, count="3")
    with pytest.raises(TypeError, match="total"):
        af.Loss(total=1.0, count=3)
    with pytest.raises(ValueError, match=r"total=.*got shape \(4,\): pass the sum"):
        af.Loss(total=torch.ones(4), count=4)
    with pytest.raises(ValueError, match=r"count=.*got a tensor of shape \(2,\)"):
        af.Loss(total=total, count=torch.ones(2))

    for count in (0, torch.tensor(0)):
        torch.manual_seed(0)
        model = TokenModel()
        before = model.proj.weight.detach().clone()
        state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.5))
        step = af.train_step(lambda m, b, c=count: af.Loss(total=(m(b[0]) * 0).sum(), count=c))
        state = af.run(step, state, [(torch.randn(3, 4), None)], backend=cpu, progress=False)
        assert state.step == 1
        assert torch.equal(model.proj.weight, before)


def with_metrics(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits, y), {"accuracy": (logits.argmax(-1) == y).float().mean(), "one": 1.0}


@pytest.mark.parametrize("loss", [loss_fn, with_metrics, summed_loss], ids=["mean", "metrics", "af.Loss"])
def test_plain_program_step_function_equals_the_general_interpreter(loss, cpu):
    """A program without per-step transforms runs on ``PlainStepFn``, whose states, metrics and
    parameters equal the general ``InterpreterStepFn``'s bitwise, for each form of loss, with a scheduler."""
    step = af.with_precision("fp32")(af.train_step(loss))
    batches = [(x, y) for x, y in DataLoader(classification_data(20), batch_size=4)]
    runs = []
    for general in (False, True):
        model, optimizer, scheduler = build("adamw", with_scheduler=True)
        state, step_fn = cpu.prepare(step, af.TrainState.create(model, optimizer, scheduler=scheduler))
        assert type(step_fn) is PlainStepFn
        if general:
            step_fn = InterpreterStepFn(cpu, step, state, model)
        history = []
        for batch in batches:
            state, metrics = step_fn(state, batch)
            history.append((state.step, state.micro_step, state.epoch_micro_step, dict(state.transforms_state),
                            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}))
        runs.append((history, [p.detach().clone() for p in model.parameters()]))
    (plain_history, plain_params), (general_history, general_params) = runs
    assert len(plain_history) == len(batches) and plain_history[-1][0] == len(batches)
    for ours, theirs in zip(plain_history, general_history):
        assert ours[:4] == theirs[:4]
        assert ours[4].keys() == theirs[4].keys()
        for name, value in ours[4].items():
            assert not isinstance(value, torch.Tensor) or not value.requires_grad
            torch.testing.assert_close(value, theirs[4][name], rtol=0, atol=0, msg=name)
    for ours, theirs in zip(plain_params, general_params):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    _, accumulating = cpu.prepare(af.accumulate(2)(af.train_step(loss)), af.TrainState.create(*build("sgd", False)[:2]))
    assert type(accumulating) is InterpreterStepFn


@pytest.mark.parametrize("count", [0.5, 0.25, torch.tensor(0.5)])
def test_loss_counts_below_one_divide_exactly(cpu, count):
    """A fractional af.Loss count (sample weights summing to less than 1) divides the
    gradient by itself, not by a floor of 1: the update equals (total / count).backward()."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    models = [torch.nn.Linear(3, 1) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    expected = torch.optim.SGD(models[1].parameters(), lr=0.1)
    (((models[1](x) - y) ** 2).sum() / float(count)).backward()
    expected.step()
    step = af.train_step(lambda m, b: af.Loss(total=((m(b[0]) - b[1]) ** 2).sum(), count=count))
    state = af.TrainState.create(models[0], torch.optim.SGD(models[0].parameters(), lr=0.1))
    state = af.run(step, state, [(x, y)], backend=cpu, progress=False)
    for got, want in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_a_loss_over_no_items_is_refused_unless_zero_and_an_empty_window_logs_zero(cpu):
    """af.Loss(total=2.5, count=0) is refused (a sum over no items is 0); a window whose
    tensor count is 0 leaves the parameters unchanged whatever its total, and logs loss 0
    (not inf or NaN), as does Loss(total=0, count=0)."""
    with pytest.raises(ValueError) as error:
        af.Loss(total=torch.tensor(2.5, requires_grad=True), count=0)
    assert str(error.value) == (
        "Loss(total=2.5, count=0): a sum over no items is 0, so a total that is not 0 means the count or the "
        "total is wrong (count the items the total sums over, e.g. mask.sum(), and sum only those)")

    class Recorder:
        def __init__(self):
            self.losses = []

        def log(self, metrics, step):
            self.losses.append(metrics["loss"])

        def close(self):
            pass

    for count, scale in ((torch.tensor(0), 1.0), (0, 0.0)):
        torch.manual_seed(0)
        model = TokenModel()
        before = [p.detach().clone() for p in model.parameters()]
        state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.5))
        step = af.train_step(lambda m, b, c=count, s=scale: af.Loss(total=m(b[0]).sum() * s + 3.0 * s, count=c))
        record = Recorder()
        state = af.run(step, state, [(torch.randn(3, 4), None)], backend=cpu, progress=False, trackers=[record])
        assert state.step == 1 and record.losses == [0.0]
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
