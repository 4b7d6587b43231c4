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


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None,
                    reason="torch_xla is installed here; this checks PJRT_DEVICE without it")
def test_pjrt_device_without_torch_xla_warns_and_auto_goes_on_without_xla(monkeypatch, capsys):
    """PJRT_DEVICE asks for XLA: without torch_xla, auto() warns (naming the install) and
    picks the device torch sees; ``accelfn env`` says why there is no XLA device."""
    from accelfn.cli import main

    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    with pytest.warns(RuntimeWarning, match=r"PJRT_DEVICE=CPU asks for torch_xla, which is not installed: auto\(\) "
                                            r"uses cpu; install it \(pip install 'torch_xla=="):
        backend = af.backends.auto(af.backends.LaunchEnv())
    assert backend.name == "cpu"
    assert main(["env"]) == 0
    assert "  xla: PJRT_DEVICE=CPU is set, but torch_xla is not installed\n" in capsys.readouterr().out
