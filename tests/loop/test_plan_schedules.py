"""``af.plan`` finds a learning-rate schedule sized for the wrong count by stepping a copy of
it, whatever the scheduler: torch's, transformers' ``LambdaLR`` warm-ups, ``SequentialLR``.

The run (2 epochs of 32 micro-batches under ``accumulate(4)``) applies 16 updates: a schedule
sized for the 64 micro-batches (the mistake of huggingface/diffusers#4387, accelerate#628)
ends at step 64 (or 63), and the plan warns naming the micro-batches; sized for the 16
updates it warns of nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers
from torch.utils.data import DataLoader, TensorDataset

import accelfn as af
from accelfn.loop.planning._schedule import simulate
from tests.helpers.programs import mse

EPOCHS, ACC, UPDATES, MICRO = 2, 4, 16, 64
S = torch.optim.lr_scheduler
T = transformers

#: name -> a scheduler of the optimizer sized for ``n`` steps
SIZED: dict[str, Callable[[torch.optim.Optimizer, int], Any]] = {
    "OneCycleLR": lambda o, n: S.OneCycleLR(o, max_lr=0.1, total_steps=n),
    "CosineAnnealingLR": lambda o, n: S.CosineAnnealingLR(o, T_max=n),
    "PolynomialLR": lambda o, n: S.PolynomialLR(o, total_iters=n),
    "LinearLR": lambda o, n: S.LinearLR(o, start_factor=1.0, end_factor=0.1, total_iters=n),
    "SequentialLR(LinearLR, CosineAnnealingLR)": lambda o, n: S.SequentialLR(
        o, [S.LinearLR(o, 0.1, total_iters=4), S.CosineAnnealingLR(o, T_max=n - 4)], milestones=[4]),
    "LambdaLR(linear decay)": lambda o, n: S.LambdaLR(o, lambda s: max(0.0, 1 - s / n)),
    "get_linear_schedule_with_warmup": lambda o, n: T.get_linear_schedule_with_warmup(o, 4, n),
    "get_cosine_schedule_with_warmup": lambda o, n: T.get_cosine_schedule_with_warmup(o, 4, n),
    "get_cosine_with_hard_restarts_schedule_with_warmup":
        lambda o, n: T.get_cosine_with_hard_restarts_schedule_with_warmup(o, 4, n, num_cycles=2),
    "get_polynomial_decay_schedule_with_warmup":
        lambda o, n: T.get_polynomial_decay_schedule_with_warmup(o, 4, n, lr_end=1e-4),
    "get_cosine_with_min_lr_schedule_with_warmup":
        lambda o, n: T.get_cosine_with_min_lr_schedule_with_warmup(o, 4, n, min_lr=1e-3),
    "get_wsd_schedule": lambda o, n: T.get_wsd_schedule(o, 4, num_decay_steps=4, num_training_steps=n),
    "get_scheduler('linear')": lambda o, n: T.get_scheduler("linear", o, num_warmup_steps=4, num_training_steps=n),
}
#: schedules without an end (or whose end is not a length): never "not finished"
ENDLESS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "StepLR": lambda o: S.StepLR(o, step_size=3, gamma=0.5),
    "ExponentialLR": lambda o: S.ExponentialLR(o, gamma=0.9),
    "CyclicLR": lambda o: S.CyclicLR(o, 0.01, 0.1, step_size_up=4),
    "get_inverse_sqrt_schedule": lambda o: T.get_inverse_sqrt_schedule(o, 4),
    "get_constant_schedule_with_warmup": lambda o: T.get_constant_schedule_with_warmup(o, 4),
    "LambdaLR(constant)": lambda o: S.LambdaLR(o, lambda s: 1.0),
}


def _loader() -> DataLoader:
    torch.manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(256, 8), torch.randn(256, 1)), batch_size=8)


def _state(make: Callable[[torch.optim.Optimizer], Any]) -> af.TrainState:
    torch.manual_seed(1)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return af.TrainState.create(model, optimizer, scheduler=make(optimizer))


def _problems(state: af.TrainState, **kwargs: Any) -> list[Any]:
    step = af.accumulate(ACC)(af.train_step(mse))
    plan = af.plan(step, state, _loader(), epochs=EPOCHS, trace=False, **kwargs)
    return [p for p in plan.problems if p.code.startswith("scheduler")]


@pytest.mark.parametrize("name", sorted(SIZED))
def test_schedule_sized_for_micro_batches_is_found(name: str) -> None:
    """Each schedule sized for the 64 micro-batches of a 16-update run gives one
    scheduler-not-finished warning that names the micro-batches and the lr it stops at."""
    [problem] = _problems(_state(lambda o: SIZED[name](o, MICRO)))
    assert problem.code == "scheduler-not-finished" and not problem.error
    assert "(the micro-batches), and the run applies only 16 optimizer updates" in problem.what
    assert f"ends at scheduler step {63 if name == 'OneCycleLR' else 64}" in problem.what
    assert "size it for 16 steps" in problem.fix


@pytest.mark.parametrize("name", sorted(SIZED))
def test_schedule_sized_for_updates_is_quiet(name: str) -> None:
    """The same schedules sized for the run's 16 updates give no scheduler problem."""
    assert _problems(_state(lambda o: SIZED[name](o, UPDATES))) == []


