"""The plan and ``checkpoint_activations``: the micro-batch's peak under each policy against
torch's MemTracker measuring the real one, the budget's choice against a brute-force search, and
the exceeds-device-memory problem naming the saving recomputation predicts."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

import accelfn as af
from accelfn.loop.planning._memory import trace_micro_batch
from accelfn.loop.planning._recompute import adjusting, fewest_blocks
from accelfn.loop.planning._table import size
from accelfn.transforms.precision import parse_policy
from tests.helpers import recompute as R

#: 6 blocks whose activations (batch 256 x 1024 per block) dwarf their parameters
WIDE = {"hidden": (1024,) * 6, "width": 64, "p": 0.1}


def _wide_state() -> af.TrainState:
    torch.manual_seed(0)
    model = R.Net(**WIDE)
    return af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _batch(n: int = 256) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)]


def _real_peak(step: af.Step, batch: list[torch.Tensor]) -> int:
    """MemTracker's peak (real tensors) of one micro-batch's forward and backward on the model
    prepared for ``step``, less what existed before (parameters, buffers, the batch)."""
    state, _ = af.backends.CPU().prepare(step, _wide_state())
    model = state.model
    before = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers(), *batch])
    tracker = MemTracker()
    tracker.track_external(model, state.optimizer, *batch)
    with tracker:
        step.loss_fn(model, batch).backward()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] - before


POLICIES: dict[str, tuple[Any, ...]] = {
    "none": (),
    "full": (af.checkpoint_activations(),),
    "ops": (af.checkpoint_activations("ops"),),
    "full, every=2": (af.checkpoint_activations(every=2),),
    "budget": (af.checkpoint_activations("budget", max_bytes=12 * 2**20),),
}


@pytest.fixture(scope="module")
def measured() -> dict[str, tuple[int, int, af.Plan]]:
    """policy -> (the real peak, the planned micro-batch peak, the plan)."""
    out = {}
    batch = _batch()
    for name, transforms in POLICIES.items():
        planned = af.plan(af.compose(*transforms)(af.train_step(R.loss)), _wide_state(), [batch])
        assert planned.step is not None
        out[name] = (_real_peak(planned.step, batch), planned.memory[0].micro_batch, planned)
    return out


def test_full_recomputation_halves_the_real_peak_of_a_micro_batch(measured: dict[str, Any]) -> None:
    """On 6 blocks of wide activations, the real peak one micro-batch adds (MemTracker, real
    tensors) drops by more than half under checkpoint_activations(), and less under 'ops'."""
    none, full, ops = (measured[p][0] for p in ("none", "full", "ops"))
    assert full <= 0.5 * none
    assert full < ops < none


@pytest.mark.parametrize("policy", list(POLICIES))
def test_the_plan_is_within_ten_percent_of_the_real_peak_under_each_policy(measured: dict[str, Any],
                                                                           policy: str) -> None:
    """af.plan's traced micro-batch peak (fake tensors, the fake copy's blocks recomputing as the
    program says) is within 10% of MemTracker's real one, for no recomputation, full, ops,
    every=2 and a budget; the plan's table of policies reports the same numbers."""
    real, planned, plan = measured[policy]
    assert abs(planned - real) <= 0.1 * real, (policy, planned, real)
    if policy != "none":
        assert plan.recompute.peaks[policy] == planned
        assert plan.recompute.peaks["none"] == measured["none"][1]
        assert f"  {policy}" in str(plan)


def test_the_budget_recomputes_the_fewest_blocks_that_fit_and_run_prepares_that_choice(
        measured: dict[str, Any]) -> None:
    """A budget of 12 MiB on 6 equal blocks recomputes the earliest blocks, as few as fit (one
    fewer would not: the plan of recomputing those names is over the budget), the plan's step names
    them, and af.run recomputes the same ones."""
    _, planned, plan = measured["budget"]
    chosen = plan.recompute.chosen
    assert planned <= 12 * 2**20 and chosen == tuple(f"blocks.{i}" for i in range(len(chosen)))
    fewer = af.plan(af.checkpoint_activations(modules=list(chosen[:-1]))(af.train_step(R.loss)), _wide_state(),
                    [_batch()])
    assert fewer.memory[0].micro_batch > 12 * 2**20
    assert plan.step.find(af.CheckpointActivations).chosen == chosen
    state = af.run(POLICIES["budget"][0](af.train_step(R.loss)), _wide_state(), [_batch()] * 2, progress=False,
                   backend=af.backends.CPU())
    assert tuple(R.recomputed_blocks(state.model)) == chosen


