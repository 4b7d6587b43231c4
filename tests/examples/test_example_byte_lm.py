"""The byte-level language model example learns from real text and resumes bitwise."""

from __future__ import annotations

import importlib.util
import math
import re
import shutil
import sys

import pytest
import torch

import accelfn as af
from tests.helpers import launch as _launch
from tests.helpers.pool import Pools

EXAMPLE = _launch.ROOT / "examples" / "byte_lm.py"
TINY = dict(context=32, width=32, depth=1, heads=2, batch_size=8, accumulate=2, lr=3e-3, max_steps=30,
            warmup_steps=5, max_bytes=300_000)


@pytest.fixture(scope="module")
def byte_lm():
    spec = importlib.util.spec_from_file_location("byte_lm_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # attrs and pickling look classes up by module name
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_byte_lm_lowers_the_loss_and_a_restarted_run_finishes_bitwise_equal(byte_lm, tmp_path):
    """30 updates lower the held-out loss by over 1 nat per byte from the uniform guess's
    level, and a run that lost its last checkpoint (as if killed after step 20) resumes from
    step 20 and ends with exactly the parameters and optimizer state of the uninterrupted run."""
    config = byte_lm.Config(**TINY)
    state, losses = byte_lm.main(config, run_dir=str(tmp_path / "a"), every_steps=10, progress=False,
                                 sample_bytes=20)
    assert state.step == 30
    assert abs(losses["before"] - math.log(256)) < 0.2  # an untrained model guesses uniformly
    assert losses["after"] < losses["before"] - 1.0

    checkpoints = af.Checkpoints(tmp_path / "a" / "ckpt")
    assert checkpoints.steps() == [20, 30]  # keep=2
    shutil.copytree(tmp_path / "a" / "ckpt", tmp_path / "b" / "ckpt")
    shutil.rmtree(af.Checkpoints(tmp_path / "b" / "ckpt").path_for(30))

    resumed, _ = byte_lm.main(config, run_dir=str(tmp_path / "b"), every_steps=10, progress=False, sample_bytes=0)
    assert resumed.step == 30
    for (name, expected), actual in zip(state.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(actual, expected), name
    for expected, actual in zip(state.optimizer.state.values(), resumed.optimizer.state.values()):
        assert all(torch.equal(actual[k], expected[k]) for k in expected)


def _assert_learned_and_reported_once(stdout: str) -> None:
    """The held-out loss, printed once before and once after 30 updates, fell by over 1
    nat per byte, and one text sample was printed."""
    before = re.findall(r"held-out loss ([0-9.]+) nats/byte before", stdout)
    after = re.findall(r"held-out loss ([0-9.]+) nats/byte \([0-9.]+ bits/byte\) after 30 optimizer updates", stdout)
    assert len(before) == len(after) == 1, stdout[-3000:]
    assert float(after[0]) < float(before[0]) - 1.0
    assert stdout.count("sample:") == 1


@pytest.mark.multiprocess
def test_byte_lm_runs_under_accelfn_launch_with_two_processes(tmp_path, pool: Pools):
    """``accelfn launch --nproc-per-node 2 examples/byte_lm.py`` trains, lowers the held-out
    loss, and prints its report and a text sample once (from the main process). In the worker
    pool: the real launch of an example is tests/cli/test_launch.py's digits test."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    result = pool.launch("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60", script=EXAMPLE,
                         script_args=(*flags, "--run-dir", tmp_path / "run", "--every-steps", "10",
                                      "--sample-bytes", "20"), cwd=tmp_path)
    _assert_learned_and_reported_once(result.stdout)
    assert af.Checkpoints(tmp_path / "run" / "ckpt").steps() == [20, 30]


@pytest.mark.multiprocess
def test_byte_lm_trains_sharded_on_two_processes(tmp_path, pool: Pools):
    """``examples/byte_lm.py --shard`` on 2 processes (shard_params, each of 2 transformer
    blocks one FSDP unit; in the worker pool) lowers
    the held-out loss by over 1 nat per byte and prints its report and a sample once, sampled
    by both ranks (a sharded forward is collective)."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**TINY, "depth": 2}.items()]
    result = pool.launch("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60", script=EXAMPLE,
                         script_args=(*flags, "--shard", "--run-dir", tmp_path / "run", "--every-steps", "0",
                                      "--sample-bytes", "20"), cwd=tmp_path)
    _assert_learned_and_reported_once(result.stdout)


@pytest.mark.multiprocess
def test_byte_lm_trains_pipelined_on_two_processes(tmp_path, pool: Pools):
    """``examples/byte_lm.py --pp 2`` on 2 processes (2 pipeline stages of one block each, 1F1B;
    in the worker pool) lowers the held-out loss of its exported whole model by over 1 nat per
    byte and prints its report and a sample once."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**TINY, "depth": 2}.items()]
    result = pool.launch("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60", script=EXAMPLE,
                         script_args=(*flags, "--pp", "2", "--run-dir", tmp_path / "run", "--every-steps", "0",
                                      "--sample-bytes", "20"), cwd=tmp_path)
    _assert_learned_and_reported_once(result.stdout)
