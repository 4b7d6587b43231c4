"""Worker for tests/loop/test_async_checkpoints.py: the same 2-process job saving every 2
updates synchronously into OUT/sync and in the background into OUT/async; each rank
writes its final parameters to OUT/rank{r}-{mode}.safetensors.

Usage: accelfn launch --nproc-per-node 2 async_ranks.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

import accelfn as af
from tests.helpers import programs as P


def main() -> None:
    out = Path(sys.argv[1])
    backend = af.backends.auto()
    for mode in ("sync", "async"):
        torch.manual_seed(0)
        step = af.compose(af.shard_data(seed=P.SHARD_SEED), af.replicate(), af.accumulate(2))(af.train_step(P.mse))
        loader = torch.utils.data.DataLoader(P.regression_data(), batch_size=P.PER_RANK_BATCH, shuffle=True)
        checkpoints = af.Checkpoints(out / mode, every_steps=2, asynchronous=mode == "async")
        state = af.run(step, P.make_state(0), loader, backend=backend, epochs=3, checkpoints=checkpoints,
                       progress=False)
        save_file({k: v.contiguous() for k, v in state.model.state_dict().items()},
                  out / f"rank{backend.rank}-{mode}.safetensors")


if __name__ == "__main__":
    main()
