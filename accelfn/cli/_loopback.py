"""What a job on this machine alone listens on: loopback, never every interface.

torch's ``TCPStore`` server listens on every interface (``*:PORT`` in ``ss -ltn``) whatever
address it is given, so a one-machine job started by torchrun would open its rendezvous
store, and its workers' process-group store, to the network. A job whose only node is this
machine needs nothing reachable from elsewhere, so for ``accelfn launch`` and ``af.launch``
with one node (no ``--rdzv-endpoint``; a ``--master-addr``, if any, on loopback):

- the launcher's rendezvous store is a server opened here on ``127.0.0.1`` (on a free port,
  or on ``--master-port`` for a static rendezvous) before torchrun runs; torchrun's own
  store of that port, made in this process, is served by it (a multi-tenant ``TCPStore``);
  without ``--master-port`` torchrun meets there with ``--local-addr 127.0.0.1``, so the
  workers' ``MASTER_ADDR`` is ``127.0.0.1`` too;
- the workers' process-group store, hosted by rank 0 at that ``MASTER_ADDR``, listens on it
  alone (``accelfn/backends/_distributed.py``);
- gloo's own sockets, which listen on the address this machine's host name resolves to, are
  put on the loopback interface: ``GLOO_SOCKET_IFNAME`` for the workers, unless it is set.

Left as torch has them: NCCL's bootstrap sockets (set ``NCCL_SOCKET_IFNAME=lo`` for a CUDA
job on one machine), a ``--rdzv-endpoint`` or ``--master-addr`` the user names, and jobs
of several nodes, whose stores other machines must reach.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from accelfn.cli.config import LaunchConfig
from accelfn.distributed.process_group import is_loopback, store_on_loopback
from accelfn.errors import LaunchError

LOOPBACK = "127.0.0.1"
#: the variable that puts gloo's sockets on a network interface
GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"


def on_this_machine(config: LaunchConfig) -> bool:
    """Whether every node of ``config``'s job is this machine: one node, no
    ``--rdzv-endpoint``, and no ``--master-addr`` but a loopback one."""
    return (config.nnodes == 1 and config.rdzv_endpoint is None
            and (config.master_addr is None or is_loopback(config.master_addr)))


@contextmanager
def rendezvous_store(config: LaunchConfig) -> Iterator[int | None]:
    """The launcher's rendezvous store on loopback, open for the block, for a job on this
    machine: yields its port (a free one, or ``--master-port``); None for other jobs (torch
    makes their store).

    Raises:
        LaunchError: ``--master-port`` is in use on this machine.
    """
    if not on_this_machine(config):
        yield None
        return
    try:
        store = store_on_loopback(config.master_addr or LOOPBACK, config.master_port or 0)
    except LaunchError:
        raise LaunchError(
            f"--master-port {config.master_port} is in use on this machine (another job, or one that has not "
            "exited yet, holds it); on one machine leave --master-port out to let the OS pick a free port, or "
            "give every node another free port"
        ) from None
    try:
        yield store.port
    finally:
        del store  # the server closes with its last TCPStore (torchrun's is gone by now)


def worker_variables(config: LaunchConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` set to the loopback interface for the workers of a job on this
    machine, where ``environ`` does not set it already (and the interface is found)."""
    interface = loopback_interface()
    if not on_this_machine(config) or GLOO_INTERFACE_ENV in environ or interface is None:
        return {}
    return {GLOO_INTERFACE_ENV: interface}


def loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS and the BSDs), or None."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return next((name for name in ("lo", "lo0") if name in names), None)
