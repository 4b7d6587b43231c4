"""Running torchrun (``torch.distributed.run``) in the ``accelfn launch`` process, and its
outcomes as exit statuses and messages instead of tracebacks."""

from __future__ import annotations

import signal
import sys

from accelfn.cli.config import LaunchConfig
from accelfn.errors import LaunchError


def run_torchrun(torchrun_args: list[str], config: LaunchConfig) -> int:
    """Runs torchrun with ``torchrun_args`` in this process; its outcome as an exit status:
    0, the first failed worker's exit code, 128 + N after signal N, 1 when the rendezvous
    did not complete within ``config.timeout_s``.

    Raises:
        LaunchError: ``--master-port`` is in use on node 0.
    """
    from torch.distributed import DistError, DistNetworkError
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    try:
        torchrun.main(torchrun_args)
    except ChildFailedError as e:
        codes = [failure.exitcode for failure in e.failures.values() if failure.exitcode]
        return codes[0] if codes and codes[0] > 0 else 1
    except SignalException as e:
        return _interrupted(int(e.sigval), "forwarded to the workers, which have exited")
    except KeyboardInterrupt:  # SIGINT before torchrun's handlers were in place
        return _interrupted(signal.SIGINT, "no worker had started")
    except DistNetworkError as e:
        if "EADDRINUSE" not in str(e) or config.master_port is None:
            return _rendezvous_failed(e, config)
        raise LaunchError(
            f"--master-port {config.master_port} is in use on this machine (another job, or one that has not "
            "exited yet, holds it); on one machine leave --master-port out to let the OS pick a free port, or "
            "give every node another free port"
        ) from None
    except (DistError, RendezvousError) as e:
        return _rendezvous_failed(e, config)
    return 0


def _rendezvous_failed(error: Exception, config: LaunchConfig) -> int:
    """Exit status 1, announced: the nodes did not all join the rendezvous within the timeout."""
    if config.rdzv_endpoint is not None:
        where = f"the rendezvous at {config.rdzv_endpoint}"
    elif config.master_port is not None:
        where = f"the rendezvous at {config.master_addr or '127.0.0.1'}:{config.master_port}"
    else:
        where = "the local rendezvous"
    reason = str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else "no reason given"
    nodes = f"{config.nnodes} node{'s' if config.nnodes > 1 else ''}"
    print(f"accelfn launch: error: {where} of {nodes} did not complete within {config.timeout_s:g} s "
          f"(--timeout-s, ACCELFN_TIMEOUT_S): {type(error).__name__}: {reason}. Start `accelfn launch` on every "
          "node within that time, with the same --nnodes and node 0's address, and check that node 0 is "
          "reachable from every node", file=sys.stderr, flush=True)
    return 1


def _interrupted(signum: int, workers: str) -> int:
    """The shell's status for death by signal ``signum`` (128 + its number), announced: a
    scheduler that requeues preempted jobs tells it from a failure (exit status 1)."""
    print(f"accelfn launch: {signal.Signals(signum).name} received, {workers}; exiting with status "
          f"{128 + signum}", file=sys.stderr, flush=True)
    return 128 + signum
