"""Worker for tests/test_cuda.py: DDP over NCCL, one GPU per process.

Usage: accelfn launch --backend cuda --nproc-per-node 2 cuda_ddp.py --out DIR
Each rank writes DIR/rank{r}.safetensors with the parameters of two training cases and
the outputs of evaluate.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader

import accelfn as af
from tests.helpers import programs as P


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    backend = af.backends.auto()
    if backend.name != "cuda":
        raise SystemExit(f"expected the CUDA backend, got {backend!r}")
    tensors: dict[str, torch.Tensor] = {}
    for name in ("e2", "e2_acc2_clip"):
        state = P.train_case(name, backend, P.PER_RANK_BATCH)
        tensors.update(P.parameters(state, f"train.{name}."))
    state = P.make_state(seed=7)
    outputs = af.evaluate(P.eval_outputs, state, DataLoader(P.IndexDataset(9), batch_size=5), backend=backend)
    tensors["evaluate.prediction"] = outputs["prediction"].cpu()
    tensors["evaluate.index"] = outputs["index"].cpu()
    save_file({k: v.contiguous() for k, v in tensors.items()}, args.out / f"rank{backend.rank}.safetensors")


if __name__ == "__main__":
    main()
