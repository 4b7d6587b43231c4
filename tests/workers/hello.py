"""Worker for tests/test_launch.py: joins the world, all-reduces once, records what it sees.

It declares a stray ``--local_rank`` option, as scripts written for the old
``torch.distributed.launch`` do, and parses its arguments strictly: a launcher that passed
anything unexpected would make it fail.

Usage: accelfn launch ... hello.py --out DIR [--tag TEXT]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

import accelfn as af


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tag", default="")
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
        "tag": args.tag,
        "sum_of_ranks_plus_one": total,
    }
    (args.out / f"rank{backend.rank}.json").write_text(json.dumps(record))
    backend.print(f"hello from a world of {backend.world_size}")


if __name__ == "__main__":
    main()
