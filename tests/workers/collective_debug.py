"""Worker for tests/backends/test_collective_debug.py: collectives that differ across ranks.

Usage: accelfn launch --nproc-per-node 2 --timeout-s 120 collective_debug.py OUT
(with ``ACCELFN_DEBUG_COLLECTIVES=1``, or without it). Each rank writes OUT/rank{r}.json:
whether the check is on and torch's debug level; with it on, for each mismatched case
(shapes, reduce ops, functions) the error raised and the seconds it took, then a matching
reduce's result (the group still works); in both modes the collectives of the default
group that 5 matching reduces make (its sequence number).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import accelfn as af
from accelfn.distributed import ops


def _timed(call: Callable[[], Any]) -> dict[str, Any]:
    start = time.monotonic()
    try:
        call()
        outcome: dict[str, Any] = {"error": None}
    except ValueError as e:
        outcome = {"error": str(e)}
    return {**outcome, "seconds": time.monotonic() - start}


def main() -> None:
    out = Path(sys.argv[1])
    backend = af.backends.CPU()
    r = backend.rank
    result: dict[str, Any] = {"debugging": ops.debugging(), "torch_debug": str(dist.get_debug_level())}
    if ops.debugging():
        result["shape"] = _timed(lambda: backend.reduce(torch.ones(3 if r == 0 else 5), "sum"))
        result["op"] = _timed(lambda: backend.reduce(torch.ones(3), "sum" if r == 0 else "max"))
        result["call"] = _timed(lambda: backend.broadcast(torch.ones(3)) if r == 0 else backend.reduce(torch.ones(3)))
        result["after"] = backend.reduce(torch.full((2,), r + 1.0), "sum").tolist()
    group = dist.distributed_c10d._get_default_group()
    before = group._get_sequence_number_for_group()
    for _ in range(5):
        backend.reduce(torch.ones(4), "sum")
    result["collectives_per_5_reduces"] = group._get_sequence_number_for_group() - before
    (out / f"rank{r}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
