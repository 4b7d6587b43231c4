"""Elastic launches: ``accelfn launch --nnodes MIN:MAX`` (flag, config key, Kubeflow's variables)
over torchrun's c10d rendezvous, and a node killed at a random update of a real job."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from accelfn.cli import commands as cli
from accelfn.cli import config as launch_config
from accelfn.cli import precedence
from accelfn.errors import LaunchError
from tests.helpers import faults
from tests.helpers import launch as _launch

ENDPOINT = ("--rdzv-endpoint", "node0:29400", "--max-restarts", "2")


def _config(*flags: str) -> launch_config.LaunchConfig:
    args = cli.build_parser().parse_args(["launch", *flags, "train.py"])
    return precedence.resolve(cli._given(args), environ={}).config


def test_nnodes_min_max_runs_torchrun_elastic() -> None:
    """--nnodes 1:4 passes torchrun --nnodes 1:4 with the c10d endpoint, and --rdzv-conf's
    settings beside the join timeout --timeout-s sets; --nnodes 2 is a job of exactly 2."""
    config = _config("--nnodes", "1:4", *ENDPOINT, "--rdzv-conf", "last_call_timeout=2,keep_alive_interval=1",
                     "--timeout-s", "30")
    assert (config.min_nnodes, config.nnodes, config.elastic) == (1, 4, True)
    assert config.torchrun_args() == [
        "--nnodes", "1:4", "--nproc-per-node", "1", "--max-restarts", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "node0:29400", "--rdzv-id", "accelfn", "--rdzv-conf",
        "join_timeout=30,last_call_timeout=2,keep_alive_interval=1"]
    fixed = _config("--nnodes", "2", *ENDPOINT)
    assert (fixed.elastic, fixed.torchrun_args()[:2]) == (False, ["--nnodes", "2"])


@pytest.mark.parametrize(("flags", "message"), [
    (("--nnodes", "1:2"), "dynamic rendezvous .* give --rdzv-endpoint"),
    (("--nnodes", "1:2", "--master-addr", "h", "--master-port", "29500"), "dynamic rendezvous"),
    (("--nnodes", "1:2", "--rdzv-endpoint", "h:1"), "give --max-restarts K"),
    (("--nnodes", "1:2", *ENDPOINT, "--rdzv-conf", "join_timeout=5"), "which --timeout-s .* sets"),
    (("--serve-lighthouse",), "give --lighthouse too"),
])
def test_an_elastic_job_that_cannot_run_is_refused_naming_the_fix(flags: tuple[str, ...], message: str) -> None:
    """An elastic range without a c10d endpoint or without restarts, a rendezvous setting that
    --timeout-s owns, and --serve-lighthouse without its address are refused before anything starts."""
    with pytest.raises(LaunchError, match=message):
        _config(*flags).torchrun_args()


def test_bad_nnodes_ranges_are_refused_by_the_flag_parser(capsys: pytest.CaptureFixture[str]) -> None:
    """--nnodes 3:2 and --nnodes two exit 2 naming the value and the accepted forms."""
    for value in ("3:2", "two"):
        with pytest.raises(SystemExit) as exited:
            cli.build_parser().parse_args(["launch", "--nnodes", value, "train.py"])
        assert exited.value.code == 2
        assert f"'{value}': must be" in capsys.readouterr().err


def test_the_config_key_and_kubeflows_variables_take_a_range(tmp_path: Path) -> None:
    """In a launch config `nnodes: 1:2` is the range (not YAML 1.1's base-60 integer 62), as is
    `min_nnodes: 1` with `nnodes: 2`; both at once is refused. A PyTorchJob's elasticPolicy
    (PET_NNODES=1:3 with PET_RDZV_ENDPOINT, PET_MAX_RESTARTS) is read as launch options."""
    config = launch_config.from_yaml("nnodes: 1:2\nrdzv_endpoint: node0:29400\nmax_restarts: 1\n")
    assert (config.min_nnodes, config.nnodes, config.torchrun_args()[:2]) == (1, 2, ["--nnodes", "1:2"])
    assert launch_config.from_yaml("min_nnodes: 1\nnnodes: 2\n").nnodes_arg == "1:2"
    assert launch_config.from_yaml("master_port: 29500\n").master_port == 29500
    with pytest.raises(LaunchError, match="keep one"):
        launch_config.from_yaml("nnodes: 1:2\nmin_nnodes: 1\n")
    written = launch_config.to_yaml(_config("--nnodes", "1:2", *ENDPOINT))
    assert launch_config.from_yaml(written).nnodes_arg == "1:2"
    environ = {"PET_NNODES": "1:3", "PET_RDZV_ENDPOINT": "job-master-0:23456", "PET_RDZV_BACKEND": "c10d",
               "PET_MAX_RESTARTS": "5", "XDG_CONFIG_HOME": str(tmp_path)}
    resolved = precedence.resolve({}, environ=environ, cwd=tmp_path)
    assert resolved.config.torchrun_args()[:8] == ["--nnodes", "1:3", "--nproc-per-node", "1", "--max-restarts",
                                                  "5", "--rdzv-backend", "c10d"]
    assert resolved.sources["min_nnodes"] == resolved.sources["nnodes"] == "PET_NNODES"


def test_replica_group_options_reach_the_workers() -> None:
    """--replica-group and --lighthouse become ACCELFN_REPLICA_GROUP and TORCHFT_LIGHTHOUSE
    (as torchft's URL) for the workers, listed as set by the launch."""
    env = _config("--replica-group", "1", "--lighthouse", "node0:29510").worker_env()
    assert (env["ACCELFN_REPLICA_GROUP"], env["TORCHFT_LIGHTHOUSE"]) == ("1", "http://node0:29510")
    assert "TORCHFT_LIGHTHOUSE=http://node0:29510" in env["ACCELFN_LAUNCHER_SET"]
    with pytest.raises(LaunchError, match="HOST:PORT"):
        _config("--lighthouse", "node0")


@pytest.mark.multiprocess
@pytest.mark.long
def test_a_node_killed_at_a_random_update_and_started_again(tmp_path: Path, uninterrupted: dict[str, Any]) -> None:
    """Two nodes on loopback (--nnodes 1:2, one process each) train invariant(micro_batches_per_update=4)
    + replicate() with a checkpoint every update. SIGKILL to one node's launcher and worker at an
    update chosen at random: the other restarts its worker at world size 1 from the newest
    checkpoint and trains on, no person involved; the node started again later rejoins (world
    size 2 again). The final state is byte-identical to an uninterrupted one-process run of the
    same global batch, and no resume warns of another program."""
    out = tmp_path / "job"
    out.mkdir()
    port = _launch.free_port()
    args = ("--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic",
            "--max-restarts", "3", "--rdzv-conf", "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3",
            "--backend", "cpu", "--timeout-s", "120")
    progress = out / "progress-None.jsonl"
    kill_at = random.Random().randrange(3, 12)
    with faults.Jobs() as jobs:
        (out / "tick").write_text("0.3")
        node0 = jobs.start(out, *args, script_args=("--checkpoints",))
        faults.wait_for("node 0 to host the rendezvous store", lambda: faults.accepts(port), jobs=(node0,))
        node1 = jobs.start(out, *args, script_args=("--checkpoints",))
        faults.wait_for(f"update {kill_at} on 2 nodes", lambda: any(
            p["world"] == 2 and p["step"] >= kill_at for p in faults.lines(progress)), jobs=(node0, node1))
        killed_after = len(faults.lines(progress))
        faults.kill_node(node1)
        faults.wait_for("two updates on the surviving node", lambda: sum(
            p["world"] == 1 for p in faults.lines(progress)[killed_after:]) >= 2, jobs=(node0,))
        (out / "tick").write_text("3")  # the survivor crawls while the node starts again
        rejoined_after = len(faults.lines(progress))
        node1 = jobs.start(out, *args, script_args=("--checkpoints",))
        faults.wait_for("the restarted node to rejoin", lambda: any(
            p["world"] == 2 for p in faults.lines(progress)[rejoined_after:]), jobs=(node0, node1))
        (out / "tick").write_text("0")
        first, second = (_launch.finish(job) for job in (node0, node1))
    for result in (first, second):
        _launch.assert_ok(result)
    worlds = [p["world"] for p in faults.lines(progress)]
    assert worlds[0] == 2 and 1 in worlds and worlds[-1] == 2, (kill_at, worlds)
    faults.same_run(faults.final(out, None), uninterrupted, world_size=2)
    assert faults.final(out, None)["step"] == 36
    assert "written by a program" not in first.stderr + second.stderr, kill_at
