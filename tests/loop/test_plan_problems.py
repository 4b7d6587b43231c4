"""The misconfiguration catalogue: each minimal bad program's plan names its problem with a fix,
and ``af.run`` stops on it before the first forward (the loss function was never called): an
``af.PlanError`` naming every error (or the exception of the check that already raised it, such
as prepare's NotImplementedError), a ``PlanWarning`` raised as an error under a warnings filter."""

from __future__ import annotations

import pytest
import torch

import accelfn as af
from tests.helpers import bad_programs as B
from tests.helpers.pool import Pools

TWO = ("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60")


@pytest.mark.parametrize("code", list(B.CATALOGUE))
def test_the_plan_names_the_problem_and_its_fix(code):
    """The case's plan (for its world size, planned in one process) has the problem, with its
    severity, the values seen and a fix."""
    build, error = B.CATALOGUE[code]
    step, state, data, kwargs, world_size = build()
    B.CALLS[0] = 0
    plan = af.plan(step, state, data, world_size=world_size, **kwargs)
    found = [p for p in plan.problems if p.code == code]
    assert len(found) == 1, plan.problems
    assert found[0].error is error
    assert found[0].what and found[0].fix
    assert f"[{code}]" in str(plan) and "Fix: " in str(found[0])


ONE_PROCESS = [c for c, (build, _) in B.CATALOGUE.items() if build()[4] == 1]


@pytest.mark.parametrize("code", ONE_PROCESS)
def test_run_stops_before_the_first_forward(cpu, code):
    """af.run raises on the case before calling loss_fn once, naming the problem and its fix."""
    result = B.run_case(code, cpu)
    assert result["calls"] == 0
    assert result["raised"] is not None
    if result["raised"] in ("PlanError", "PlanWarning"):
        assert f"[{code}]" in result["message"] and "Fix: " in result["message"]


def test_plan_error_lists_every_error_and_plan_false_skips_the_check(cpu):
    """Two errors at once are both in the PlanError; run(plan=False) trains into the one that
    raises at run time (OneCycleLR stepped past its end)."""
    step, state, data, _, _ = B.scheduler_too_short()
    data = B.DataLoader(B._data(14), batch_size=8, drop_last=True)  # and drops 6 of 14
    with pytest.raises(af.PlanError, match=r"(?s)2 errors.*\[drop-last-large\].*\[scheduler-too-short\]") as e:
        af.run(step, state, data, backend=cpu, epochs=3, progress=False)
    assert {p.code for p in e.value.problems} == {"drop-last-large", "scheduler-too-short"}
    B.CALLS[0] = 0
    with pytest.raises(ValueError, match="Tried to step 3 times"):
        af.run(step, state, B.DataLoader(B._data(), batch_size=4), backend=cpu, progress=False, plan=False)
    assert B.CALLS[0] == 3


def test_a_meta_model_the_program_shards_or_splits_is_no_problem() -> None:
    """A model built on the meta device is a warning of the plan only where prepare would not fill
    it: under shard_params() or tensor_parallel(...) (prepare fills each rank's part) the plan,
    and af.run's check, have no meta-model problem (docs/11's tp.py printed one)."""
    for parallel in (af.shard_params(), af.tensor_parallel({"0": "colwise", "2": "rowwise"}, size=2)):
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        plan = af.plan(B._step(af.shard_data(), parallel), B._state(model), B.DataLoader(B._data(), batch_size=4),
                       world_size=2)
        assert "meta-model" not in {p.code for p in plan.problems}, plan.problems


@pytest.fixture(scope="module")
def two_processes(pool: Pools):
    return pool.call(*TWO, function="plan_checks:catalogue", timeout_s=300)


@pytest.mark.multiprocess
def test_run_stops_before_the_first_forward_on_two_processes(two_processes):
    """On two processes every rank raises on each 2-process error case before calling loss_fn."""
    codes = [c for c, (build, error) in B.CATALOGUE.items() if error and build()[4] == 2 and c not in B.PLAN_ONLY]
    assert len(codes) == 3
    for rank in two_processes:
        for code in codes:
            assert rank[code]["calls"] == 0
            raised, message = rank[code]["raised"], rank[code]["message"]
            # a PlanError names the code; the data's and prepare's own checks say the fix in theirs
            assert raised == "PlanError" and f"[{code}]" in message or raised == "ValueError" and "multiple" in message


def test_docs_07_lists_every_problem_the_plan_knows():
    """docs/07's table has a row for every code of the catalogue's checks."""
    import re

    from accelfn.loop.planning import _problems as _plan_problems
    from tests.helpers import launch as _launch

    source = (_launch.ROOT / "accelfn" / "loop" / "planning" / "_problems.py").read_text()
    codes = set(re.findall(r'Problem\("([a-z0-9-]+)"', source))
    assert len(_plan_problems.CHECKS) >= 20 and len(codes) >= 25
    page = (_launch.ROOT / "docs" / "07-troubleshooting.md").read_text()
    assert {c for c in codes if f"| `{c}` |" not in page} == set()
