"""Shared fixtures: the same global RNG state for every test, the one-process CPU backend, the
session's pools of started 2-process workers (``tests/helpers/pool.py``), the fault tests'
uninterrupted run (``tests/helpers/faults.py``), and mypy started in the background as soon as
its test is selected (``tests/helpers/background.py``)."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import accelfn as af
from tests.helpers import background, faults, schedule
from tests.helpers.pool import Pools


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same global RNG state."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


@pytest.fixture(autouse=True)
def _no_users_launch_config(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """No test (nor a process it starts) reads the developer's own launch config
    (~/.config/accelfn/config.yaml) or launch variables set in their shell."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.getbasetemp() / "no-user-config"))
    for name in ("ACCELFN_CONFIG_FILE", "ACCELFN_ACCUMULATE", "ACCELFN_COMPILE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def cpu() -> af.backends.CPU:
    """The one-process CPU backend."""
    return af.backends.CPU(af.backends.LaunchEnv())


@pytest.fixture(scope="session")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pools]:
    """Started ``accelfn launch`` jobs that run worker scripts and scenarios for tests which
    do not test the launch itself (``Pools.launch``, ``Pools.call``); ended with the session."""
    pools = Pools(tmp_path_factory.mktemp("pool"))
    yield pools
    pools.close()


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The fault tests' uninterrupted one-process run's final counters and digest, run once."""
    return faults.uninterrupted(tmp_path_factory)


_MYPY = pytest.StashKey[background.Mypy]()
_MYPY_OUTPUT = "accelfn_mypy_output"  # the controller's mypy output file, in each xdist worker's workerinput


def _distributing(config: pytest.Config) -> bool:
    """This process is pytest-xdist's controller of worker processes."""
    return not hasattr(config, "workerinput") and getattr(config.option, "dist", "no") != "no"


def pytest_configure(config: pytest.Config) -> None:
    """torch's intra-op pool at one thread in every test process, as launched workers run it
    (``OMP_NUM_THREADS=1``): the suite's small models gain nothing from a second thread, and
    its spin-waits burn the CPU the other xdist worker needs (the digits example: 4 s of CPU
    on one thread, 38 s on two on a busy 2-core machine, the same accuracy).

    Under pytest-xdist, the controller starts mypy before its workers (when the run's
    paths include the mypy test's), so that it runs once, whichever worker gets the test."""
    torch.set_num_threads(1)
    if _distributing(config):
        test = Path(str(config.rootpath / background.MYPY_TEST.partition("::")[0]))
        for arg in config.args:
            path, _, name = arg.partition("::")
            if (test == Path(path).resolve() or Path(path).resolve() in test.parents) and \
                    name in ("", background.MYPY_TEST.partition("::")[2]):
                config.stash[_MYPY] = background.Mypy()
                break


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Each pytest-xdist worker gets the path of the controller's mypy output."""
    if _MYPY in node.config.stash:
        node.workerinput[_MYPY_OUTPUT] = str(node.config.stash[_MYPY].output)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject's addopts): one worker per CPU this process may use, at most 4,
    when the run names a directory (the whole suite); none, so that tests run in this
    process, when it names only test files or tests (a developer's run of a few tests)."""
    if all(Path(arg.partition("::")[0]).is_file() for arg in config.args):
        return 0
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadscope`` (pyproject's addopts) with each docs page a unit of its own and the
    long units first, so that the workers finish together (``tests/helpers/schedule.py``)."""
    if config.getvalue("dist") == "loadscope":
        return schedule.Scheduling(config, log)
    return None


def pytest_collection_finish(session: pytest.Session) -> None:
    """Starts mypy at once when its test will run, so that it runs beside the other tests
    (in the controller instead under pytest-xdist)."""
    workerinput = getattr(session.config, "workerinput", {})
    if _MYPY_OUTPUT in workerinput:
        session.config.stash[_MYPY] = background.Mypy.attach(workerinput[_MYPY_OUTPUT])
    elif not workerinput and any(item.nodeid == background.MYPY_TEST for item in session.items):
        session.config.stash[_MYPY] = background.Mypy()


def pytest_unconfigure(config: pytest.Config) -> None:
    if _MYPY in config.stash:
        config.stash[_MYPY].stop()


@pytest.fixture
def mypy(request: pytest.FixtureRequest) -> Iterator[background.Mypy]:
    """The session's background mypy run (one started now if there is none)."""
    started = request.config.stash.get(_MYPY, None)
    run = started or background.Mypy()
    yield run
    if started is None:
        run.stop()
