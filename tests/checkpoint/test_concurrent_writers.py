"""Two processes writing one checkpoint directory at once: the second fails clearly, the first is untouched."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import launch as _launch

pytestmark = pytest.mark.multiprocess
SCRIPT = _launch.WORKERS / "engine_train.py"


def test_a_second_run_writing_the_same_checkpoint_directory_fails_clearly(tmp_path: Path) -> None:
    """While one solo run with Checkpoints(dir) trains, a second started on the same dir exits
    with a CheckpointError saying why; the first completes and every checkpoint
    it left has its manifest, with no temporary folder left over."""
    shared, first, second = tmp_path / "ckpt", tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(first), "--checkpoints", str(shared), "--hold-at", "3"],
                            env=_launch.environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + _launch.DEFAULT_TIMEOUT_S
        while not (first / "held").exists():  # training, holding the directory's write lock
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        refused = _launch.python(SCRIPT, second, "--checkpoints", shared)
        assert refused.returncode != 0
        assert (f"CheckpointError: {shared} is being written by another process" in refused.stderr
                and "two jobs must not write one checkpoint directory at once" in refused.stderr), refused.stderr
    finally:
        (first / "go").touch()
        finished = _launch.finish(proc)
    _launch.assert_ok(finished)
    entries = sorted(p.name for p in shared.iterdir())
    # one process: 10 batches of 3 per epoch, accumulate(2): 5 updates per epoch, saved every 2
    assert entries == [f"step_{s:08d}" for s in range(2, 11, 2)], entries
    assert all((shared / name / "manifest.json").is_file() for name in entries)
