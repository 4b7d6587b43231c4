"""Worker for tests/distributed/test_hybrid_sharding.py: shard_size="node" on nodes of unequal size.

Usage: accelfn launch --nnodes 2 --node-rank N --nproc-per-node K ... hybrid_nodes.py --out DIR

Each rank prepares a program with ``shard_params(shard_size="node")`` and writes
DIR/rank{r}.json: its LOCAL_WORLD_SIZE and the ValueError prepare raised (or null), and
whether its model was left unsharded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import accelfn as af
from tests.helpers import sharded as S


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    backend = af.backends.auto()
    state = S.make_state("sgd")
    error = None
    try:
        backend.prepare(S.train_program(af.shard_params(shard_size="node")), state)
    except ValueError as e:
        error = str(e)
    result = {"local_world_size": backend.local_world_size, "error": error, "unsharded": type(state.model) is S.Blocks}
    (out / f"rank{backend.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
