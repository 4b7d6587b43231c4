"""``accelfn plan [launch flags] SCRIPT``: the unchanged script runs in one process that plans for
the launch's world size; af.run prints the plan and exits (status 1 on a plan with errors)
without training.

The command itself runs in the test's process (``commands.main``, as ``accelfn plan`` calls
it): what it starts, the script's own process, is real, with the environment a launched
test job gets.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from accelfn.cli import commands as cli
from tests.helpers import launch as _launch

BAD = """
import torch, torch.nn.functional as F, accelfn as af
from torch.utils.data import DataLoader, TensorDataset

model = torch.nn.Linear(4, 2)
state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 2)), batch_size=6)
step = af.compose(af.shard_data(split_batches=True), af.replicate())(
    af.train_step(lambda m, b: F.mse_loss(m(b[0]), b[1])))
af.run(step, state, data, backend=af.backends.auto())
print("TRAINED")
"""


def plan(*args: str | os.PathLike[str], cwd: Path, monkeypatch: pytest.MonkeyPatch,
         capfd: pytest.CaptureFixture[str]) -> subprocess.CompletedProcess:
    """``accelfn plan ARGS...`` in ``cwd`` with the test jobs' environment (``_launch.environment()``):
    its exit status and what it (the script's process) printed."""
    env = _launch.environment()
    for name in set(os.environ) - set(env):
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(cwd)
    capfd.readouterr()
    status = cli.main(["plan", *map(str, args)])
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["accelfn", "plan", *map(str, args)], status, out, err)


def test_plan_of_the_byte_lm_on_eight_processes_prints_and_trains_nothing(tmp_path, monkeypatch, capfd):
    """`accelfn plan --nproc-per-node 8 examples/byte_lm.py` prints the plan for 8 processes (300
    updates, the DDP bucket, no problems) and exits 0 before training: no checkpoint is written
    and nothing after af.run runs."""
    result = plan("--nproc-per-node", "8", _launch.ROOT / "examples" / "byte_lm.py", "--run-dir", tmp_path / "runs",
                  "--max-bytes", "300000", cwd=tmp_path, monkeypatch=monkeypatch, capfd=capfd)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "plan: 8 processes, cpu backend, bf16; 300 optimizer updates" in result.stdout
    assert "all_reduce DDP bucket 0" in result.stdout and "problems: none found" in result.stdout
    assert "after 300 optimizer updates" not in result.stdout  # the script's line after af.run
    assert not (tmp_path / "runs" / "ckpt").exists()


def test_plan_with_errors_exits_1_naming_them(tmp_path, monkeypatch, capfd):
    """A global batch of 6 split over --nproc-per-node 4 --nnodes 2 (8 processes): the plan names
    the error with its fix, the command exits 1 and the script goes no further."""
    script = tmp_path / "bad.py"
    script.write_text(BAD)
    result = plan("--nproc-per-node", "4", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "29500",
                  script, cwd=tmp_path, monkeypatch=monkeypatch, capfd=capfd)
    assert result.returncode == 1, result.stderr
    assert "plan: 8 processes" in result.stdout
    assert "error [global-batch-indivisible]" in result.stdout and "Fix: use a DataLoader batch_size" in result.stdout
    assert "TRAINED" not in result.stdout


def test_plan_of_a_script_with_its_own_loop_refuses_and_trains_nothing(tmp_path, monkeypatch, capfd):
    """examples/gan_digits.py prepares its two programs itself (backend.prepare) and loops: under
    `accelfn plan` the first prepare exits 2 saying so, before any batch: no epoch line, no checkpoint."""
    result = plan("--nproc-per-node", "2", _launch.ROOT / "examples" / "gan_digits.py", "--dir", tmp_path / "gan",
                  "--epochs", "1", cwd=tmp_path, monkeypatch=monkeypatch, capfd=capfd)
    assert result.returncode == 2, result.stderr
    assert "calls backend.prepare(step, state) and trains in a loop of its own" in result.stdout
    assert "af.plan(step, state, data, world_size=2)" in result.stdout
    assert "epoch 0" not in result.stdout and not (tmp_path / "gan").exists()


def test_the_planned_script_sees_the_planned_world(tmp_path, monkeypatch, capfd):
    """Under `accelfn plan --nproc-per-node 2` the script's backend has world_size 2, so docs/14's
    check.py (``accumulate(8 // backend.world_size)`` under invariant(): 256 samples in blocks of
    2 x 4 micro-batches of 4) is planned at the 8 updates the 2-process launch applies, not 4."""
    import re

    from tests.docs.test_docs import blocks

    page = _launch.ROOT / "docs" / "14-invariant.md"
    [check] = [b.code for b in blocks(page) if b.option("file") == "check.py"]
    (tmp_path / "check.py").write_text(check)
    result = plan("--nproc-per-node", "2", tmp_path / "check.py", tmp_path / "two.json", cwd=tmp_path,
                  monkeypatch=monkeypatch, capfd=capfd)
    assert result.returncode == 0, result.stderr[-4000:]
    assert re.search(r"^plan: 2 processes, cpu backend, fp32; 8 optimizer updates$", result.stdout, re.MULTILINE), \
        result.stdout
    assert not (tmp_path / "two.json").exists()
