"""Without torch_xla, asking for the XLA backend says how to install it."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import accelfn as af


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None,
                    reason="torch_xla is installed here; this checks the error raised without it")
@pytest.mark.parametrize("make", [lambda env: af.backends.XLA(env), af.backends.auto], ids=["XLA", "auto"])
def test_xla_without_torch_xla_names_the_install_command(make):
    """af.backends.XLA(), and auto() under ACCELFN_BACKEND=xla, raise ImportError with the pip
    command for the torch_xla release matching the installed torch."""
    version = torch.__version__.split("+")[0]
    env = af.backends.LaunchEnv.from_env({"ACCELFN_BACKEND": "xla"})
    with pytest.raises(ImportError, match=f"pip install 'torch_xla=={version}'"):
        make(env)
