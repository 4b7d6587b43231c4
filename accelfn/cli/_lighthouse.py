"""torchft's lighthouse, served by ``accelfn launch --serve-lighthouse`` for the replica groups of
``af.tolerate_faults``: the process that forms each update's quorum of replica groups.

The lighthouse is torchft's own server (``torchft._torchft.LighthouseServer``), run in the
launcher for as long as the launch runs. It keeps no training state: a lighthouse started
again at the same address serves the groups again (their managers retry their quorum
requests), so the launch that serves it is best one that outlives the others, or a
lighthouse of its own (``torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from accelfn.cli.config import LaunchConfig
from accelfn.errors import LaunchError

#: a replica group that requested no quorum this long after the first one did is left out of it
#: (one that is alive but stuck); a dead one is left out when its heartbeats stop
JOIN_TIMEOUT_MS = 10_000
#: a replica group whose manager sent no heartbeat for this long is taken for dead
HEARTBEAT_TIMEOUT_MS = 5_000
#: how often the lighthouse looks whether a quorum can form
QUORUM_TICK_MS = 100


@contextmanager
def served(config: LaunchConfig) -> Iterator[None]:
    """The lighthouse running on ``config.lighthouse``'s port (on every interface, as the other
    replica groups' machines reach it) for the block, where ``config.serve_lighthouse``;
    nothing otherwise. Quorums form from one replica group up (``min_replicas=1``: how few
    groups may apply an update is each group's ``tolerate_faults(min_replicas=...)``).

    Raises:
        LaunchError: torchft is not installed, or the port cannot be bound.
    """
    if not config.serve_lighthouse:
        yield
        return
    assert config.lighthouse is not None, "LaunchConfig.check refuses --serve-lighthouse without --lighthouse"
    os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse logs every quorum at INFO
    try:
        from torchft._torchft import LighthouseServer
    except ImportError:
        raise LaunchError("--serve-lighthouse runs torchft's lighthouse, and torchft is not installed: "
                          "pip install torchft") from None
    port = int(config.lighthouse.rpartition(":")[2])
    try:
        server = LighthouseServer(bind=f"[::]:{port}", min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS,
                                  quorum_tick_ms=QUORUM_TICK_MS, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    except Exception as e:  # noqa: BLE001 (torchft raises its Rust errors as plain exceptions)
        raise LaunchError(f"--serve-lighthouse: the lighthouse cannot listen on port {port}: {e}; choose a free "
                          "port in --lighthouse HOST:PORT") from None
    try:
        yield
    finally:
        server.shutdown()
