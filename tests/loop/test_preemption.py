"""Preemption and restarts: SIGTERM/SIGINT checkpoint and exit, restarted jobs resume bitwise.

Multi-process tests start real workers with ``accelfn launch`` (torchrun) and gloo on 127.0.0.1;
the uninterrupted run they compare with runs in the session's worker pool.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import orjson
import pytest
import torch

import accelfn as af
from accelfn.errors import CheckpointError
from tests.helpers.launch import launch, python
from tests.helpers.pool import Pools
from tests.helpers.states import assert_same_state, build
from tests.workers.resume_script import job, total_steps

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "workers" / "resume_script.py"


def _launch(tmp: Path, *extra: str, max_restarts: int = 0) -> subprocess.CompletedProcess:
    """``accelfn launch --nproc-per-node 2`` of the training script; checkpoints, result and logs in ``tmp``."""
    return launch("--nproc-per-node", "2", "--max-restarts", str(max_restarts), script=SCRIPT,
                  script_args=(tmp / "ckpts", tmp / "result", tmp / "logs", *extra), check=False)


def _log(tmp: Path, rank: int) -> list[list[str]]:
    return [line.split() for line in (tmp / "logs" / f"rank{rank}.log").read_text().splitlines()]


def _manifest(path: Path) -> dict:
    return orjson.loads((path / "manifest.json").read_bytes())


def _load_fresh(path: Path, world_size: int) -> af.TrainState:
    return af.load(path, into=build(99, total_steps=total_steps(world_size)))


def test_sigterm_mid_epoch_checkpoints_and_the_same_command_finishes_bitwise(cpu, tmp_path) -> None:
    """SIGTERM in the middle of an epoch and of an accumulation window makes the process
    finish the micro-batch, write a checkpoint and exit with 143; rerunning the same command
    with resume="auto" ends with exactly the parameters, optimizer state and RNG state of an
    uninterrupted run."""
    command = (SCRIPT, tmp_path / "ckpts", tmp_path / "result", tmp_path / "logs", "--interrupt", "sigterm:0:13")
    first = python(*command)
    assert first.returncode == 143, first.stderr
    assert "SIGTERM received; saved" in first.stderr
    latest = af.Checkpoints(tmp_path / "ckpts").latest()
    assert latest.name == "step_00000006"
    assert _manifest(latest)["counters"] == {"step": 6, "micro_step": 13, "epoch": 1, "epoch_micro_step": 3}
    assert _manifest(latest)["ranks"][0]["grads"]  # saved mid-window, with its gradients

    second = python(*command)
    assert second.returncode == 0, second.stderr
    assert _log(tmp_path, 0) == [["-", "step_00000006", "17", "15", "30"]]  # resumed at micro-batch 13 of 30

    step, state, data, _ = job(1)
    uninterrupted = af.run(step, state, data, backend=cpu, epochs=3, progress=False)
    rng_after = torch.get_rng_state()
    resumed = _load_fresh(tmp_path / "result", 1)
    assert_same_state(resumed, uninterrupted)
    assert torch.equal(torch.get_rng_state(), rng_after)


def test_sigterm_to_the_process_group_with_dataloader_workers_checkpoints(cpu, tmp_path) -> None:
    """A scheduler's SIGTERM reaches the DataLoader workers too: they must survive it so that
    the process finishes the micro-batch, checkpoints and exits with 143 (instead of failing
    with "DataLoader worker is killed by signal"); the resumed run ends bitwise like an
    uninterrupted one."""
    command = (SCRIPT, tmp_path / "ckpts", tmp_path / "result", tmp_path / "logs", "--interrupt",
               "sigterm-group:0:13", "--workers", "2")
    first = python(*command)
    assert first.returncode == 143, first.stderr
    assert "SIGTERM received; saved" in first.stderr
    assert _manifest(af.Checkpoints(tmp_path / "ckpts").latest())["counters"]["micro_step"] == 13

    second = python(*command)
    assert second.returncode == 0, second.stderr
    step, state, data, _ = job(1, workers=2)
    uninterrupted = af.run(step, state, data, backend=cpu, epochs=3, progress=False)
    assert_same_state(_load_fresh(tmp_path / "result", 1), uninterrupted)


def test_sigint_in_process_saves_restores_handlers_and_resumes_bitwise(cpu, tmp_path) -> None:
    """SIGINT during run() checkpoints after the current micro-batch and raises SystemExit(130)
    with the previous handlers back in place; resuming from that checkpoint gives the
    uninterrupted result."""
    step, state, data, _ = job(1)
    uninterrupted = af.run(step, state, data, backend=cpu, epochs=3, progress=False)

    calls = [0]

    def interrupting(model, batch):
        calls[0] += 1
        if calls[0] == 8:
            os.kill(os.getpid(), signal.SIGINT)
        return step.loss_fn(model, batch)

    checkpoints = af.Checkpoints(tmp_path, every_steps=100)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    _, state, _, _ = job(1)
    with pytest.raises(SystemExit) as stopped:
        af.run(af.Step(interrupting, step.transforms), state, data, backend=cpu, epochs=3,
               checkpoints=checkpoints, progress=False)
    assert stopped.value.code == 130
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert checkpoints.steps() == [4]
    resumed = af.run(step, build(99), data, backend=cpu, epochs=3, checkpoints=checkpoints, resume="auto",
                     progress=False)
    assert_same_state(resumed, uninterrupted)


def test_a_second_sigint_interrupts_at_once(cpu, tmp_path) -> None:
    """Two SIGINTs in one micro-batch raise KeyboardInterrupt without waiting for a checkpoint."""
    step, state, data, _ = job(1)

    def impatient(model, batch):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        return step.loss_fn(model, batch)

    with pytest.raises(KeyboardInterrupt):
        af.run(af.Step(impatient, step.transforms), state, data, backend=cpu, epochs=3,  # the job's epochs
               checkpoints=af.Checkpoints(tmp_path), progress=False)
    assert af.Checkpoints(tmp_path).steps() == []


@pytest.fixture(scope="module")
def uninterrupted_two_processes(tmp_path_factory, pool: Pools) -> Path:
    """The result of the 2-process job run without interruption (in the worker pool: its
    subject is the result; the restarts below are real launches)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    pool.launch("--nproc-per-node", "2", script=SCRIPT, script_args=(tmp / "ckpts", tmp / "result", tmp / "logs"))
    return tmp / "result"


