"""Worker for tests/loop/test_async_checkpoints.py: the same 2-process job saving every 2
updates synchronously into OUT/sync and in the background into OUT/async; each rank
writes its final parameters to OUT/rank{r}-{mode}.safetensors and the checkpoints a tracker
on every rank was handed (step, last step logged, complete) to OUT/rank{r}-{mode}-handed.json.
Then the job again, in the
background into OUT/failing, where rank 0's writes fail (a file-size limit set before its
update 2): each rank writes the error run raised to OUT/rank{r}-error.txt.

Usage: accelfn launch --nproc-per-node 2 async_ranks.py OUT
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import accelfn as af
from tests.helpers import programs as P


def _job(loss_fn: object = P.mse) -> tuple[af.Step, torch.utils.data.DataLoader]:
    torch.manual_seed(0)
    step = af.compose(af.shard_data(seed=P.SHARD_SEED), af.replicate(), af.accumulate(2))(af.train_step(loss_fn))
    return step, torch.utils.data.DataLoader(P.regression_data(), batch_size=P.PER_RANK_BATCH, shuffle=True)


class Handed:
    """A tracker on every rank recording each checkpoint it is handed: its step, the last
    step logged then, and whether the checkpoint was complete (its manifest written)."""

    every_rank = True

    def __init__(self) -> None:
        self.last_logged = 0
        self.handed: list[list[Any]] = []

    def log(self, metrics: Any, step: int) -> None:
        self.last_logged = step

    def saved(self, path: Path, step: int) -> None:
        self.handed.append([step, self.last_logged, (path / "manifest.json").is_file()])

    def close(self) -> None:
        pass


def main() -> None:
    out = Path(sys.argv[1])
    backend = af.backends.auto()
    for mode in ("sync", "async"):
        step, loader = _job()
        checkpoints = af.Checkpoints(out / mode, every_steps=2, asynchronous=mode == "async")
        tracker = Handed()
        state = af.run(step, P.make_state(0), loader, backend=backend, epochs=3, checkpoints=checkpoints,
                       progress=False, trackers=[tracker], log_every=1)
        save_file({k: v.contiguous() for k, v in state.model.state_dict().items()},
                  out / f"rank{backend.rank}-{mode}.safetensors")
        (out / f"rank{backend.rank}-{mode}-handed.json").write_text(json.dumps(tracker.handed))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    calls = []

    def failing(model: torch.nn.Module, batch: object) -> torch.Tensor:
        calls.append(1)
        if backend.rank == 0 and len(calls) == 3:  # before update 2, whose checkpoint is the first
            resource.setrlimit(resource.RLIMIT_FSIZE, (100, hard))  # smaller than any tensor file
        return P.mse(model, batch)

    step, loader = _job(failing)
    try:
        af.run(step, P.make_state(0), loader, backend=backend, epochs=3,
               checkpoints=af.Checkpoints(out / "failing", every_steps=2, asynchronous=True), progress=False)
        error = "no error"
    except af.CheckpointError as e:
        error = str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    (out / f"rank{backend.rank}-error.txt").write_text(error)


if __name__ == "__main__":
    main()
