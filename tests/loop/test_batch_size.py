"""``af.find_batch_size``: halving after a real allocator failure, freeing in between, the error at 1."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import accelfn as af
from tests.helpers import launch as _launch

WORKER = _launch.WORKERS / "batch_size_limit.py"


#: the (budget MiB, starting batch size) of each test's case, run in one process in this order: the
#: case at 1 MiB first, right after the uncapped warm-up as in a process of its own (after larger
#: cases, heap space the process still holds mapped from them serves batch size 1)
CASES = ((1, 4), (400, 128), (2000, 64))


@pytest.fixture(scope="module")
def capped() -> dict[tuple[int, int], dict]:
    """What ``tests/workers/batch_size_limit.py`` reports for each of ``CASES``, run one after
    the other in one process, each capped at its budget more MiB of address space than the
    process holds when the case starts."""
    # glibc's mmap threshold fixed at its default 128 KiB (set, it stops adapting): every large
    # allocation is a mapping of its own and so counts against the cap; an adapted threshold
    # (up to 32 MiB after a large block is freed) serves them from heap space already mapped,
    # and batch size 1 then sometimes fits under a 1 MiB cap
    env = {**_launch.environment(), "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    cases = [str(n) for case in CASES for n in ("--case", *case)]
    done = subprocess.run([sys.executable, WORKER, *cases], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    reports = [json.loads(line) for line in done.stdout.splitlines()[-len(CASES):]]
    assert [(r["budget_mib"], r["start"]) for r in reports] == list(CASES)
    return {(r["budget_mib"], r["start"]): r for r in reports}


def test_the_batch_size_halves_until_the_step_fits_freeing_each_failed_attempt(capped) -> None:
    """Under a 400 MiB cap, training at 128 samples (8 MiB each) fails in the CPU allocator;
    each retry halves it, starts after the previous attempt's activations (held in a reference
    cycle) were freed, and the first size that trains is returned."""
    report = capped[400, 128]
    result = report["result"]
    assert 1 < result < 128
    assert report["tried"] == [128 >> i for i in range(len(report["tried"]))]
    assert report["tried"][-1] == result
    assert report["freed"] and all(report["freed"])


def test_a_step_that_fits_runs_once_at_the_starting_batch_size(capped) -> None:
    """With room to spare (a 2000 MiB cap) the first call trains and nothing is retried."""
    assert capped[2000, 64]["tried"] == [64]


def test_running_out_of_memory_at_batch_size_1_is_a_clear_error(capped) -> None:
    """When even batch size 1 does not fit, OutOfMemoryError lists the sizes tried and chains
    the allocator's error."""
    error = capped[1, 4]["error"]
    assert error["message"] == (
        "find_batch_size: even batch size 1 runs out of memory (tried 4, 2, 1); the model and optimizer "
        "state alone do not fit: use a smaller model, a lower precision (af.with_precision('bf16-true')), "
        "or a device with more memory")
    assert error["cause"] == "RuntimeError"
    assert "DefaultCPUAllocator: can't allocate memory" in error["cause_message"]


def test_an_error_other_than_out_of_memory_is_raised_at_once() -> None:
    """A bug in the step (a ValueError) is not retried with a smaller batch."""
    calls = []

    def broken(batch_size: int) -> None:
        calls.append(batch_size)
        raise ValueError("a shape mismatch")

    with pytest.raises(ValueError, match="a shape mismatch"):
        af.find_batch_size(broken, start=32)
    assert calls == [32]


def test_cuda_out_of_memory_errors_are_retried() -> None:
    """torch.OutOfMemoryError, which CUDA's caching allocator raises, halves the batch size too."""
    calls = []

    def fit(batch_size: int) -> int:
        calls.append(batch_size)
        if batch_size > 10:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size * 3

    assert af.find_batch_size(fit, start=48) == 18
    assert calls == [48, 24, 12, 6]


@pytest.mark.parametrize(("fn", "start", "error", "message"), [
    (len, 0, ValueError, r"find_batch_size\(start=0\): must be >= 1"),
    (len, 2.0, TypeError, r"find_batch_size\(start=...\) must be an int, got 2.0"),
    (3, 8, TypeError, r"find_batch_size\(fn, ...\) needs a callable fn\(batch_size\), got int"),
])
def test_bad_arguments_are_refused_before_fn_runs(fn: object, start: object, error: type, message: str) -> None:
    """A non-callable fn or a starting size that is not an int >= 1 raises, naming it."""
    with pytest.raises(error, match=message):
        af.find_batch_size(fn, start=start)  # type: ignore[arg-type]
