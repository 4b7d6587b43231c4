"""Shared fixtures: the same global RNG state for every test, the one-process CPU backend, the
session's pools of started 2-process workers (``tests/helpers/pool.py``), and mypy started in
the background as soon as its test is selected (``tests/helpers/background.py``)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import accelfn as af
from tests.helpers import background
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


_MYPY = pytest.StashKey[background.Mypy]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Starts mypy at once when its test will run, so that it runs beside the other tests."""
    if any(item.nodeid == background.MYPY_TEST for item in session.items):
        session.config.stash[_MYPY] = background.Mypy()


def pytest_unconfigure(config: pytest.Config) -> None:
    if _MYPY in config.stash:
        config.stash[_MYPY].stop()


@pytest.fixture
def mypy(request: pytest.FixtureRequest) -> background.Mypy:
    """The session's background mypy run (one started now if there is none)."""
    return request.config.stash.get(_MYPY, None) or background.Mypy()
