"""``af.launch(fn, *args, nproc_per_node=N)``: a function run in N real worker processes from a
script (spawned) and from a notebook-like ``__main__`` (forked), rank 0's result returned, a
worker's exception raised in the caller."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import accelfn as af
from tests.helpers import launch as _launch
from tests.helpers import launched
from tests.helpers import programs as P

pytestmark = pytest.mark.multiprocess


def test_a_function_trains_on_two_spawned_processes_and_rank_0s_result_comes_back():
    """2 spawned workers x batch 3 under shard_data + replicate + accumulate + clip equal one
    process with batch 6 (1e-6), as `accelfn launch` does; the workers saw the launch's
    timeout, and the caller's environment is as it was."""
    before = dict(__import__("os").environ)
    result = af.launch(launched.train, P.PER_RANK_BATCH, nproc_per_node=2, timeout_s=45, start_method="spawn")
    assert __import__("os").environ == before
    assert (result["rank"], result["world_size"], result["timeout_s"]) == (0, 2, "45")
    reference = P.parameters(P.train_case("e2_acc2_clip", af.backends.CPU(af.backends.LaunchEnv()),
                                          2 * P.PER_RANK_BATCH))
    assert result["parameters"].keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(result["parameters"][name], value, rtol=1e-6, atol=1e-6)


def test_a_workers_exception_is_raised_in_the_caller_with_its_rank():
    """Rank 1 raises KeyError while rank 0 waits in a collective: the agent stops rank 0, and
    af.launch raises rank 1's KeyError, whose note names the rank and holds its traceback."""
    with pytest.raises(KeyError, match="no such key on rank 1") as raised:
        af.launch(launched.fail_on_rank, 1, nproc_per_node=2, timeout_s=60)
    (note,) = raised.value.__notes__
    assert note.startswith("raised in af.launch's worker of rank 1:\nTraceback") and "fail_on_rank" in note


def test_an_exception_that_cannot_be_rebuilt_comes_back_as_its_traceback():
    """Nothing is unpickled: an exception is rebuilt from its class and JSON arguments, and one
    whose argument is no JSON value is a LaunchError naming its class and holding its traceback."""
    with pytest.raises(af.LaunchError, match=r"(?s)launch: rank 0 raised builtins.ValueError, which cannot be "
                                             r"raised here again.*ValueError: <opaque>"):
        af.launch(launched.fail_with_opaque_argument, nproc_per_node=1, timeout_s=60)


def test_from_a_notebook_the_workers_are_forked_and_run_functions_defined_there(tmp_path):
    """A `__main__` without a file (a notebook, python reading stdin): launch forks, so a
    function defined there runs in the workers; each rank's (rank, world size) comes back."""
    code = textwrap.dedent("""
        import accelfn as af

        def where():
            backend = af.backends.auto()
            return backend.rank, backend.world_size, backend.reduce(__import__("torch").ones(1), "sum").item()

        print("result", af.launch(where, nproc_per_node=2, timeout_s=60))
    """)
    done = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=240,
                          env=_launch.environment(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "result (0, 2, 2.0)" in done.stdout


def test_bad_arguments_are_refused_before_any_process_starts():
    with pytest.raises(TypeError, match="launch\\(fn, ...\\) takes a function, got int"):
        af.launch(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="launch\\(start_method='thread'\\): accepted values are 'spawn', 'fork'"):
        af.launch(launched.loader_length, 4, start_method="thread")
    with pytest.raises(ValueError, match="nproc_per_node=0: must be >= 1"):
        af.launch(launched.loader_length, 4, nproc_per_node=0)
