"""What the state's learning-rate scheduler does over the run, found by stepping a copy of it.

A schedule's length has as many names as there are schedulers (``total_steps``, ``T_max``,
``total_iters``, ``num_training_steps`` inside a ``LambdaLR``'s closure, the milestones and
children of a ``SequentialLR``...), so the plan does not read it: it steps a deep copy of the
scheduler, bound to a stand-in of the optimizer (its param groups without their parameters),
and reads the learning rate each group would have after every step. From that trajectory:

- where it **raises** (``OneCycleLR`` past ``total_steps``, a lambda indexing past its list);
- where it **ends**: the step from which the learning rate no longer changes, when it then
  stays constant for at least as many steps as it took to get there (a ``StepLR`` that keeps
  halving has no end); or, for schedules that turn back up after their end (cosine
  annealing, ``OneCycleLR``), the first step at which it has come down and goes back up
  next (a plateau between is allowed; a cyclic schedule ends its first cycle there). A
  schedule still falling at the horizon (``ExponentialLR``, ``StepLR``) has no end; one
  that raises ends where it raises. Learning rates that differ only by rounding (a
  relative 1e-9) are the same.

Nothing of the user's scheduler or optimizer changes: the copy is stepped, with its
warnings silenced (torch warns that a copy's optimizer never stepped).
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import attrs
import torch

#: the most scheduler steps simulated for one plan (about 5-10 s on one CPU core for torch's
#: schedulers); ends beyond half of it are not looked for
SIMULATION_LIMIT = 1_000_000


class _StandInOptimizer:
    """What a scheduler reads and writes of its optimizer: copies of the param groups (without
    parameters) and the defaults; ``step`` does nothing."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.param_groups = [{**copy.deepcopy({k: v for k, v in group.items() if k != "params"}), "params": []}
                             for group in optimizer.param_groups]
        self.defaults = dict(optimizer.defaults)
        self.state: dict[Any, Any] = {}

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: the stand-in holds no parameters."""

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: the stand-in holds no parameters."""


@attrs.frozen
class Trajectory:
    """The learning rates a scheduler gives over the next steps.

    Attributes:
        lrs: ``lrs[k][g]``: param group ``g``'s learning rate after ``k`` more steps (``k = 0``:
            now).
        raised_at: the step (counted from now, from 1) that raised, or None.
        error: what it raised (type and message), or None.
    """

    lrs: tuple[tuple[float, ...], ...]
    raised_at: int | None = None
    error: str | None = None

    def end(self) -> int | None:
        """The steps from now after which the schedule is at its end (see the module's
        docstring), the latest over the param groups, or None when it has none within the
        trajectory."""
        ends = [_end([lrs[g] for lrs in self.lrs], self.raised_at is not None) for g in range(len(self.lrs[0]))]
        found = [e for e in ends if e is not None]
        return max(found) if found else None


def _lr(value: Any) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def _end(lrs: list[float], raised: bool) -> int | None:
    """One group's end in its trajectory ``lrs`` (``raised``: the trajectory stops where the
    scheduler raised)."""
    horizon = len(lrs) - 1
    last_change = max((k for k in range(1, horizon + 1) if _differ(lrs[k], lrs[k - 1])), default=0)
    if horizon - last_change >= last_change:
        return last_change  # settled, for at least as long as it moved
    following = lrs[:]  # following[k]: the first value after step k that differs from lrs[k] (lrs[k]: none)
    for k in range(horizon - 1, -1, -1):
        following[k] = lrs[k + 1] if _differ(lrs[k + 1], lrs[k]) else following[k + 1]
    for k in range(1, last_change):
        if lrs[k - 1] > lrs[k] < following[k] and _differ(lrs[k - 1], lrs[k]) and _differ(following[k], lrs[k]):
            return k  # came down and turned back up (cosine, one-cycle, the first cycle of a cyclic one)
    return horizon if raised else None


def _differ(a: float, b: float) -> bool:
    """Learning rates that differ by more than rounding (a relative 1e-9: a schedule's closed
    form and its recursive form, or log(n)/log(n), may differ in the last bits)."""
    return not math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def simulate(scheduler: Any, optimizer: torch.optim.Optimizer, num_steps: int,
             shared: tuple[object, ...] = ()) -> Trajectory | None:
    """Steps a copy of ``scheduler`` up to ``num_steps`` times (at most ``SIMULATION_LIMIT``).

    Args:
        scheduler: the TrainState's scheduler (anything with ``step()`` that sets the
            learning rates of ``optimizer``'s param groups).
        optimizer: the optimizer it drives (its param groups are read, never written).
        num_steps: steps to take, a count >= 0.
        shared: objects the copy refers to rather than copies (the model): a scheduler of
            one's own that holds the model does not copy it; nor are the optimizer's
            parameters copied.

    Returns:
        Trajectory | None: the learning rates, or None when the scheduler cannot be copied
        (a deep copy fails) or has no param groups.
    """
    stand_in = _StandInOptimizer(optimizer)
    if not stand_in.param_groups:
        return None
    try:
        memo: dict[int, Any] = {id(obj): obj for obj in shared}
        memo.update({id(p): p for group in optimizer.param_groups for p in group["params"]})
        memo[id(optimizer)] = stand_in
        twin = copy.deepcopy(scheduler, memo=memo)
    except Exception:  # noqa: BLE001  # an attribute deepcopy cannot copy: nothing to simulate
        return None
    lrs = [tuple(_lr(g["lr"]) for g in stand_in.param_groups)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k in range(1, min(num_steps, SIMULATION_LIMIT) + 1):
            try:
                twin.step()
            except Exception as e:  # noqa: BLE001  # the run would raise here: the caller reports it
                return Trajectory(tuple(lrs), k, f"{type(e).__name__}: {e}")
            lrs.append(tuple(_lr(g["lr"]) for g in stand_in.param_groups))
    return Trajectory(tuple(lrs))
