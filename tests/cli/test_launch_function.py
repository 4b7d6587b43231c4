"""``af.launch(fn, *args, nproc_per_node=N)``: a function run in N real worker processes from a
script (spawned) and from a notebook-like ``__main__`` (forked), rank 0's result returned, a
worker's exception raised in the caller."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import accelfn as af
from tests.helpers import launch as _launch
from tests.helpers import launched, sockets
from tests.helpers import programs as P

pytestmark = pytest.mark.multiprocess
DOUBLE = lambda x: 2 * x  # noqa: E731 (a lambda defined in a file: spawned workers cannot import it by name)


@pytest.fixture(scope="module")
def trained() -> dict:
    """af.launch(launched.train) on 2 spawned workers: its result, whether the caller's
    environment is as it was, and the sockets this process listened on before."""
    before = dict(os.environ)
    listening = sockets.listening([os.getpid()]) if sockets.available() else []
    result = af.launch(launched.train, P.PER_RANK_BATCH, nproc_per_node=2, timeout_s=45, start_method="spawn")
    return {**result, "environment_restored": os.environ == before, "listening_before": listening}


def test_a_function_trains_on_two_spawned_processes_and_rank_0s_result_comes_back(trained: dict):
    """2 spawned workers x batch 3 under shard_data + replicate + accumulate + clip equal one
    process with batch 6 (1e-6), as `accelfn launch` does; the workers saw the launch's
    timeout, and the caller's environment is as it was."""
    result = trained
    assert result["environment_restored"]
    assert (result["rank"], result["world_size"], result["timeout_s"]) == (0, 2, "45")
    reference = P.parameters(P.train_case("e2_acc2_clip", af.backends.CPU(af.backends.LaunchEnv()),
                                          2 * P.PER_RANK_BATCH))
    assert result["parameters"].keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(result["parameters"][name], value, rtol=1e-6, atol=1e-6)


def test_the_workers_of_af_launch_and_its_rendezvous_listen_on_loopback_alone(trained: dict):
    """While af.launch's job runs, nothing new in the calling process (torchrun's rendezvous
    store) nor in its workers (the group's store, gloo's sockets) listens outside 127.0.0.0/8."""
    if trained["listening"] is None:
        pytest.skip("reading listening sockets needs Linux's /proc/net/tcp")
    before = {(a, p) for _, a, p in trained["listening_before"]}
    found = [tuple(s) for s in trained["listening"] if (s[1], s[2]) not in before]
    assert sockets.outside_loopback(found) == [], found
    assert {trained["launcher_pid"], trained["rank_pids"][0]} <= {pid for pid, _, _ in found}, found


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
    function defined there runs in the workers and each rank's (rank, world size) comes back;
    one whose result cannot be pickled back raises TypeError naming the function and the type
    (torch's agent alone fails after the return, as if the worker had died without an exception)."""
    code = textwrap.dedent("""
        import threading

        import accelfn as af

        def where():
            backend = af.backends.auto()
            return backend.rank, backend.world_size, backend.reduce(__import__("torch").ones(1), "sum").item()

        def returns_a_lock():
            return threading.Lock()

        print("result", af.launch(where, nproc_per_node=2, timeout_s=60))
        try:
            af.launch(returns_a_lock, nproc_per_node=1, timeout_s=60)
        except TypeError as e:
            print("raised", e)
    """)
    done = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=240,
                          env=_launch.environment(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "result (0, 2, 2.0)" in done.stdout
    assert ("raised launch(...): returns_a_lock returned a _thread.lock that cannot be sent back to the launching "
            "process (TypeError: cannot pickle '_thread.lock' object)") in done.stdout, done.stdout


def test_bad_arguments_are_refused_before_any_process_starts():
    with pytest.raises(TypeError, match="launch\\(fn, ...\\) takes a function, got int"):
        af.launch(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="launch\\(start_method='thread'\\): accepted values are 'spawn', 'fork'"):
        af.launch(launched.loader_length, 4, start_method="thread")
    with pytest.raises(ValueError, match="nproc_per_node=0: must be >= 1"):
        af.launch(launched.loader_length, 4, nproc_per_node=0)


def test_what_spawned_workers_cannot_receive_is_refused_by_name_before_any_starts():
    """A lambda, a nested function, or an argument that cannot be pickled gets a TypeError that
    names it and the fix (not pickle's raw error from inside torch's agent), at once."""
    def nested() -> int:
        return 1

    started = time.monotonic()
    with pytest.raises(TypeError, match=r"launch\(...\): fn \(<lambda>\) cannot be sent to the spawned workers: "
                                        r"PicklingError: .*Define '<lambda>' with `def` at the top level"):
        af.launch(DOUBLE, 3, nproc_per_node=2, start_method="spawn")
    with pytest.raises(TypeError, match=r"fn \(.*nested\) cannot be sent .*start_method=\"fork\""):
        af.launch(nested, start_method="forkserver")
    with pytest.raises(TypeError, match=r"launch\(...\): argument 1 \(lock\) cannot be sent to the spawned "
                                        r"workers: TypeError: cannot pickle '_thread.lock' object"):
        af.launch(launched.loader_length, 4, threading.Lock(), start_method="spawn")
    assert time.monotonic() - started < 5  # no worker was started


def test_a_script_without_a_main_guard_is_refused_instead_of_launching_again_in_every_worker(tmp_path):
    """A script that calls af.launch at its top level (no `if __name__ == "__main__":`) fails with
    a LaunchError saying to add the guard: its spawned worker, importing the script, does not start
    workers of its own, and nothing runs the function or prints its result."""
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent("""
        import accelfn as af

        def world():
            return af.backends.auto().world_size

        print("result", af.launch(world, nproc_per_node=1, timeout_s=60))
    """))
    done = _launch.python(script, cwd=tmp_path)
    assert done.returncode == 1
    assert "result" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last == (f"accelfn.errors.LaunchError: af.launch was called again while a spawned worker was importing "
                    f"{script}: its top level, which calls af.launch, runs in every worker. Put the code that "
                    "starts the workers under `if __name__ == \"__main__\":` (as multiprocessing's spawn start "
                    "method requires), e.g. `if __name__ == \"__main__\": print(af.launch(fn, nproc_per_node=2))`")