def test_fewest_blocks_covers_each_prefix_with_its_largest_blocks() -> None:
    """By hand: blocks saving 4, 1, 3 bytes; prefix 1 is 2 over a budget of 10 (block 0 covers it),
    prefix 3 is 2 over after it (block 2, the largest left, covers it); a prefix no block can help
    (prefix 0) is left to the trace."""
    assert fewest_blocks([4, 1, 3], {0: 9, 1: 12, 2: 13, 3: 16}, 10) == [0, 2]
    assert fewest_blocks([4, 1, 3], {0: 15, 3: 11}, 10) == [0]
    assert fewest_blocks([4, 1, 3], {2: 10}, 10) == []


@pytest.mark.parametrize("hidden", [(64, 512, 128, 256), (512, 64, 64, 512)])
def test_the_budget_matches_a_brute_force_choice(hidden: tuple[int, ...]) -> None:
    """On 4 blocks of different widths, each of the 16 choices of blocks to recompute is traced as
    the plan traces a micro-batch; for a budget at the lowest peak of each number of blocks (and
    between two of them), 'budget' recomputes as few blocks as the best of all 16 choices, and the
    peak of its choice is within the budget; a budget below every choice is an error of the plan
    (recompute-budget-unreachable)."""
    def state() -> af.TrainState:
        torch.manual_seed(0)
        model = R.Net(hidden=hidden, p=0.1)
        return af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))

    batch = _batch(64)
    model = state().model
    names = [f"blocks.{i}" for i in range(len(hidden))]
    peaks = {}
    for k in range(len(names) + 1):
        for chosen in itertools.combinations(names, k):
            spec = af.checkpoint_activations("budget", max_bytes=1).resolved(chosen)
            peaks[chosen] = trace_micro_batch(model, batch, R.loss, contextlib.nullcontext, parse_policy("fp32"),
                                              adjust=adjusting(spec))
    lowest = sorted({min(p for c, p in peaks.items() if len(c) == k) for k in range(len(names) + 1)})
    budgets = [*lowest, (lowest[0] + lowest[1]) // 2]
    assert len(lowest) >= 3
    for budget in budgets:
        best = min(len(c) for c, p in peaks.items() if p <= budget)
        plan = af.plan(af.checkpoint_activations("budget", max_bytes=budget)(af.train_step(R.loss)), state(), [batch])
        assert not plan.errors, (budget, plan.errors)
        assert len(plan.recompute.chosen) == best, (budget, plan.recompute.chosen, best)
        assert peaks[plan.recompute.chosen] == plan.memory[0].micro_batch <= budget
    too_little = af.plan(af.checkpoint_activations("budget", max_bytes=lowest[0] - 1)(af.train_step(R.loss)),
                         state(), [batch])
    assert [p.code for p in too_little.errors] == ["recompute-budget-unreachable"]


def test_a_budget_no_choice_meets_is_refused_by_run_before_training() -> None:
    """af.run of a budget below what recomputing every block gives raises ValueError naming the
    budget and the peaks, before anything is prepared (no block recomputes)."""
    state = _wide_state()
    with pytest.raises(ValueError, match=r"checkpoint_activations\('budget', max_bytes=1000\): even with all 6 "
                                         r"blocks recomputed, one micro-batch adds \d+ bytes at its peak"):
        af.run(af.checkpoint_activations("budget", max_bytes=1000)(af.train_step(R.loss)), state, [_batch(64)],
               backend=af.backends.CPU(), progress=False)
    assert R.recomputed_blocks(state.model) == []


def test_exceeds_device_memory_names_checkpoint_activations_with_the_saving_it_predicts() -> None:
    """A program whose planned peak exceeds the device memory gets, beside accumulate, the fix
    af.checkpoint_activations() with the micro-batch peak it would have (the plan of that program's)
    and the saving per rank."""
    batch = [_batch()]
    plain = af.plan(af.train_step(R.loss), _wide_state(), batch, device_memory=20 * 2**20)
    full = af.plan(af.checkpoint_activations()(af.train_step(R.loss)), _wide_state(), batch)
    (problem,) = plain.errors
    none_peak, full_peak = plain.memory[0].micro_batch, full.memory[0].micro_batch
    assert problem.code == "exceeds-device-memory"
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731  # the problem's own format below 1 GiB
    assert (f"af.checkpoint_activations() (its blocks recomputed in the backward: a micro-batch peak of "
            f"{mib(full_peak)} instead of {mib(none_peak)}, {mib(none_peak - full_peak)} less per rank)") in problem.fix
    assert "af.accumulate(n)" in problem.fix
    assert size(full_peak) in str(full)
