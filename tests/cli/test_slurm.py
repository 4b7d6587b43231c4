"""A real one-node Slurm cluster (munged, slurmctld, slurmd on localhost): ``srun`` and the docs'
``sbatch`` script train as ``accelfn launch`` does, and ``scancel`` checkpoints for a resubmission."""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors.torch
import torch

from tests.docs.test_docs import blocks
from tests.helpers import launch as _launch
from tests.helpers import slurm

pytestmark = pytest.mark.multiprocess
SCRIPT = _launch.WORKERS / "engine_train.py"
DOCS_PAGE = _launch.ROOT / "docs" / "12-clusters.md"
WAIT_S = 240


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurm.Cluster]:
    """A started one-node cluster for the session (skipped where Slurm is not installed)."""
    absent = slurm.missing()
    if absent:
        pytest.skip(f"Slurm is not installed ({', '.join(absent)} missing); .ci/run installs slurm-wlm where "
                    "apt-get is available")
    if os.geteuid() != 0:
        pytest.skip("slurmd must run as root to start jobs; run the tests as root (as CI does) to include Slurm")
    started = slurm.Cluster.start(tmp_path_factory.mktemp("slurm"))
    yield started
    started.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The parameters `accelfn launch --nproc-per-node 2 engine_train.py` ends with."""
    out = tmp_path_factory.mktemp("launch")
    _launch.launch("--nproc-per-node", "2", script=SCRIPT, script_args=(out,))
    return safetensors.torch.load_file(out / "params.safetensors")


def job_folder(path: Path) -> tuple[Path, dict[str, str]]:
    """``path`` with the docs' ``submit.sh`` and ``train.py`` (engine_train.py), and the
    environment jobs are submitted from: ``accelfn`` and ``python`` this interpreter and checkout."""
    path.mkdir()
    (submit,) = [b for b in blocks(DOCS_PAGE) if b.option("file") == "submit.sh"]
    (path / "submit.sh").write_text(submit.code)
    shutil.copy(SCRIPT, path / "train.py")
    bin_dir = path / ".bin"
    bin_dir.mkdir()
    for name, line in (("accelfn", f'exec "{sys.executable}" -m accelfn "$@"'), ("python", f'exec "{sys.executable}" "$@"')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{line}\n")
        (bin_dir / name).chmod(0o755)
    return path, _launch.environment(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def assert_equal(out: Path, expected: dict[str, torch.Tensor], what: str) -> None:
    got = safetensors.torch.load_file(out / "params.safetensors")
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), f"{what}: {name} differs from accelfn launch's"


def wait_for(ready, what: str, cluster: slurm.Cluster) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ready():
        assert time.monotonic() < deadline, f"waiting for {what}\n{cluster.logs()}"
        time.sleep(0.2)


def test_srun_tasks_train_as_two_ranks_like_accelfn_launch(cluster: slurm.Cluster, reference: dict,
                                                           tmp_path: Path) -> None:
    """`srun --ntasks=2 python train.py` forms one world of 2 Slurm tasks and ends bitwise equal to accelfn launch."""
    out = tmp_path / "srun"
    out.mkdir()
    result = cluster.run("srun", "--ntasks=2", sys.executable, SCRIPT, out, env=_launch.environment(), timeout_s=WAIT_S)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}\n{cluster.logs()}"
    ranks = _launch.read_ranks(out, 2)
    assert [(r["engine"], r["rank"], r["world_size"], r["local_world_size"]) for r in ranks] == [
        ("slurm", 0, 2, 2), ("slurm", 1, 2, 2)]
    assert_equal(out, reference, "srun")


def test_accelfn_launch_in_the_batch_script_of_a_job_of_several_tasks_forms_its_own_world(
        cluster: slurm.Cluster, reference: dict, tmp_path: Path) -> None:
    """`accelfn launch --nproc-per-node 2` run by the batch script of `sbatch --ntasks=4` (no
    srun: one launcher, not a task of a step) trains its 2 workers as one torchrun world, bitwise
    as outside Slurm, instead of refusing them as "would train alone" for the job's 4 tasks."""
    folder, env = job_folder(tmp_path / "job")
    out = tmp_path / "out"
    out.mkdir()
    done = cluster.run("sbatch", "--wait", "-O", "--ntasks=4", "--chdir", folder, "-o", folder / "batch.out",
                       "--wrap", f"accelfn launch --nproc-per-node 2 train.py {out}", env=env, timeout_s=WAIT_S)
    log = (folder / "batch.out").read_text() if (folder / "batch.out").exists() else ""
    assert done.returncode == 0, f"{done.stderr}\n{log}\n{cluster.logs()}"
    assert [(r["engine"], r["rank"], r["world_size"]) for r in _launch.read_ranks(out, 2)] == [
        ("torchrun", 0, 2), ("torchrun", 1, 2)]
    assert_equal(out, reference, "accelfn launch in an sbatch --ntasks=4 batch script")


def test_a_cancelled_docs_sbatch_job_checkpoints_and_its_resubmission_resumes_bitwise(
        cluster: slurm.Cluster, reference: dict, tmp_path: Path) -> None:
    """The docs' sbatch script (srun accelfn launch), scancel-ed mid-run, saves a checkpoint on
    SIGTERM and exits 143; the script submitted again completes, resumed from it, with
    parameters bitwise equal to an uninterrupted accelfn launch."""
    folder, env = job_folder(tmp_path / "job")
    stopped, checkpoints = tmp_path / "stopped", tmp_path / "ckpt"
    stopped.mkdir()
    submitted = cluster.run("sbatch", "--parsable", "--chdir", folder, "-o", folder / "stopped-%j.out",
                            folder / "submit.sh", stopped, "--checkpoints", checkpoints, "--hold-at", "3", env=env)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    wait_for(lambda: (stopped / "held").exists(), "rank 0 to hold in its third micro-batch", cluster)
    cancelled = cluster.run("scancel", job)
    assert cancelled.returncode == 0, cancelled.stderr
    wait_for(lambda: cluster.state(job) in ("", "COMPLETING", "CANCELLED"), "the job to be cancelled", cluster)
    time.sleep(2)  # the tasks have their SIGTERM; rank 0 goes on to its checkpoint
    (stopped / "go").touch()
    wait_for(lambda: cluster.state(job) == "", "the cancelled job to end", cluster)
    log = "\n".join(p.read_text() for p in folder.glob("stopped-*.out"))
    saved = sorted(p.name for p in checkpoints.iterdir() if (p / "manifest.json").is_file())
    # 2 ranks x 14 samples, batches of 3, accumulate(2): 6 updates; stopped in the second
    assert saved == ["step_00000002"], f"{saved}\n{log}"
    assert "accelfn: SIGTERM received; saved" in log and "task 0: Exited with exit code 143" in log, log
    assert not (stopped / "params.safetensors").exists()

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    again = cluster.run("sbatch", "--wait", "--chdir", folder, "-o", folder / "resumed-%j.out", folder / "submit.sh",
                        resumed, "--checkpoints", checkpoints, env=env, timeout_s=WAIT_S)
    log = "\n".join(p.read_text() for p in folder.glob("resumed-*.out"))
    assert again.returncode == 0, f"{again.stderr}\n{log}\n{cluster.logs()}"
    assert [r["engine"] for r in _launch.read_ranks(resumed, 2)] == ["torchrun", "torchrun"]
    assert_equal(resumed, reference, "resumed after scancel")
