"""Worker for tests/distributed/test_exit.py: leaving the process group with collectives in flight.

Usage: accelfn launch --nproc-per-node 2 exit_in_flight.py MODE --out DIR

Each rank joins the process group through ``af.backends.auto()``, trains one update of a
model sharded by ``af.shard_params`` and starts an all-reduce of ``torch.ones(1000)``
without waiting for it, rank 1 0.3 s after rank 0. ``exit``: then returns, leaving the
process group to accelfn's exit handler. ``owner``: then calls that handler itself and
writes to ``DIR/rank<R>.json`` how many C++ references the all-reduce's tensor has (its
``_use_count()``) right after, 0.5 s later, and once accelfn lets go of the exit barrier.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

import accelfn as af
from accelfn.distributed import process_group as _exit
from tests.helpers.sharding import build, loader, program


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["exit", "owner"])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    backend = af.backends.auto()
    af.run(program(sharded=True), build(sharded=True), loader(), backend=backend, epochs=1, max_steps=1,
           progress=False)
    if backend.rank == 1:
        time.sleep(0.3)
    tensor = torch.ones(1000)
    dist.all_reduce(tensor, async_op=True)  # never waited for
    if args.mode == "owner":
        _exit.leave()
        counts = {"after_leave": tensor._use_count()}
        time.sleep(0.5)
        counts["later"] = tensor._use_count()
        _exit._kept.clear()
        counts |= {"released": tensor._use_count(), "sum": tensor[0].item(), "initialized": dist.is_initialized()}
        (args.out / f"rank{backend.rank}.json").write_text(json.dumps(counts))


if __name__ == "__main__":
    main()
