"""Worker for tests/backends/test_cuda.py: shard_params on the CUDA backend (FSDP2 over NCCL).

Usage: accelfn launch --backend cuda --nproc-per-node N cuda_shard.py --out DIR [--offload]
With N GPUs each rank reads 6 / N samples per micro-batch, so every N trains the program
of tests/helpers/sharded.py on windows of 12 samples. Each rank writes
DIR/rank{r}.safetensors (gathered parameters, evaluate outputs) and DIR/rank{r}.json (where
the shards and the optimizer state live, the logged grad_norm, the bf16 losses).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader

import accelfn as af
from tests.helpers import programs as P
from tests.helpers import sharded as S


class Record:
    """A tracker that keeps every logged grad_norm (the loop logs on the main process)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def log(self, metrics: Any, step: int) -> None:
        self.norms.append(float(metrics["grad_norm"]))

    def close(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--offload", action="store_true")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    backend = af.backends.auto()
    if backend.name != "cuda":
        raise SystemExit(f"expected the CUDA backend, got {backend!r}")
    shard = af.shard_params(offload=args.offload)
    tensors: dict[str, torch.Tensor] = {}
    results: dict[str, Any] = {}
    for name in S.OPTIMIZERS:
        step = af.compose(af.shard_data(seed=P.SHARD_SEED), shard, af.accumulate(2), af.clip(S.CLIP))(
            af.train_step(P.mse))
        record = Record()
        state = af.run(step, S.make_state(name), S.loader(6 // backend.world_size), backend=backend,
                       epochs=S.EPOCHS, progress=False, trackers=[record])
        tensors.update(S.full_parameters(state.model, f"train.{name}."))
        params = [p for group in state.optimizer.param_groups for p in group["params"]]
        results[name] = {
            "grad_norms": record.norms,
            "param_types": sorted({type(p.data).__name__ for p in params}),
            "shard_devices": sorted({p.to_local().device.type for p in params}),
            "moment_devices": sorted({v.to_local().device.type for s in state.optimizer.state.values()
                                      for k, v in s.items() if k != "step"}),
        }
        if name == "adamw":
            outputs = af.evaluate(P.eval_outputs, state, DataLoader(P.IndexDataset(9), batch_size=2), backend=backend)
            tensors["evaluate.prediction"] = outputs["prediction"]
            tensors["evaluate.index"] = outputs["index"]
    step = af.compose(shard, af.with_precision("bf16"))(af.train_step(P.mse))
    state, step_fn = backend.prepare(step, S.make_state("adamw"))
    losses = []
    for _ in range(3):
        for batch in S.learnable(seed=5 + backend.rank):
            state, metrics = step_fn(state, backend.place(batch))
            losses.append(float(metrics["loss"]))
    results["bf16_losses"] = losses
    (args.out / f"rank{backend.rank}.json").write_text(json.dumps(results))
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
              args.out / f"rank{backend.rank}.safetensors")


if __name__ == "__main__":
    main()