@pytest.mark.parametrize("name", sorted(ENDLESS))
def test_schedule_without_an_end_is_quiet(name: str) -> None:
    """Schedules that keep changing (StepLR, ExponentialLR, cyclic) or hold after a short
    warm-up have no end after the run's: no scheduler problem."""
    assert _problems(_state(ENDLESS[name])) == []


def test_schedule_sized_for_updates_times_processes_is_found() -> None:
    """Planned for 2 processes (8 updates each, the data sharded), a schedule sized for 16
    (updates x processes) is named so."""
    step = af.compose(af.shard_data(), af.replicate(), af.accumulate(ACC))(af.train_step(mse))
    state = _state(lambda o: T.get_linear_schedule_with_warmup(o, 2, 16))
    plan = af.plan(step, state, _loader(), epochs=EPOCHS, trace=False, world_size=2)
    [problem] = [p for p in plan.problems if p.code.startswith("scheduler")]
    assert plan.total_updates == 8
    assert "ends at scheduler step 16 (8 x 2 processes)" in problem.what


def test_schedule_that_raises_before_the_end_is_an_error() -> None:
    """A LambdaLR whose lambda indexes past its list of factors at update 10 of 16 is a
    scheduler-too-short error naming the update and what it raised."""
    factors = [1.0 - 0.1 * i for i in range(10)]
    [problem] = _problems(_state(lambda o: S.LambdaLR(o, lambda s: factors[s])))
    assert problem.code == "scheduler-too-short" and problem.error
    assert "this run applies 16: it raises at update 10 (IndexError: list index out of range)" in problem.what


def test_resumed_schedule_is_judged_from_its_position() -> None:
    """A schedule sized for 64 that has stepped 8 times (a resumed state at update 8 of 16)
    still ends after the run; one sized for 16 does not."""
    for n, expected in ((MICRO, ["scheduler-not-finished"]), (UPDATES, [])):
        state = _state(lambda o, n=n: T.get_linear_schedule_with_warmup(o, 4, n))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # stepping a scheduler without an optimizer step
            for _ in range(8):
                state.scheduler.step()
        state = state.replace(step=8, micro_step=32, epoch=1)
        assert [p.code for p in _problems(state)] == expected


def test_the_plan_leaves_scheduler_and_optimizer_alone() -> None:
    """Stepping the copy changes neither the user's scheduler nor its optimizer's lr; the
    trajectory is the lr the real scheduler gives step by step."""
    state = _state(lambda o: SIZED["SequentialLR(LinearLR, CosineAnnealingLR)"](o, MICRO))
    before = (state.scheduler.state_dict(), [g["lr"] for g in state.optimizer.param_groups])
    trajectory = simulate(state.scheduler, state.optimizer, 20)
    assert trajectory is not None
    _problems(state)
    assert (state.scheduler.state_dict(), [g["lr"] for g in state.optimizer.param_groups]) == before
    expected = [state.optimizer.param_groups[0]["lr"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(20):
            state.scheduler.step()
            expected.append(state.optimizer.param_groups[0]["lr"])
    assert [lrs[0] for lrs in trajectory.lrs] == expected


def test_rounding_is_no_change() -> None:
    """A warm-up whose last value differs from the plateau only in the last bits (as
    DeepSpeed's WarmupLR's does) ends where the warm-up ends, not one step later."""
    factors = [0.1, 0.4, 0.7, 1.0 - 1e-15]
    state = _state(lambda o: S.LambdaLR(o, lambda s: factors[s] if s < len(factors) else 1.0))
    trajectory = simulate(state.scheduler, state.optimizer, 12)
    assert trajectory is not None and trajectory.end() == 3


def test_a_scheduler_holding_the_model_does_not_copy_it() -> None:
    """A scheduler of one's own that keeps a reference to the model is stepped as a copy that
    shares the model and the parameters (the plan never copies the weights)."""

    class NoCopy(torch.nn.Linear):
        def __deepcopy__(self, memo: dict[int, Any]) -> Any:
            raise AssertionError("the model was copied")

    class Holding(S.LambdaLR):
        def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module):
            self.model = model
            super().__init__(optimizer, lambda s: max(0.0, 1 - s / MICRO))

    model = NoCopy(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = af.TrainState.create(model, optimizer, scheduler=Holding(optimizer, model))
    [problem] = _problems(state)
    assert problem.code == "scheduler-not-finished" and "ends at scheduler step 64" in problem.what