@pytest.mark.multiprocess
def test_crashed_worker_is_restarted_and_the_job_ends_bitwise(tmp_path, uninterrupted_two_processes) -> None:
    """Under accelfn launch --max-restarts 2, a worker that crashes (os._exit) mid-epoch makes the
    group restart; resume="auto" continues from the latest checkpoint, and the final state,
    saved by 2 processes and loaded into 1, equals the uninterrupted run's on every rank."""
    done = _launch(tmp_path, "--interrupt", "exit:1:9", max_restarts=2)
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):  # restarted once, resumed at step 4 (micro-batch 7 of 15 per rank)
        assert _log(tmp_path, rank) == [["1", "step_00000004", "8", "9", "15"]]
    result, expected = _manifest(tmp_path / "result"), _manifest(uninterrupted_two_processes)
    assert result["world_size"] == 2 and result["ranks"] == expected["ranks"]  # every rank's RNG
    assert_same_state(_load_fresh(tmp_path / "result", 2), _load_fresh(uninterrupted_two_processes, 2))


@pytest.mark.multiprocess
def test_sigterm_on_one_rank_stops_all_at_one_micro_batch(tmp_path, uninterrupted_two_processes) -> None:
    """SIGTERM to one of two workers makes both stop after the same micro-batch, mid-window,
    and save one checkpoint with each rank's gradients; torchrun restarts them and the job
    ends bitwise like the uninterrupted one. That checkpoint cannot resume in 1 process."""
    done = _launch(tmp_path, "--interrupt", "sigterm:1:7", max_restarts=1)
    assert done.returncode == 0, done.stderr
    assert "SIGTERM received; saved" in done.stderr
    stopped = tmp_path / "ckpts" / "step_00000004"
    manifest = _manifest(stopped)
    assert manifest["counters"] == {"step": 4, "micro_step": 8, "epoch": 1, "epoch_micro_step": 3}
    assert [bool(rank["grads"]) for rank in manifest["ranks"]] == [True, True]
    for rank in (0, 1):
        assert _log(tmp_path, rank) == [["1", "step_00000004", "7", "9", "15"]]
    assert_same_state(_load_fresh(tmp_path / "result", 2), _load_fresh(uninterrupted_two_processes, 2))
    with pytest.raises(CheckpointError, match="saved by 2 processes in the middle of an accumulation window"):
        _load_fresh(stopped, 2)
