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

Leaving alone: a rank whose program ended by an exception, or whose last ``af.run`` or
``af.evaluate`` ended by one or by an exit (``sys.exit`` in a hook, ``SystemExit``,
``KeyboardInterrupt``) on that rank only, must not wait in the exit barrier: the other ranks
are waiting in their next collective, which the barrier never pairs with, and the job would
end only at the collective timeout. Such a rank leaves at once (printing which rank, and
how it ended), and the others' collectives fail as its connections close, or the launcher
stops them. Ranks that leave together (the same ``sys.exit`` on every rank, a preemption's
exit) find one another's marks in the store within ``TOGETHER_S`` and meet in the barrier.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import ipaddress
import socket
import sys
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from accelfn.distributed import ops
from accelfn.distributed.env import LaunchEnv
from accelfn.errors import LaunchError

_registered = False
_kept: list[dist.Work] = []  # freed by the main thread as the interpreter finalizes
#: how this rank's last ``af.run``/``af.evaluate`` ended, when not by returning (None: it returned)
_ended_by: str | None = None
#: seconds a rank that ended alone waits for the others' marks before leaving without them
TOGETHER_S = 2.0


def leave_at_exit() -> None:
    """Registers (once per process) the exit handler that leaves the default process group."""
    global _registered
    if not _registered:
        atexit.register(leave)
        _registered = True


@contextlib.contextmanager
def user_code(what: str) -> Iterator[None]:
    """Notes how ``what`` (``"af.run"``, ``"af.evaluate"``: a call that runs the user's code on
    every rank) ends on this rank: by returning, or by an exception or exit that the exit
    handler must not wait for the other ranks after (see the module's docstring)."""
    global _ended_by
    try:
        yield
    except BaseException as e:  # an exit every rank agreed on (a preemption's, ``agreed``) is no divergence
        _ended_by = None if getattr(e, "agreed", False) else f"{what} ended by {_exit_of(e)}"
        raise
    _ended_by = None


def _exit_of(error: BaseException) -> str:
    if isinstance(error, SystemExit):
        code = error.code
        status = 0 if code is None else code if isinstance(code, int) else 1
        return f"SystemExit({code!r}) (sys.exit, exit status {status})"
    return f"{type(error).__name__}({str(error)[:200]!r})"


def leave() -> None:
    """The ranks leave the default process group together, then destroy it (nothing when
    there is none).

    Rank 0 hosts the group's store: a rank that destroys its group and exits while a peer
    still tears its own down can abort that peer at exit, so the ranks meet in a barrier
    first. It is skipped after an unhandled exception, so that a failing rank exits at once
    (torchrun then stops the others) instead of waiting for peers that may be waiting for it,
    and after an ``af.run``/``af.evaluate`` that ended by an exception or an exit
    (``SystemExit``, ``KeyboardInterrupt``) unless every rank reaches this handler within
    ``TOGETHER_S`` seconds (they all stopped together).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    if getattr(sys, "last_value", None) is None and _all_leaving():  # last_value: an exception ended the program
        with contextlib.suppress(RuntimeError, dist.DistError):  # a peer already gone: no one to wait for
            work = dist.barrier(async_op=True)
            _kept.append(work)
            work.wait()
    dist.destroy_process_group()


def _all_leaving() -> bool:
    """Marks this rank's arrival at the exit handler in the group's store; True unless this
    rank's last ``af.run``/``af.evaluate`` ended by an exception or exit and some rank has not
    arrived within ``TOGETHER_S`` (then a message names this rank, how it ended and the
    missing ranks)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ended_by = _ended_by
    try:  # torch's own accessor (private, stable since 1.x), as distributed.arrive uses
        store = dist.PrefixStore("accelfn/leave/", dist.distributed_c10d._get_default_store())
        store.set(str(rank), ended_by or "end")
        if ended_by is None:
            return True
        marks = [str(r) for r in range(world_size)]
        deadline = time.monotonic() + TOGETHER_S
        while not store.check(marks):  # polled: Store.wait logs a warning at its timeout
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        else:
            return True
        missing = ", ".join(m for m in marks if not store.check([m]))
    except (AttributeError, RuntimeError, ValueError, dist.DistError):  # no store, or its host (rank 0) is gone
        if ended_by is None:
            return True
        missing = "0" if rank else "?"
    print(f"accelfn: rank {rank} of {world_size}: {ended_by} on this rank, while rank(s) {missing} went on; "
          "leaving without waiting for them (their next collective fails, or the launcher stops them). To "
          "end a job from one rank, return af.Stop(reason) from a hook instead: `run` then stops every rank "
          "at the same update", file=sys.stderr, flush=True)
    return False


