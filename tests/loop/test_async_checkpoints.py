"""Checkpoints written in the background: same results as synchronous saves, errors raised
in the training process, and a kill at any instant leaves a complete checkpoint."""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import accelfn as af
from accelfn.errors import CheckpointError
from tests.helpers.launch import environment
from tests.helpers.pool import Pools
from tests.helpers.states import assert_same_state, build, loader, loss_fn, program
from tests.workers import async_saves

WORKER = Path(__file__).resolve().parents[1] / "workers" / "async_saves.py"


def _train(tmp: Path, *, asynchronous: bool, cpu: af.backends.CPU) -> af.TrainState:
    torch.manual_seed(0)
    checkpoints = af.Checkpoints(tmp, every_steps=2, asynchronous=asynchronous)
    return af.run(program(), build(0), loader(), backend=cpu, epochs=3, checkpoints=checkpoints, progress=False)


def test_asynchronous_saves_give_the_same_parameters_and_checkpoints_as_synchronous_ones(cpu, tmp_path) -> None:
    """A run saving in the background ends bitwise where the same run with synchronous saves
    ends, and writes the same checkpoints, each loading to bitwise the same state."""
    synchronous = _train(tmp_path / "sync", asynchronous=False, cpu=cpu)
    asynchronous = _train(tmp_path / "async", asynchronous=True, cpu=cpu)
    assert_same_state(asynchronous, synchronous)
    sync_steps = af.Checkpoints(tmp_path / "sync").steps()
    assert af.Checkpoints(tmp_path / "async").steps() == sync_steps == list(range(2, 16, 2))
    for step in sync_steps:  # the manifests hold the counters, RNG states and every file's checksum
        name = f"step_{step:08d}/manifest.json"
        assert (tmp_path / "async" / name).read_bytes() == (tmp_path / "sync" / name).read_bytes()


class Handed:
    """A tracker (on every rank) that records, for each checkpoint it is handed, its name, its
    step, the last step logged when it was handed, and whether it was complete then."""

    every_rank = True

    def __init__(self) -> None:
        self.last_logged = 0
        self.handed: list[tuple[str, int, int, bool]] = []

    def log(self, metrics, step: int) -> None:
        self.last_logged = step

    def saved(self, path: Path, step: int) -> None:
        complete = (path / "manifest.json").is_file() and path.name in {p.name for p in path.parent.iterdir()}
        self.handed.append((path.name, step, self.last_logged, complete))

    def close(self) -> None:
        pass


def test_a_tracker_is_handed_a_background_checkpoint_only_when_it_is_complete(cpu, tmp_path, monkeypatch) -> None:
    """With background saves slowed down (0.3 s before each write), a tracker's saved(path,
    step) is called once per checkpoint, in order, each time with a complete checkpoint: at a
    later update than its step (the one after its write ended) or when run ends, never while
    it is being written (af.RayTrain hands Ray the directory to copy there)."""
    write = af.Checkpoints._write

    def slow(self, path, write_files):
        time.sleep(0.3)
        return write(self, path, write_files)

    monkeypatch.setattr(af.Checkpoints, "_write", slow)
    tracker = Handed()
    torch.manual_seed(0)
    af.run(program(), build(0), loader(), backend=cpu, epochs=3, progress=False, trackers=[tracker], log_every=1,
           checkpoints=af.Checkpoints(tmp_path, every_steps=2, asynchronous=True))
    assert [(name, step) for name, step, _, _ in tracker.handed] == [
        (f"step_{s:08d}", s) for s in range(2, 16, 2)]
    assert all(complete for *_, complete in tracker.handed)
    assert all(at > step for _, step, at, _ in tracker.handed[:-1])  # handed after the update that saved it


