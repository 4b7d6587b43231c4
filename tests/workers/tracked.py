"""Worker for tests/tracking/test_services.py and tests/loop/test_hooks.py: one launch of 2
processes runs a tracked job three ways.

Usage: accelfn launch --nproc-per-node 2 tracked.py --out DIR

1. ``whole``: an uninterrupted run with a per-epoch evaluation hook, ``config``, and the
   trackers JSONL, MLflow (SQLite store under DIR/mlflow) and W&B (offline, under DIR).
2. ``crashed``: the same job, whose loss function raises at micro-batch CRASH_AT on every
   rank (after the checkpoint of step CHECKPOINT_EVERY), then ``resumed``: a fresh state
   resumed with ``resume="auto"`` from that checkpoint, each attempt with its own JSONL.

Each rank writes DIR/rank{r}.json: the final parameters of ``whole`` and ``resumed``, the
ids of the MLflow and W&B runs (rank 0). Then an ``af.Loss`` run whose ranks count other
numbers of items logs to DIR/items.jsonl, with a profiler trace of every rank in DIR/profile;
and a run whose hook asks to stop on rank 1 only records the step each rank stopped at.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

import accelfn as af
from tests.helpers import hooked
from tests.helpers import programs as P

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args()
backend = af.backends.auto()
result: dict[str, Any] = {}

mlflow = af.MLflow(args.out / "mlflow", experiment="tracked")
wandb = af.WandB("tracked", dir=args.out, mode="offline")
state = hooked.train(backend, hooked.PER_RANK_BATCH, trackers=[af.JSONL(args.out / "whole.jsonl"), mlflow, wandb],
                     config=hooked.CONFIG)
result["whole"] = hooked.flat_parameters(state)
result["mlflow_run_id"], result["wandb_run_id"] = mlflow.run_id, wandb.run_id

checkpoints = af.Checkpoints(args.out / "ckpt", every_steps=hooked.CHECKPOINT_EVERY)
try:
    hooked.train(backend, hooked.PER_RANK_BATCH, trackers=[af.JSONL(args.out / "crashed.jsonl")],
                 checkpoints=checkpoints, crash_at=hooked.CRASH_AT)
except hooked.Crash:
    result["crashed"] = True
state = hooked.train(backend, hooked.PER_RANK_BATCH, trackers=[af.JSONL(args.out / "resumed.jsonl")],
                     checkpoints=checkpoints, resume="auto")
result["resumed"] = hooked.flat_parameters(state)

# af.Loss with other item counts on each rank, logged every update; every rank profiled
af.run(af.replicate()(af.train_step(P.summed_mse)), P.make_state(), P.rank_token_batches(backend.rank),
       backend=backend, progress=False, trackers=[af.JSONL(args.out / "items.jsonl")],
       profile=af.Profile(args.out / "profile", wait=0, warmup=1, active=1, all_ranks=True))

# a stop asked by rank 1's hook alone, at step 4, stops both ranks there
only_rank_1 = af.Hook(lambda s, b: af.Stop("rank 1 asked") if b.rank == 1 and s.step == 4 else None, every_steps=2)
state = af.run(af.compose(af.shard_data(), af.replicate())(af.train_step(P.mse)), P.make_state(),
               torch.utils.data.DataLoader(P.regression_data(), batch_size=2), backend=backend, epochs=3,
               progress=False, hooks=[only_rank_1])
result["stopped_at"] = state.step
(args.out / f"rank{backend.rank}.json").write_text(json.dumps(result))
torch.distributed.barrier()
