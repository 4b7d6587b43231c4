"""Worker for tests/loop/test_count_updates.py: every 2-process case in one launch.

Usage: accelfn launch --nproc-per-node 2 count_updates.py --out DIR
Each rank writes DIR/rank{r}.json: for each case, count_updates' numbers and the updates
run applied per epoch; and the OneCycleLR case's (scheduler steps, total_steps, final lr).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import accelfn as af
from tests.helpers import counting

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args()
backend = af.backends.auto()
results = {counting.case_id(case): counting.counted_and_run(case, backend) for case in counting.SHARDED_CASES}
results["one_cycle"] = counting.one_cycle(backend)
(args.out / f"rank{backend.rank}.json").write_text(json.dumps(results))
