"""Worker for tests/backends/test_eval_batches.py: an evaluation loop of one's own on 2 ranks.

Usage: accelfn launch --nproc-per-node 2 eval_batches.py --out DIR
Each rank writes DIR/rank{r}.json: the samples ``eval_batches`` gave it, batch by batch,
and what ``gather_for_metrics`` returned for ten times each batch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import accelfn as af


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    backend = af.backends.auto()
    seen, gathered = [], []
    for batch in backend.eval_batches(DataLoader(torch.arange(11), batch_size=4)):
        seen.append(batch.tolist())
        gathered.append(backend.gather_for_metrics(batch * 10).tolist())
    (args.out / f"rank{backend.rank}.json").write_text(json.dumps({"seen": seen, "gathered": gathered}))


if __name__ == "__main__":
    main()
