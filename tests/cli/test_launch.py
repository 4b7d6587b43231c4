"""`accelfn launch` with real processes: free ports, two nodes on loopback, config files, failures."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import accelfn as af
from accelfn.cli import commands as cli
from tests.helpers import launch as _launch
from tests.helpers import sockets
from tests.helpers.pool import Pools

pytestmark = pytest.mark.multiprocess

EXAMPLE = _launch.ROOT / "examples" / "digits.py"


def write_config(*flags: str | Path) -> None:
    """`accelfn config FLAGS...`, run in this process (the command is the same; only the
    launches below need processes of their own)."""
    assert cli.main(["config", *map(str, flags)]) == 0


class Job(NamedTuple):
    """A finished launch: the directory it ran in (its ranks' records) and its outcome."""

    out: Path
    result: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def two_jobs(tmp_path_factory: pytest.TempPathFactory) -> list[Job]:
    """Two `accelfn launch` jobs of 2 hello.py processes started together (one launch each, several
    tests' claims), both from config files that `accelfn config` wrote (2 processes, cpu, bf16,
    timeout 45):

    - the first: `--config launch.yaml --precision fp16`, its script also getting a stray
      `--tag=--nproc-per-node=7`;
    - the second: in a directory holding the `accelfn.yaml` that `accelfn config` writes by
      default (no --config), with ACCELFN_TIMEOUT_S=33 and ACCELFN_PRECISION=fp16 set and
      `--precision fp32`; its script records the sockets its processes listen on.
    """
    config = ("--nproc-per-node", "2", "--backend", "cpu", "--precision", "bf16", "--timeout-s", "45")
    first, second = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
    write_config(*config, "-o", first / "launch.yaml")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(second)
        write_config(*config)
    procs = [
        _launch.start("launch", "--config", first / "launch.yaml", "--precision", "fp16", _launch.WORKERS / "hello.py",
                      "--out", first, "--tag=--nproc-per-node=7", cwd=first),
        _launch.start("launch", "--precision", "fp32", _launch.WORKERS / "hello.py", "--out", second,
                      *(["--sockets"] if sockets.available() else []), cwd=second,
                      env=_launch.environment(ACCELFN_TIMEOUT_S="33", ACCELFN_PRECISION="fp16")),
    ]
    jobs = [Job(out, _launch.finish(proc)) for out, proc in zip((first, second), procs)]
    for job in jobs:
        _launch.assert_ok(job.result)
    return jobs


def test_two_jobs_started_at_once_both_succeed(two_jobs: list[Job]) -> None:
    """Two `accelfn launch` jobs of 2 processes started together on one machine both form a world of 2,
    on ports of their own."""
    ports = []
    for job in two_jobs:
        ranks = _launch.read_ranks(job.out, 2)
        assert [r["rank"] for r in ranks] == [0, 1]
        assert all(r["world_size"] == 2 and r["sum_of_ranks_plus_one"] == 3.0 for r in ranks)
        assert ranks[0]["master_port"] == ranks[1]["master_port"]
        ports.append(ranks[0]["master_port"])
    assert ports[0] != ports[1]


def test_a_job_on_one_machine_listens_on_loopback_alone(two_jobs: list[Job]) -> None:
    """No process of a 2-process `accelfn launch` (the launcher, with torchrun's rendezvous
    store; rank 0, with the process group's store; each rank's gloo sockets, which the workers
    put on the loopback interface) listens outside 127.0.0.0/8 while the job runs; and there
    are such sockets to look at."""
    if not sockets.available():
        pytest.skip("reading listening sockets needs Linux's /proc/net/tcp")
    assert [r["gloo_socket_ifname"] for r in _launch.read_ranks(two_jobs[1].out, 2)] == ["lo", "lo"]
    rank0 = _launch.read_ranks(two_jobs[1].out, 2)[0]
    found = [tuple(s) for s in rank0["listening"]]
    assert sockets.outside_loopback(found) == [], found
    owners = {pid for pid, _, _ in found}
    assert {rank0["launcher_pid"], rank0["rank_pids"][0]} <= owners, found  # the rendezvous's and the group's stores
    assert rank0["rank_pids"][0] != rank0["launcher_pid"]


def test_two_nodes_on_loopback_form_one_world_from_flags_or_a_kubeflow_pods_variables(tmp_path: Path) -> None:
    """Two launchers of one process each, node 0 given --nnodes 2 --node-rank 0 --master-addr
    --master-port, node 1 only a Kubeflow PyTorchJob v1 pod's variables (RANK 1, WORLD_SIZE 2,
    MASTER_ADDR, MASTER_PORT, no LOCAL_RANK) with `--nproc-per-node 1`, form one world of 2 with
    ranks 0 and 1 (the pod joins the job instead of training alone in a world of its own)."""
    port = str(_launch.free_port())
    node0 = ["--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", port]
    pod1 = _launch.environment(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    procs = [
        _launch.start("launch", "--backend", "cpu", *(node0 if node == 0 else []), "--nproc-per-node", "1",
                      "--timeout-s", "60", _launch.WORKERS / "hello.py", "--out", tmp_path, "--tag", f"node{node}",
                      cwd=tmp_path, env=None if node == 0 else pod1)
        for node in (0, 1)
    ]
    for proc in procs:
        _launch.assert_ok(_launch.finish(proc))
    ranks = _launch.read_ranks(tmp_path, 2)
    assert [r["tag"] for r in ranks] == ["node0", "node1"]
    for rank, r in enumerate(ranks):
        assert (r["rank"], r["world_size"], r["local_rank"], r["local_world_size"]) == (rank, 2, 0, 1)
        assert r["sum_of_ranks_plus_one"] == 3.0


def test_script_with_a_stray_local_rank_option_runs(two_jobs: list[Job]) -> None:
    """A script that declares --local_rank and parses strictly gets only its own arguments, unchanged."""
    for rank, r in enumerate(_launch.read_ranks(two_jobs[0].out, 2)):
        assert r["rank"] == r["local_rank"] == rank
        assert r["stray_local_rank"] == -1  # nothing was passed to it: ranks come from the environment
        assert r["tag"] == "--nproc-per-node=7"  # an option of the launcher's, after the script, is the script's


def test_config_file_round_trip_with_a_flag_override(two_jobs: list[Job]) -> None:
    """`accelfn config` writes a file that `accelfn launch --config` applies (2 processes, cpu,
    timeout 45), a flag overriding one field (--precision fp16 over the file's bf16)."""
    for r in _launch.read_ranks(two_jobs[0].out, 2):
        assert r["world_size"] == 2
        assert (r["requested_backend"], r["backend"], r["precision"], r["timeout_s"]) == ("cpu", "cpu", "fp16", 45.0)


def test_flags_override_the_environment_which_overrides_the_config_file(two_jobs: list[Job]) -> None:
    """ACCELFN_* variables already set reach the workers over the config file's values and
    the defaults (timeout 33, not the file's 45); a flag overrides them (--precision fp32 over
    the variable's fp16 and the file's bf16)."""
    assert [(r["precision"], r["timeout_s"]) for r in _launch.read_ranks(two_jobs[1].out, 2)] == [("fp32", 33.0)] * 2


def test_default_config_file_in_the_working_directory_is_used(two_jobs: list[Job]) -> None:
    """`accelfn config` without -o writes ./accelfn.yaml; without --config, launch reads it and
    says so (2 processes on cpu: the file's, not the defaults' 1 process)."""
    second = two_jobs[1]
    assert (second.out / "accelfn.yaml").is_file()
    assert "using the launch config accelfn.yaml" in second.result.stderr
    assert [(r["world_size"], r["requested_backend"]) for r in _launch.read_ranks(second.out, 2)] == [(2, "cpu")] * 2
    assert "using the launch config" not in two_jobs[0].result.stderr  # --config given: the file named, no default


def test_rank_without_its_peer_fails_with_a_launch_error_instead_of_hanging(tmp_path: Path) -> None:
    """A rank of a world of 2 whose peer never starts exits non-zero with LaunchError after ACCELFN_TIMEOUT_S."""
    env = _launch.environment(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_launch.free_port()), ACCELFN_TIMEOUT_S="2",
                              ACCELFN_BACKEND="cpu")
    started = time.monotonic()
    result = _launch.python(_launch.WORKERS / "hello.py", "--out", tmp_path, env=env)
    assert result.returncode != 0
    assert "LaunchError: rank 0 of WORLD_SIZE=2 could not form the gloo process group" in result.stderr
    assert time.monotonic() - started < 60


def test_inconsistent_launch_variables_fail_before_any_group_is_formed(monkeypatch: pytest.MonkeyPatch) -> None:
    """RANK without WORLD_SIZE makes the backend a worker asks for (af.backends.auto(), as
    hello.py's first call) raise a LaunchError that names both variables, before any group is formed."""
    for name in set(os.environ) - set(_launch.environment()):  # the launch's and other engines' variables
        monkeypatch.delenv(name)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(af.LaunchError, match="RANK is set but WORLD_SIZE is not"):
        af.backends.auto()
    assert not torch.distributed.is_initialized()


def test_a_failing_worker_fails_the_launch_with_its_exit_code(tmp_path: Path) -> None:
    """When a worker exits with status 3, `accelfn launch` exits with 3 (and does not hang)."""
    script = tmp_path / "fail.py"
    script.write_text("import sys\nimport accelfn as af\nb = af.backends.auto()\n"
                      "sys.exit(3 if b.rank == 1 else 0)\n")
    result = _launch.launch("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "30", script=script,
                            cwd=tmp_path, check=False)
    assert result.returncode == 3, result.stderr[-3000:]


def test_digits_example_under_two_processes_reaches_the_accuracy_bar(tmp_path: Path, pool: Pools) -> None:
    """examples/digits.py, unchanged, under `accelfn launch --nproc-per-node 2` reaches >= 95% held-out accuracy
    (run as ``__main__`` in the session's pool of started 2-process workers: its subject is the example, not the
    launch, which the other tests here start for real)."""
    result = pool.launch("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60", script=EXAMPLE,
                         script_args=("--logdir", tmp_path / "tb"), cwd=tmp_path)
    reports = re.findall(r"held-out accuracy: ([0-9.]+)", result.stdout)
    assert len(reports) == 1, result.stdout[-2000:]  # printed by the main process only
    assert float(reports[0]) >= 0.95
    assert len([p for p in (tmp_path / "tb").rglob("*") if p.is_file()]) == 1


def test_sigterm_to_the_launcher_is_forwarded_and_it_exits_143(tmp_path: Path) -> None:
    """SIGTERM to `accelfn launch` reaches both workers, which save one checkpoint and exit, and the
    launcher then exits with 143 (not 1), without a traceback."""
    launcher = _launch.start("launch", "--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60",
                             _launch.WORKERS / "slow_job.py", "--out", tmp_path, cwd=tmp_path)
    deadline = time.monotonic() + 120
    while not (tmp_path / "ready").exists():
        assert launcher.poll() is None, launcher.communicate()[1][-4000:]
        assert time.monotonic() < deadline, "the workers never reached step 2"
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    result = _launch.finish(launcher)
    assert result.returncode == 143, result.stderr[-4000:]
    assert "Traceback" not in result.stderr and "SignalException" not in result.stderr
    assert "accelfn launch: SIGTERM received, forwarded to the workers, which have exited; exiting with " \
           "status 143" in result.stderr
    saved = re.findall(r"accelfn: SIGTERM received; saved \S+/(step_\d+) ", result.stderr)
    assert len(saved) == 1  # printed by the main process once both ranks stopped and saved
    assert [p.name for p in (tmp_path / "ckpts").iterdir()] == saved
    assert int(saved[0].removeprefix("step_")) >= 2
