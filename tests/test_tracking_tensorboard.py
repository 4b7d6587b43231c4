"""TensorBoard files: nothing logged is overwritten, and a resumed run shows each step once,
read back by TensorBoard's own reader."""

from __future__ import annotations

import signal
import subprocess
import sys

import numpy as np
import pytest

import accelfn as af
from tests.helpers import launch as _launch
from tests.helpers.events import read_tensorboard
from tests.helpers.programs import mse
from tests.helpers.tracking import Recorder, linear_job


def _as_tensorboard(points, name):
    """The (step, value) pairs of ``name`` as TensorBoard stores them (float32)."""
    return [(step, float(np.float32(metrics[name]))) for step, metrics in points if name in metrics]


def test_points_logged_after_run_closed_the_file_keep_the_runs_points(tmp_path, cpu):
    """A TensorBoard that logs again after run closed it writes a second file; TensorBoard
    shows the run's 10 loss and lr points and the added one."""
    state, data = linear_job()
    tb, record = af.TensorBoard(tmp_path / "tb"), Recorder()
    state = af.run(af.train_step(mse), state, data, backend=cpu, trackers=[tb, record], progress=False)
    tb.log({"eval/acc": 0.75}, state.step)
    tb.close()
    shown = read_tensorboard(tmp_path / "tb")
    assert shown["loss"] == _as_tensorboard(record.points, "loss")
    assert [step for step, _ in shown["lr"]] == list(range(1, 11))
    assert shown["eval/acc"] == [(10, 0.75)]
    assert len(list((tmp_path / "tb").iterdir())) == 2


def test_two_tensorboards_on_one_directory_within_one_second_keep_each_others_points(tmp_path, monkeypatch):
    """Two writers started within the same second (the clock stopped: tensorboardX names
    files by the second) each keep their file and points."""
    monkeypatch.setattr("time.time", lambda: 1_800_000_000.0)
    first = af.TensorBoard(tmp_path)
    first.log({"loss": 1.5}, 1)
    first.close()
    second = af.TensorBoard(tmp_path)
    second.log({"loss": 0.5}, 2)
    second.close()
    assert read_tensorboard(tmp_path) == {"loss": [(1, 1.5), (2, 0.5)]}


def test_a_run_resumed_after_a_crash_shows_each_step_once(tmp_path, cpu):
    """A run that crashes during update 8, after a checkpoint at step 5, and resumes from
    it with a new TensorBoard on the same directory shows steps 1..10 once each, with the
    uninterrupted run's values (the resume is exact)."""
    state, data = linear_job()
    reference = Recorder()
    af.run(af.train_step(mse), state, data, backend=cpu, trackers=[reference], progress=False)

    calls = []

    def crashing(model, batch):
        calls.append(1)
        if len(calls) == 8:
            raise RuntimeError("the machine died")
        return mse(model, batch)

    checkpoints = af.Checkpoints(tmp_path / "ckpt", every_steps=5)
    state, data = linear_job()
    with pytest.raises(RuntimeError, match="the machine died"):
        af.run(af.train_step(crashing), state, data, backend=cpu, checkpoints=checkpoints,
               trackers=[af.TensorBoard(tmp_path / "tb")], progress=False)
    state, data = linear_job()
    af.run(af.train_step(mse), state, data, backend=cpu, checkpoints=checkpoints, resume="auto",
           trackers=[af.TensorBoard(tmp_path / "tb")], progress=False)

    shown = read_tensorboard(tmp_path / "tb")
    for name in ("loss", "lr"):
        assert shown[name] == _as_tensorboard(reference.points, name), name
    assert [step for step, _ in shown["samples_per_s"]] == list(range(1, 11))


# trains linear_job()'s job with a checkpoint every 5 steps and kills itself (SIGKILL: no
# cleanup, nothing flushed on the way out) during update 8
_KILLED_JOB = """\
import os, signal, sys
import torch, torch.nn.functional as F
import accelfn as af

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(10)]
calls = []

def loss_fn(m, b):
    calls.append(1)
    if len(calls) == 8:
        os.kill(os.getpid(), signal.SIGKILL)
    return F.mse_loss(m(b[0]), b[1])

af.run(af.train_step(loss_fn), state, data, backend=af.backends.CPU(), progress=False,
       checkpoints=af.Checkpoints(sys.argv[1] + "/ckpt", every_steps=5), trackers=[af.TensorBoard(sys.argv[1] + "/tb")])
"""


def test_a_run_killed_after_a_checkpoint_and_resumed_shows_each_step_once(tmp_path, cpu):
    """A process killed (SIGKILL) during update 8, after its checkpoint at step 5, has
    written the points up to the checkpoint; resumed, TensorBoard shows steps 1..10 once
    each with the uninterrupted run's values."""
    state, data = linear_job()
    reference = Recorder()
    af.run(af.train_step(mse), state, data, backend=cpu, trackers=[reference], progress=False)

    (tmp_path / "job.py").write_text(_KILLED_JOB)
    killed = subprocess.run([sys.executable, str(tmp_path / "job.py"), str(tmp_path)], env=_launch.environment(),
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert [step for step, _ in read_tensorboard(tmp_path / "tb")["loss"]] == [1, 2, 3, 4, 5]

    state, data = linear_job()
    af.run(af.train_step(mse), state, data, backend=cpu, checkpoints=af.Checkpoints(tmp_path / "ckpt", every_steps=5),
           resume="auto", trackers=[af.TensorBoard(tmp_path / "tb")], progress=False)
    assert read_tensorboard(tmp_path / "tb")["loss"] == _as_tensorboard(reference.points, "loss")
