"""What the CPU (gloo) and CUDA (NCCL) backends share of ``torch.distributed``: joining the
process group, leaving it at exit without aborting, and DDP.

Leaving at exit: a gloo process group runs its collectives on C++ worker threads. A worker
marks a collective complete, then drops its own references to it; when that drop is the last one,
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
import datetime
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from accelfn.backends.env import LaunchEnv
from accelfn.errors import LaunchError
from accelfn.transforms import Replicate

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


def init_process_group(env: LaunchEnv, backend: str, device: torch.device | None = None) -> None:
    """Joins the default process group of ``env``'s world (nothing for one process).

    The group has a finite timeout (``env.timeout_s``), so a rank that never arrives makes
    the others fail with an error instead of waiting forever.

    Raises:
        LaunchError: a group already exists with another world size or rank, or the other
            ranks did not all arrive at ``MASTER_ADDR:MASTER_PORT`` within ``env.timeout_s``.
    """
    if env.world_size == 1:
        return
    if dist.is_initialized():
        if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
            raise LaunchError(
                f"a process group already exists with world size {dist.get_world_size()} and "
                f"rank {dist.get_rank()}, but the launch environment says {env.world_size} and {env.rank}"
            )
        leave_at_exit()  # a group the script made: accelfn's collectives still run on its workers
        return
    try:
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(seconds=env.timeout_s),
            device_id=device if device is not None and device.type == "cuda" else None,
        )
    except dist.DistError as e:
        raise LaunchError(
            f"rank {env.rank} of WORLD_SIZE={env.world_size} could not form the {backend} process "
            f"group at {env.master_addr}:{env.master_port} within {env.timeout_s:g} s ({e}); start "
            "all ranks together with `accelfn launch`, and check that MASTER_ADDR is reachable "
            "from every node"
        ) from e
    leave_at_exit()


def wrap_ddp(model: torch.nn.Module, replicate: Replicate, world_size: int,
             device_ids: list[int] | None = None) -> torch.nn.Module:
    """``model`` in ``DistributedDataParallel`` with ``replicate``'s options (one process: as is).

    DDP broadcasts rank 0's parameters and buffers at construction, so replicas start equal.
    """
    if world_size == 1:
        return model
    return DistributedDataParallel(
        model,
        device_ids=device_ids,
        bucket_cap_mb=replicate.bucket_cap_mb,
        find_unused_parameters=replicate.find_unused_parameters,
        static_graph=replicate.static_graph,
        gradient_as_bucket_view=replicate.gradient_as_bucket_view,
    )
