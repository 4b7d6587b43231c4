"""Worker for tests/test_launch.py: joins the world, all-reduces once, records what it sees.

It declares a stray ``--local_rank`` option, as scripts written for the old
``torch.distributed.launch`` do, and parses its arguments strictly: a launcher that passed
anything unexpected would make it fail.

Usage: accelfn launch ... hello.py --out DIR [--tag TEXT] [--trial FILE] [--sockets]

With ``--trial FILE`` it also records the launch config a launch started from this worker
would resolve with ``--config FILE``, where each option came from, and what ``accelfn env
--config FILE`` prints about it. With ``--sockets`` rank 0 also records the TCP sockets its
launcher and every rank listen on (``listening``: ``[pid, address, port]``), while they all
wait in a barrier.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
from pathlib import Path

import torch

import accelfn as af
from tests.helpers import sockets


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tag", default="")
    parser.add_argument("--trial", type=Path)
    parser.add_argument("--sockets", action="store_true")
    args = parser.parse_args()
    backend = af.backends.auto()
    total = backend.reduce(torch.tensor([float(backend.rank + 1)]), "sum").item()
    env = backend.env
    record = {
        "rank": backend.rank, "world_size": backend.world_size, "local_rank": backend.local_rank,
        "local_world_size": backend.local_world_size, "master_port": env.master_port,
        "backend": backend.name, "requested_backend": env.backend, "precision": env.precision,
        "timeout_s": env.timeout_s, "accumulate": env.accumulate, "compile": env.compile,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "stray_local_rank": args.local_rank,
        "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        "tag": args.tag,
        "sum_of_ranks_plus_one": total,
    }
    if args.trial is not None:
        from accelfn.cli import main as cli_main
        from accelfn.cli import precedence

        resolved = precedence.resolve(config_file=args.trial)
        record["nested"] = {"timeout_s": resolved.config.timeout_s, "compile": resolved.config.compile,
                            "accumulate": resolved.config.accumulate, "sources": dict(resolved.sources)}
        report = io.StringIO()
        with contextlib.redirect_stdout(report):
            cli_main(["env", "--config", str(args.trial)])
        record["env_report"] = report.getvalue()
    if args.sockets:
        ranks = backend.gather_object(os.getpid())
        if backend.is_main_process:
            record["launcher_pid"], record["rank_pids"] = os.getppid(), ranks
            record["listening"] = sockets.listening([os.getppid(), *ranks])
        backend.barrier()  # every rank alive until rank 0 has read them
    (args.out / f"rank{backend.rank}.json").write_text(json.dumps(record))
    backend.print(f"hello from a world of {backend.world_size}")


if __name__ == "__main__":
    main()