def test_a_failing_background_write_raises_in_the_training_process_with_path_and_cause(cpu, tmp_path) -> None:
    """When the file system refuses a background write (here: a file-size limit, as a full
    disk would), run raises a CheckpointError naming the checkpoint and the OS error."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    calls = []

    def loss(model, batch):
        calls.append(1)
        if len(calls) == 5:  # before update 3, whose checkpoint is the first (every_steps=3)
            resource.setrlimit(resource.RLIMIT_FSIZE, (100, hard))  # smaller than any tensor file
        return loss_fn(model, batch)

    step = af.compose(af.shard_data(seed=3), af.accumulate(2))(af.train_step(loss))
    checkpoints = af.Checkpoints(tmp_path, every_steps=3, asynchronous=True)
    try:
        with pytest.raises(CheckpointError) as info:
            af.run(step, build(0), loader(), backend=cpu, epochs=3, checkpoints=checkpoints, progress=False)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    message = str(info.value)
    assert message.startswith(f"writing the checkpoint {tmp_path / 'step_00000003'} in the background failed: "
                              "OSError: [Errno 27] File too large"), message
    assert af.Checkpoints(tmp_path).steps() == []


class Trainers:
    """Trainers of ``tests/workers/async_saves.py``, forked from one interpreter that
    imported torch once (``--fork``), so that each kill costs no interpreter start."""

    def __init__(self) -> None:
        self._server = subprocess.Popen([sys.executable, str(WORKER), "--fork"], env=environment(),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _ask(self, line: str) -> int:
        assert self._server.stdin is not None and self._server.stdout is not None
        self._server.stdin.write(line + "\n")
        self._server.stdin.flush()
        return int(self._server.stdout.readline().split()[1])

    def start(self, directory: Path) -> int:
        """Forks a trainer checkpointing into ``directory``; returns its pid."""
        return self._ask(f"run {directory}")

    def wait(self, pid: int) -> int:
        """The exit status of trainer ``pid`` (-signal when killed)."""
        return self._ask(f"wait {pid}")

    def close(self) -> None:
        self._server.kill()
        self._server.communicate()


@pytest.fixture
def trainers():
    server = Trainers()
    yield server
    server.close()


def _wait_for_checkpoints(directory: Path, count: int) -> None:
    """Waits until at least ``count`` checkpoints are complete (one is written per update)."""
    checkpoints = af.Checkpoints(directory)
    deadline = time.monotonic() + 120
    while (checkpoints.latest() or directory / "step_00000000").name < f"step_{count:08d}":
        assert time.monotonic() < deadline, f"no checkpoint {count} in {directory} after 120 s"
        time.sleep(0.01)


def _assert_entirely_one_step(path: Path) -> int:
    """Loads ``path`` and checks that every parameter holds the checkpoint's step; returns it."""
    state = af.load(path, into=async_saves.build())
    values = torch.cat([p.detach().reshape(-1) for p in state.model.parameters()])
    assert torch.equal(values, torch.full_like(values, float(state.step))), f"{path} mixes steps"
    assert path.name == f"step_{state.step:08d}"
    return state.step


def test_kill_9_during_background_saves_always_leaves_a_complete_checkpoint(tmp_path, trainers) -> None:
    """SIGKILL at random instants while ~100 MB checkpoints are written in the background
    (one after every update) leaves a latest checkpoint that loads and is entirely one
    step's state, the old or the new."""
    for i, delay in enumerate(random.Random(16).sample([i / 100 for i in range(60)], 4)):
        directory = tmp_path / f"kill{i}"
        pid = trainers.start(directory)
        try:
            _wait_for_checkpoints(directory, 1)  # then the next one is being written
            time.sleep(delay)
        finally:
            os.kill(pid, signal.SIGKILL)
        assert trainers.wait(pid) == -signal.SIGKILL
        latest = af.Checkpoints(directory).latest()
        assert latest is not None
        assert _assert_entirely_one_step(latest) >= 1


