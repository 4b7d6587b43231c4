"""``af.tolerate_faults``: replica groups on torchft that die, hang and come back, with real
processes on loopback (a lighthouse, launches of one process each), and its parts checked alone:
the record, the shares, the phase's checks, the live state's encoding and its transport."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import accelfn as af
from accelfn.checkpoint import _format
from accelfn.errors import CheckpointError, LaunchError, TransformError
from accelfn.transforms.tolerate_faults import share
from tests.helpers import faults
from tests.helpers import launch as _launch

torchft = pytest.importorskip("torchft", reason="tolerate_faults runs on torchft: pip install torchft (.ci/run does)")


def _state(seed: int = 0) -> af.TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return af.TrainState.create(model, optimizer, scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 2))


def _loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return F.mse_loss(model(batch), torch.zeros(len(batch), 2))


def test_tolerate_faults_validates_and_conflicts() -> None:
    """tolerate_faults() checks its arguments, and refuses the parallelisms that split one copy
    of the model (shard_params, tensor_parallel, context_parallel, pipeline, deepspeed) with a TransformError."""
    with pytest.raises(ValueError, match="replica_groups"):
        af.tolerate_faults(0)
    with pytest.raises(ValueError, match="min_replicas=3.*at most replica_groups=2"):
        af.tolerate_faults(2, min_replicas=3)
    with pytest.raises(ValueError, match="timeout_s"):
        af.tolerate_faults(2, timeout_s=0)
    with pytest.raises(TypeError, match="lighthouse"):
        af.tolerate_faults(2, lighthouse="node0")
    for other in (af.shard_params(), af.tensor_parallel({"0": "colwise"}, size=2), af.context_parallel(size=2),
                  af.pipeline(["0"], size=2),
                  af.deepspeed({"train_micro_batch_size_per_gpu": 1})):
        with pytest.raises(TransformError, match="tolerate_faults"):
            af.tolerate_faults(2)(other(af.train_step(af.output_loss(lambda output, targets: output.sum()))))


def test_the_shares_cover_every_micro_batch_once() -> None:
    """share(n, i, p) cuts n positions into p contiguous parts whose sizes differ by at most
    one: together every position exactly once, in order."""
    for count in range(1, 13):
        for parts in range(1, 6):
            cut = [list(share(count, i, parts)) for i in range(parts)]
            assert sum(cut, []) == list(range(count))
            assert max(map(len, cut)) - min(map(len, cut)) <= 1


@pytest.mark.parametrize(("program", "env", "error", "message"), [
    (af.tolerate_faults(2), {"ACCELFN_REPLICA_GROUP": "0", "TORCHFT_LIGHTHOUSE": "http://h:1"}, TransformError,
     "compose it with replicate"),
    (af.compose(af.replicate(), af.tolerate_faults(2)), {"TORCHFT_LIGHTHOUSE": "http://h:1"}, LaunchError,
     "belongs to no replica group"),
    (af.compose(af.replicate(), af.tolerate_faults(2)), {"ACCELFN_REPLICA_GROUP": "2", "TORCHFT_LIGHTHOUSE": "http://h:1"},
     LaunchError, "numbered 0..1"),
    (af.compose(af.replicate(), af.tolerate_faults(2), af.accumulate(2)), {"ACCELFN_REPLICA_GROUP": "0"}, LaunchError,
     "no lighthouse"),
    (af.compose(af.replicate(), af.tolerate_faults(2)), {"ACCELFN_REPLICA_GROUP": "0", "TORCHFT_LIGHTHOUSE": "http://h:1"},
     TransformError, r"accumulate\(2\) or more"),
])
def test_a_program_or_launch_that_cannot_run_is_refused_before_anything_changes(
        program: Any, env: dict[str, str], error: type[Exception], message: str) -> None:
    """prepare() refuses, naming the fix and before the model moves or the Manager starts: no
    replicate(), no replica group or one outside replica_groups, no lighthouse, and without
    invariant() fewer micro-batches per update than groups."""
    state = _state()
    before = [p.detach().clone() for p in state.model.parameters()]
    backend = af.backends.CPU(af.backends.LaunchEnv.from_env(env))
    with pytest.raises(error, match=message):
        backend.prepare(program(af.train_step(_loss)), state)
    assert all(torch.equal(a, b) for a, b in zip(before, state.model.parameters()))
    assert "tolerate_faults" not in state.transforms_state


def test_a_live_state_travels_whole_and_is_checked() -> None:
    """_format.pack_live / unpack_live carry everything (parameters, optimizer moments, scheduler,
    counters and data position, transform states, RNG) into another state of the same
    program; a state of another model is refused naming the mismatch, garbage and a state of
    another accelfn are refused too, and nothing is unpickled (the bytes are JSON and raw tensors)."""
    sender = _state(0)
    sender.model(torch.randn(2, 3)).sum().backward()
    sender.optimizer.step()
    sender.scheduler.step()
    sender = sender.replace(step=5, micro_step=20, epoch=1, epoch_micro_step=8)
    torch.manual_seed(123)
    data = _format.pack_live(sender)
    drawn = torch.rand(3)
    receiver = _format.unpack_live(_state(1), data, source="group 0's state")
    assert (receiver.step, receiver.micro_step, receiver.epoch, receiver.epoch_micro_step) == (5, 20, 1, 8)
    for a, b in zip(sender.model.state_dict().values(), receiver.model.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(sender.optimizer.state_dict()["state"][0]["exp_avg"],
                       receiver.optimizer.state_dict()["state"][0]["exp_avg"])
    assert receiver.scheduler.state_dict() == sender.scheduler.state_dict()
    assert torch.equal(torch.rand(3), drawn)  # the sender's RNG, as it was when packed
    assert b"pickle" not in data.numpy().tobytes()[:64] and data.numpy().tobytes()[8:9] == b"{"
    linear = torch.nn.Linear(3, 2)
    other = af.TrainState.create(linear, torch.optim.AdamW(linear.parameters()))
    with pytest.raises(CheckpointError, match="does not match"):
        _format.unpack_live(other, data, source="group 0's state")
    with pytest.raises(CheckpointError, match="does not decode"):
        _format.unpack_live(_state(1), torch.zeros(64, dtype=torch.uint8), source="group 0's state")


def test_the_transport_serves_bytes_for_the_step_asked() -> None:
    """The state transport serves a staged state for its step over HTTP and the receiver gets
    it back part for part; another step is not served; a truncated body is refused."""
    from accelfn.distributed._state_transport import StateTransport, decode, encode

    sent = {"user": {"default": torch.arange(10, dtype=torch.uint8)}, "torchft": {"step": 7, "batches_committed": 3}}
    transport = StateTransport("localhost", timeout_s=2)
    try:
        transport.send_checkpoint([1], 7, sent, timedelta(seconds=2))
        got = transport.recv_checkpoint(0, transport.metadata(), 7, timedelta(seconds=5))
        assert got["torchft"] == sent["torchft"] and torch.equal(got["user"]["default"], sent["user"]["default"])
        with pytest.raises(ConnectionError, match="step 8"):
            transport.recv_checkpoint(0, transport.metadata(), 8, timedelta(seconds=5))
    finally:
        transport.shutdown()
    with pytest.raises(ValueError, match="ends after"):
        decode(encode(sent)[:-3])


# -- real replica groups ------------------------------------------------------------------------

def _launch_args(port: int, group: int, *extra: str) -> tuple[str, ...]:
    return ("--nproc-per-node", "1", "--backend", "cpu", "--timeout-s", "120", "--replica-group", str(group),
            "--lighthouse", f"localhost:{port}", *extra)


@pytest.mark.multiprocess
@pytest.mark.long
def test_a_replica_group_killed_and_brought_back_ends_with_the_uninterrupted_bits(
        tmp_path: Path, uninterrupted: dict[str, Any]) -> None:
    """Two replica groups under invariant(micro_batches_per_update=4): group 1's launch (launcher
    and worker) is killed with SIGKILL at a random update k and started again some updates
    later. Group 0 never restarts (one worker process throughout) and applies every update
    exactly once, alone (replicas 1, still 4 micro-batches) while group 1 is gone; group 1
    copies group 0's live state (healed) and rejoins (replicas 2). Both end byte-identical to
    the uninterrupted one-process run. Group 0's launch serves the lighthouse."""
    out = tmp_path / "job"
    out.mkdir()
    port = _launch.free_port()
    progress0, progress1 = out / "progress-0.jsonl", out / "progress-1.jsonl"
    kill_at = random.Random().randrange(2, 9)
    with faults.Jobs() as jobs:
        (out / "tick").write_text("0.3")
        group0 = jobs.start(out, *_launch_args(port, 0, "--serve-lighthouse"), script_args=("--ft",))
        group1 = jobs.start(out, *_launch_args(port, 1), script_args=("--ft",))
        faults.wait_for(f"update {kill_at} of group 1", lambda: any(
            p["step"] >= kill_at and p["replicas"] == 2 for p in faults.lines(progress1)), jobs=(group0, group1))
        faults.kill_node(group1)
        killed = len(faults.lines(progress1))
        faults.wait_for("two updates of group 0 alone", lambda: sum(
            p["replicas"] == 1 for p in faults.lines(progress0)) >= 2, jobs=(group0,))
        (out / "tick").write_text("3")  # group 0 crawls (below the lighthouse's join timeout) while group 1 starts
        group1 = jobs.start(out, *_launch_args(port, 1), script_args=("--ft",))
        faults.wait_for("group 1 to heal and rejoin", lambda: len(faults.lines(progress1)) > killed + 1,
                        jobs=(group0, group1))
        (out / "tick").write_text("0")
        for job in (group0, group1):
            _launch.assert_ok(_launch.finish(job))
    seen0, seen1 = faults.lines(progress0), faults.lines(progress1)
    assert [p["step"] for p in seen0] == list(range(1, 37)), kill_at  # every update once, none lost
    assert {p["pid"] for p in seen0} == {seen0[0]["pid"]}  # group 0 never restarted
    alone = [p for p in seen0 if p["replicas"] == 1]
    assert alone and all(p["micro_batches"] == 4 for p in seen0), kill_at  # the survivor computed all 4
    assert seen0[-1]["replicas"] == 2 and seen1[killed]["healed"] == 1, kill_at
    assert seen1[killed]["step"] > kill_at  # it rejoined from group 0's position, not from the start
    for group in (0, 1):
        faults.same_run(faults.final(out, group), uninterrupted)