def init_process_group(env: LaunchEnv, backend: str, device: torch.device | None = None) -> None:
    """Joins the default process group of ``env``'s world (nothing for one process).

    The group has a finite timeout (``env.timeout_s``), so a rank that never arrives makes
    the others fail with an error instead of waiting forever. With
    ``env.debug_collectives`` every collective of ``accelfn.collectives`` is checked across
    ranks first (``ops.set_debug``) and torch's debug level is DETAIL, so the group is made
    with torch's collective checks (``TORCH_DISTRIBUTED_DEBUG=DETAIL``).

    Raises:
        LaunchError: a group already exists with another world size or rank, or the other
            ranks did not all arrive at ``MASTER_ADDR:MASTER_PORT`` within ``env.timeout_s``.
    """
    if env.world_size == 1:
        return
    if env.debug_collectives:  # each collective checked across ranks; torch's DETAIL wraps the group made below
        ops.set_debug(True)
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    if dist.is_initialized():
        if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
            raise LaunchError(
                f"a process group already exists with world size {dist.get_world_size()} and "
                f"rank {dist.get_rank()}, but the launch environment says {env.world_size} and {env.rank}"
            )
        leave_at_exit()  # a group the script made: accelfn's collectives still run on its workers
        return
    try:
        store = _store_on_this_machine(env)
        dist.init_process_group(
            backend=backend,
            init_method=None if store is not None else _init_method(env),
            store=store,
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


def _store_on_this_machine(env: LaunchEnv) -> dist.Store | None:
    """The group's store where its address is a loopback address (every rank is on this
    machine: ``accelfn launch`` on one node, ``af.launch``, mpirun on one node): rank 0's
    server listens on that address alone, the others connect to it. None where torch's own
    rendezvous makes it (another machine must reach it, or torchrun's agent hosts it).

    Raises:
        LaunchError: ``MASTER_PORT`` is in use on this machine.
    """
    if env.agent_store or env.master_port is None or not is_loopback(env.master_addr):
        return None
    assert env.master_addr is not None  # is_loopback
    timeout = datetime.timedelta(seconds=env.timeout_s)
    if env.rank != 0:
        return dist.TCPStore(env.master_addr, env.master_port, env.world_size, False, timeout)
    return store_on_loopback(env.master_addr, env.master_port, world_size=env.world_size, timeout=timeout)


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` is written as an IPv4 loopback address (127.0.0.0/8): what listens
    there is reached from this machine alone."""
    try:
        return ipaddress.IPv4Address(host or "").is_loopback
    except ValueError:
        return False


def store_on_loopback(host: str, port: int, *, world_size: int | None = None,
                      timeout: datetime.timedelta = datetime.timedelta(seconds=300)) -> dist.TCPStore:
    """A ``TCPStore`` server listening on ``host:port`` alone (``port`` 0: a free port, read
    back from ``.port``), for a loopback ``host``. TCPStore's own server binds its socket to
    every interface whatever its host (torch 2.13: ``*:PORT`` in ``ss -ltn``), so the socket
    is bound here and handed to it (``master_listen_fd``). The server is multi-tenant: a
    ``TCPStore(host, port, is_master=True, multi_tenant=True)`` made later in this process
    (torchrun's rendezvous) is served by it.

    Raises:
        LaunchError: ``port`` is in use on this machine.
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's own (TIME_WAIT)
        listener.bind((host, port))
        listener.listen(socket.SOMAXCONN)
    except OSError as e:
        listener.close()
        raise LaunchError(f"cannot listen on {host}:{port} for a store of this job: {e.strerror} (another job, or "
                          "one that has not exited yet, holds the port)") from None
    return dist.TCPStore(host, listener.getsockname()[1], world_size, True, timeout, multi_tenant=True,
                         master_listen_fd=listener.detach())


def _init_method(env: LaunchEnv) -> str:
    """torchrun's variables (``env://``, which also joins torchrun's own store when it shares
    one); another engine's rendezvous address as ``tcp://HOST:PORT`` (its rank 0 hosts the
    store there), so nothing is written to the environment."""
    if env.env_rendezvous:
        return "env://"
    host = f"[{env.master_addr}]" if env.master_addr and ":" in env.master_addr else env.master_addr
    return f"tcp://{host}:{env.master_port}"
