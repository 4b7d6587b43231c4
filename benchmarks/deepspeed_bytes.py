"""Per-rank bytes per parameter held by each ZeRO stage of ``af.deepspeed`` and by ``shard_params``.

    TORCH_EXTENSIONS_DIR=~/.cache/accelfn/torch_extensions \\
        PYTHONPATH=$PWD python -m accelfn launch --backend cpu --nproc-per-node 2 benchmarks/deepspeed_bytes.py

After one fp32 AdamW update of a stack of 8 blocks of 256 x 256 (528k parameters), each rank
counts the bytes of the tensors it holds for the model: its parameters (whole, or its
partition: DeepSpeed's ``ds_tensor`` at stage 3, FSDP2's local shard), DeepSpeed's fp32
master partitions (a copy of the parameters' values, even in fp32) and the optimizer state
(AdamW's two moments; the step counts are left out). Gradient buffers are left out: they
live in DeepSpeed's own buckets between updates. Rank 0 prints bytes per parameter of the
whole model; 2 processes (W = 2). Timing is not measured here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import accelfn as af
from tests.helpers.sharded import Blocks


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _state(model: torch.nn.Module) -> af.TrainState:
    return af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-3))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g))]


def _moments(optimizer: torch.optim.Optimizer) -> int:
    return _bytes(v.to_local() if hasattr(v, "to_local") else v for s in optimizer.state.values()
                  for k, v in s.items() if k != "step" and isinstance(v, torch.Tensor))


def deepspeed_stage(stage: int, backend: af.backends.Backend) -> tuple[int, dict[str, int]]:
    torch.manual_seed(0)
    model = Blocks(depth=8, width=256)
    total = sum(p.numel() for p in model.parameters())
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    step = af.compose(af.shard_data(), af.deepspeed({"zero_optimization": zero}))(
        af.train_step(lambda m, b: F.mse_loss(m(b[0]), b[1])))
    state = af.run(step, _state(model), _data(), backend=backend, epochs=1, progress=False)
    engine = getattr(state.model, "_accelfn_deepspeed_engine")
    params = [getattr(p, "ds_tensor", p) for p in state.model.parameters()] if stage == 3 else \
        list(state.model.parameters())
    inner = engine.optimizer
    masters = (inner.fp32_partitioned_groups_flat if stage == 3 else inner.single_partition_of_fp32_groups)
    return total, {"params": _bytes(params), "fp32 masters": _bytes(masters), "optimizer": _moments(state.optimizer)}


def sharded(backend: af.backends.Backend) -> tuple[int, dict[str, int]]:
    torch.manual_seed(0)
    model = Blocks(depth=8, width=256)
    total = sum(p.numel() for p in model.parameters())
    step = af.compose(af.shard_data(), af.shard_params())(af.train_step(lambda m, b: F.mse_loss(m(b[0]), b[1])))
    state = af.run(step, _state(model), _data(), backend=backend, epochs=1, progress=False)
    local = [p.to_local() for p in state.model.parameters()]
    return total, {"params": _bytes(local), "fp32 masters": 0, "optimizer": _moments(state.optimizer)}


def main() -> None:
    backend = af.backends.CPU()
    rows = [(f"deepspeed ZeRO-{s}", *deepspeed_stage(s, backend)) for s in (1, 2, 3)]
    rows.append(("shard_params (FSDP2)", *sharded(backend)))
    if backend.is_main_process:
        print(f"{'engine':24} {'params':>8} {'masters':>8} {'optimizer':>10} {'total':>8}  (bytes per parameter, "
              f"rank 0 of {backend.world_size})")
        for name, total, parts in rows:
            per = {k: v / total for k, v in parts.items()}
            print(f"{name:24} {per['params']:8.2f} {per['fp32 masters']:8.2f} {per['optimizer']:10.2f} "
                  f"{sum(per.values()):8.2f}")


if __name__ == "__main__":
    main()