def _lighthouse(jobs: faults.Jobs, port: int) -> subprocess.Popen:
    """torchft's lighthouse alone on ``port`` (quick to leave out a group that stops heartbeating
    or stops asking)."""
    code = (f"import time; from torchft._torchft import LighthouseServer; s = LighthouseServer(bind='[::]:{port}', "
            "min_replicas=1, join_timeout_ms=2000, quorum_tick_ms=50, heartbeat_timeout_ms=2000); time.sleep(3600)")
    return jobs.process(sys.executable, "-c", code, env=_launch.environment(RUST_LOG="warn"),
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.mark.multiprocess
@pytest.mark.long
def test_without_invariant_a_worker_killed_a_hung_group_and_a_lighthouse_restart(tmp_path: Path) -> None:
    """Two replica groups without invariant() (accumulate(4): group g computes micro-batches
    2g, 2g+1 of every update). SIGKILL to group 1's worker: its launcher starts it again
    (--max-restarts 1) and it heals from group 0's live state. Group 1 hangs inside a
    micro-batch for 15 s while its heartbeats go on: group 0's exchange times out (timeout_s=10)
    and the update is replayed; the lighthouse forms no quorum of one of two heartbeating groups
    (torchft's split-brain rule), so the replay waits for the hung group and both apply the
    update once it wakes. The lighthouse is killed and started again: both groups carry on.
    While a group is missing, group 0's updates hold 2 micro-batches instead of 4 (the logged
    deviation: half the batch), with replicas 1; every update is applied (by one group at least:
    a group that heals copies the updates it missed), group 0 never restarts, and the two
    groups end with the same bits."""
    out = tmp_path / "job"
    out.mkdir()
    port = _launch.free_port()
    progress0, progress1 = out / "progress-0.jsonl", out / "progress-1.jsonl"
    with faults.Jobs() as jobs:
        lighthouse = _lighthouse(jobs, port)
        (out / "tick").write_text("0.3")
        group0 = jobs.start(out, *_launch_args(port, 0), script_args=("--ft", "--plain"))
        group1 = jobs.start(out, *_launch_args(port, 1, "--max-restarts", "1"), script_args=("--ft", "--plain"))
        both = (group0, group1)
        faults.wait_for("update 3 of both groups", lambda: len(faults.lines(progress1)) >= 3
                        and len(faults.lines(progress0)) >= 3, jobs=both)
        for worker in faults.workers(group1):  # the worker alone: its launcher lives and restarts it
            os.kill(worker, signal.SIGKILL)
        seen = len(faults.lines(progress1))
        (out / "tick").write_text("1.5")
        faults.wait_for("group 1's worker to heal", lambda: any(
            p["healed"] == 1 for p in faults.lines(progress1)[seen:]), jobs=both)
        (out / "tick").write_text("0.3")
        hung = len(faults.lines(progress1))
        (out / "hang-1").write_text("15")  # group 1 stuck in its next micro-batch, heartbeating
        faults.wait_for("both groups to apply the update the hang interrupted", lambda: any(
            p["replays"] >= 1 and p["replicas"] == 2 for p in faults.lines(progress1)[hung:]), jobs=both)
        before = len(faults.lines(progress0))
        lighthouse.kill()
        lighthouse.wait()
        time.sleep(3)
        lighthouse = _lighthouse(jobs, port)
        faults.wait_for("an update after the lighthouse's restart", lambda: len(faults.lines(progress0)) > before + 1,
                        jobs=both)
        (out / "tick").write_text("0")
        for job in both:
            _launch.assert_ok(_launch.finish(job))
    seen0, seen1 = faults.lines(progress0), faults.lines(progress1)
    for seen in (seen0, seen1):  # each group applies an update at most once; a group that heals skips some
        steps = [p["step"] for p in seen]
        assert steps == sorted(set(steps))
        assert all(p["micro_batches"] == 2 * p["replicas"] for p in seen)  # a missing group's part is not computed
    assert {p["step"] for p in seen0 + seen1} == set(range(1, 37))  # every update applied, none lost
    assert {p["pid"] for p in seen0} == {seen0[0]["pid"]}  # group 0 never restarted
    assert {p["replicas"] for p in seen0 + seen1} == {1, 2}
    first, second = faults.final(out, 0), faults.final(out, 1)
    assert first["sha256"] == second["sha256"] and first["step"] == second["step"] == 36
