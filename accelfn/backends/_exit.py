"""Leaving the default process group at interpreter exit without aborting.

A gloo process group runs its collectives on C++ worker threads. A worker marks a
collective complete, then drops its own references to it; when that drop is the last one,
the work's tensors are freed on the worker thread, which must take the GIL to release their
Python objects. A worker that asks for the GIL after the interpreter began to finalize is
ended by Python in the middle of a C++ destructor, and the process aborts:
``terminate called without an active exception``, exit code -6 (SIGABRT), after a program
that ran to its end (torch issue pytorch/pytorch#117762; ``destroy_process_group`` does not
join the workers: only the group's destructor does, and models such as FSDP2's keep the
group alive). Here it happened in about 1 of 16 two-process runs.

The ranks therefore leave together through an asynchronous barrier whose ``Work`` this
module keeps until exit. Gloo's barrier holds (weakly) every collective still queued or in
progress when it is issued, and frees them only when the barrier itself is freed; a
collective no longer in progress has already been dropped by its worker under the same lock.
Holding the barrier here makes the main thread the last owner of all of them, so nothing is
freed on a worker thread after the barrier returns.
"""

from __future__ import annotations

import atexit
import contextlib
import sys

import torch.distributed as dist

_registered = False
_kept: list[dist.Work] = []  # freed by the main thread as the interpreter finalizes


def leave_at_exit() -> None:
    """Registers (once per process) the exit handler that leaves the default process group."""
    global _registered
    if not _registered:
        atexit.register(leave)
        _registered = True


def leave() -> None:
    """The ranks leave the default process group together, then destroy it (nothing when
    there is none).

    Rank 0 hosts the group's store: a rank that destroys its group and exits while a peer
    still tears its own down can abort that peer at exit, so the ranks meet in a barrier
    first. It is skipped after an unhandled exception, so that a failing rank exits at once
    (torchrun then stops the others) instead of waiting for peers that may be waiting for it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    if getattr(sys, "last_value", None) is None:  # set when an exception ended the program
        with contextlib.suppress(RuntimeError, dist.DistError):  # a peer already gone: no one to wait for
            work = dist.barrier(async_op=True)
            _kept.append(work)
            work.wait()
    dist.destroy_process_group()
