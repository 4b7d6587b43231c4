"""Shared fixtures: the same global RNG state for every test, the one-process CPU backend, and the
session's pools of started 2-process workers (``tests/helpers/pool.py``)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import accelfn as af
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
def pool(tmp_path_factory: pytest.TempPathFactory):
    """Started ``accelfn launch`` jobs that run worker scripts and scenarios for tests which
    do not test the launch itself (``Pools.launch``, ``Pools.call``); ended with the session."""
    pools = Pools(tmp_path_factory.mktemp("pool"))
    yield pools
    pools.close()
