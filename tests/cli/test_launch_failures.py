"""`accelfn launch` when the job cannot form: a node that never comes, a busy port; and the
precision override warning, with real processes."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch

import accelfn as af
from accelfn.cli import commands as cli
from tests.helpers import launch as _launch

# a script whose with_precision('fp16') overrides a launch's precision
_FP16_SCRIPT = """\
import torch
import accelfn as af

backend = af.backends.auto()
model = torch.nn.Linear(2, 1)
state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
backend.prepare(af.with_precision("fp16")(af.train_step(lambda m, b: m(b).sum())), state)
backend.print("prepared on", backend.world_size, "processes")
"""


@pytest.mark.multiprocess
def test_a_node_that_never_comes_ends_a_static_rendezvous_after_timeout_s(tmp_path: Path) -> None:
    """Node 0 of --nnodes 2 whose node 1 never starts exits 1 after --timeout-s 2 (not
    torchrun's 600 s) with a message naming the rendezvous and the timeout, no traceback."""
    port = _launch.free_port()
    started = time.monotonic()
    result = _launch.launch("--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port",
                            str(port), "--backend", "cpu", "--timeout-s", "2", script="hello.py",
                            script_args=("--out", tmp_path), timeout_s=120, check=False)
    assert time.monotonic() - started < 100
    assert result.returncode == 1, result.stderr
    assert (f"accelfn launch: error: the rendezvous at 127.0.0.1:{port} of 2 nodes did not complete within 2 s "
            "(--timeout-s, ACCELFN_TIMEOUT_S): DistStoreError: ") in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.multiprocess
def test_accelfn_timeout_s_bounds_a_c10d_rendezvous(tmp_path: Path) -> None:
    """ACCELFN_TIMEOUT_S=2 in the launcher's environment bounds a c10d rendezvous of 2 nodes
    that only one joins: exit 1 with the message, no traceback."""
    endpoint = f"127.0.0.1:{_launch.free_port()}"
    result = _launch.launch("--nnodes", "2", "--rdzv-endpoint", endpoint, "--backend", "cpu", script="hello.py",
                            script_args=("--out", tmp_path), env=_launch.environment(ACCELFN_TIMEOUT_S="2"),
                            timeout_s=120, check=False)
    assert result.returncode == 1, result.stderr
    assert (f"accelfn launch: error: the rendezvous at {endpoint} of 2 nodes did not complete within 2 s "
            "(--timeout-s, ACCELFN_TIMEOUT_S): RendezvousTimeoutError") in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.multiprocess
def test_a_busy_master_port_exits_2_with_a_message(tmp_path: Path) -> None:
    """--master-port that another process listens on exits 2 with a message naming the port
    and the fix, no traceback."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = _launch.launch("--master-port", str(port), "--backend", "cpu", script="hello.py",
                                script_args=("--out", tmp_path), timeout_s=120, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"accelfn launch: error: --master-port {port} is in use on this machine (another job, or one that has "
        "not exited yet, holds it); on one machine leave --master-port out to let the OS pick a free port, or give "
        "every node another free port")
    assert "Traceback" not in result.stderr


@pytest.mark.multiprocess
def test_the_precision_override_warning_is_printed_once_naming_the_config_file(tmp_path: Path) -> None:
    """A 2-process launch whose config file asks for bf16, of a script with
    with_precision('fp16'), warns once (the main process), naming the file, not --precision."""
    (tmp_path / "train.py").write_text(_FP16_SCRIPT)
    # `accelfn config`, in this process: only the launch needs processes of its own
    assert cli.main(["config", "--nproc-per-node", "2", "--backend", "cpu", "--precision", "bf16", "--timeout-s",
                     "60", "-o", str(tmp_path / "launch.yaml")]) == 0
    result = _launch.launch("--config", "launch.yaml", script=tmp_path / "train.py", cwd=tmp_path)
    assert "prepared on 2 processes" in result.stdout
    assert result.stderr.count("is overridden by the script's") == 1, result.stderr
    assert ("UserWarning: precision: bf16 in the launch config launch.yaml is overridden by the script's "
            "with_precision('fp16')") in result.stderr


@pytest.mark.parametrize(("precision_from", "asked"), [
    ("--precision", "accelfn launch --precision bf16"),
    ("accelfn.yaml", "precision: bf16 in the launch config accelfn.yaml"),
    (None, "ACCELFN_PRECISION=bf16"),
])
def test_the_precision_override_warning_names_where_the_precision_came_from(precision_from, asked) -> None:
    """The warning names the flag, the config file, or the variable set by hand."""
    backend = af.backends.CPU(af.backends.LaunchEnv(precision="bf16", precision_from=precision_from))
    model = torch.nn.Linear(2, 1)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.warns(UserWarning) as caught:
        backend.prepare(af.with_precision("fp16")(af.train_step(lambda m, b: m(b).sum())), state)
    assert [str(w.message) for w in caught] == [f"{asked} is overridden by the script's with_precision('fp16')"]


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    """`accelfn --version` prints "accelfn 0.1.0" and exits 0."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"accelfn {af.__version__}\n" == "accelfn 0.1.0\n"