def test_sigterm_during_a_background_save_exits_143_with_the_newest_checkpoint_resumable(tmp_path, trainers) -> None:
    """SIGTERM while checkpoints are written in the background waits for the one in flight,
    writes the final checkpoint and exits with 143; that checkpoint is the latest, loads
    whole, and resume="auto" continues from it."""
    directory = tmp_path / "ckpts"
    pid = trainers.start(directory)
    _wait_for_checkpoints(directory, 2)
    os.kill(pid, signal.SIGTERM)
    assert trainers.wait(pid) == 143
    err = (tmp_path / "ckpts.stderr").read_text()
    stopped = int(err.split("(step ")[1].split(",")[0])
    assert f"SIGTERM received; saved {directory / f'step_{stopped:08d}'} (step {stopped}," in err
    assert af.Checkpoints(directory).latest() == directory / f"step_{stopped:08d}"
    assert _assert_entirely_one_step(directory / f"step_{stopped:08d}") == stopped
    resumed = af.run(af.train_step(async_saves.loss_fn), async_saves.build(), [0] * 1000, backend=af.backends.CPU(),
                     epochs=None, max_steps=stopped + 1, checkpoints=af.Checkpoints(directory), resume="auto",
                     progress=False)
    assert resumed.step == stopped + 1
    assert torch.equal(resumed.model[0], torch.full_like(resumed.model[0], stopped + 1.0))


@pytest.mark.multiprocess
def test_two_processes_saving_in_the_background_match_synchronous_saves(pool: Pools, tmp_path) -> None:
    """With 2 processes (gloo), background saves (rank 0 writes; the gather stays in the
    training thread) give every rank the parameters of synchronous saves, and the same
    checkpoints, byte for byte in their manifests (RNG states of both ranks included), each
    handed to a tracker on every rank once, complete, at the same update on both ranks; when
    rank 0's background write fails, both ranks raise (rank 0 with the path and cause)."""
    pool.launch("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60", script="async_ranks.py",
                script_args=(tmp_path,))
    for rank in range(2):
        synchronous = load_file(tmp_path / f"rank{rank}-sync.safetensors")
        asynchronous = load_file(tmp_path / f"rank{rank}-async.safetensors")
        assert all(torch.equal(asynchronous[k], synchronous[k]) for k in synchronous)
    steps = af.Checkpoints(tmp_path / "sync").steps()
    assert af.Checkpoints(tmp_path / "async").steps() == steps and len(steps) >= 3
    for step in steps:
        name = f"step_{step:08d}/manifest.json"
        assert (tmp_path / "async" / name).read_bytes() == (tmp_path / "sync" / name).read_bytes()
    for mode in ("sync", "async"):  # each checkpoint handed once, complete, at the same update on both ranks
        handed = [json.loads((tmp_path / f"rank{rank}-{mode}-handed.json").read_text()) for rank in range(2)]
        assert handed[0] == handed[1]
        assert [s for s, _, _ in handed[0]] == steps and all(complete for *_, complete in handed[0])
    failed = tmp_path / "failing" / "step_00000002"
    errors = [(tmp_path / f"rank{rank}-error.txt").read_text() for rank in range(2)]
    assert errors[0].startswith(f"writing the checkpoint {failed} in the background failed: OSError: "
                                "[Errno 27] File too large"), errors[0]
    assert errors[1] == "rank 0 failed to write the checkpoint of step 2 in the background; its error says why"
    assert af.Checkpoints(tmp_path / "failing").steps() == []


def test_asynchronous_must_be_a_bool_and_shows_in_the_repr(tmp_path) -> None:
    """Checkpoints(asynchronous=...) takes True or False, refusing anything else with the
    value it got; the record's repr shows it."""
    with pytest.raises(TypeError, match=r"^Checkpoints\(asynchronous=...\) must be True or False, got 'yes'$"):
        af.Checkpoints(tmp_path, asynchronous="yes")
    assert repr(af.Checkpoints("runs", every_steps=5, asynchronous=True)) == (
        "Checkpoints('runs', every_steps=5, every_seconds=None, keep=None, asynchronous=True)")
