"""Resuming mid-epoch with another number of processes: a warning, and the epoch's unread samples."""

from __future__ import annotations

import importlib.util
import json
import re
import warnings

import pytest

import accelfn as af
from tests.helpers import launch as _launch
from tests.helpers.pool import Pools

_spec = importlib.util.spec_from_file_location("world_resume", _launch.WORKERS / "world_resume.py")
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def _run(**run_args):
    """``worker.job`` on one process: the indices read, the RuntimeWarnings, the final state."""
    step, state, data, read = worker.job()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = af.run(step, state, data, backend=af.backends.CPU(af.backends.LaunchEnv()),
                       **{"progress": False, **run_args})
    return read, [str(w.message) for w in caught if w.category is RuntimeWarning], state


@pytest.mark.multiprocess
def test_another_world_size_resumes_at_the_epochs_unread_samples(pool: Pools, tmp_path, capsys) -> None:
    """A mid-epoch checkpoint of 1 process resumed by 2 (and one of 2 resumed by 1) warns
    once (the main process), naming both world sizes, and reads exactly the samples of the
    epoch the writer had not; one written at an epoch boundary resumes on 2 processes
    without a warning; the progress bar of a resumed run counts to the step it ends at."""
    order, _, _ = _run(epochs=2)  # 1 process, uninterrupted: epoch 0's shuffled order, then epoch 1's
    assert sorted(order[:24]) == sorted(order[24:]) == list(range(24)) and order[:24] != order[24:]
    mid, boundary = af.Checkpoints(tmp_path / "mid", every_steps=4), af.Checkpoints(tmp_path / "end", every_steps=12)
    read, caught, _ = _run(max_steps=4, checkpoints=mid)
    assert read == order[:8] and caught == []
    read, caught, _ = _run(epochs=1, checkpoints=boundary)
    assert read == order[:24] and caught == []
    assert json.loads((boundary.latest() / "manifest.json").read_bytes())["counters"] == {
        "step": 12, "micro_step": 12, "epoch": 1, "epoch_micro_step": 0}

    pool.launch("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60", script="world_resume.py",
                script_args=("--mid", mid.latest(), "--boundary", boundary.latest(), "--out", tmp_path))
    ranks = _launch.read_ranks(tmp_path, 2)
    for rank, record in enumerate(ranks):
        assert record["mid"]["read"] == order[8 + rank:24:2]  # each rank from its 3rd micro-batch (4 * 1 // 2)
        assert record["mid"]["warnings"] == [  # the job's warning, from the main process only
            "the checkpoint was written by 1 process at micro-batch 4 of epoch 0 (of each), and this run has 2 "
            "processes: an exact resume needs the same world size. Continuing at micro-batch 2, which keeps the "
            "number of samples the epoch has consumed (rounded down to whole micro-batches) if the per-process "
            "batch size is the same; the rest of the epoch is batched in another order, so the run differs from an uninterrupted one"
        ][:1 - rank]
        assert record["mid"]["counters"] == [4 + 4, 1, 0]
        assert record["boundary"] == {"read": order[24 + rank::2], "warnings": [], "counters": [12 + 6, 2, 0]}
        assert record["fresh"]["read"] == order[rank:12:2] and record["fresh"]["warnings"] == []

    written = tmp_path / "checkpoints" / "step_00000003"
    assert json.loads((written / "manifest.json").read_bytes())["counters"]["epoch_micro_step"] == 3
    read, caught, state = _run(epochs=1, resume=written)
    assert read == order[12:24]  # the 12 samples the 2 processes had not read, in epoch 0's order
    assert caught == [
        "the checkpoint was written by 2 processes at micro-batch 3 of epoch 0 (of each), and this run has 1 "
        "process: an exact resume needs the same world size. Continuing at micro-batch 6, which keeps the number "
        "of samples the epoch has consumed (rounded down to whole micro-batches) if the per-process batch size "
        "is the same; the rest of the epoch is batched in another order, so the run differs from an "
        "uninterrupted one"]
    assert (state.step, state.epoch, state.epoch_micro_step) == (3 + 6, 1, 0)

    # the progress bar of a 2-epoch run resumed there ends at its total: 3 + (12 - 6) + 12 updates
    capsys.readouterr()
    _, _, state = _run(epochs=2, resume=written, progress=True)
    bars = re.findall(r"(\d+)/(\d+) \[", capsys.readouterr().err)
    assert state.step == 21 and bars[0] == ("3", "21") and bars[-1] == ("21", "21")
