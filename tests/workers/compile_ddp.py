"""Worker for tests/transforms/test_compile.py: ``compile`` after DDP on 2 processes.

Trains the MLP with ``shard_data + replicate + accumulate(2) + clip`` and ``af.compile``,
and writes rank 0's parameters and whether the model the forward called was DDP inside
an OptimizedModule.

Usage: accelfn launch --nproc-per-node 2 compile_ddp.py --out DIR --backend-name NAME
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils.data import DataLoader

import accelfn as af
from tests.helpers.models import classification_data, make_mlp


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--backend-name", required=True)
    args = parser.parse_args()
    backend = af.backends.auto()
    model = make_mlp()
    state = af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    program = af.compose(af.shard_data(), af.replicate(), af.accumulate(2), af.clip(0.5),
                         af.compile(backend=args.backend_name))(af.train_step(loss_fn))
    state, step_fn = backend.prepare(program, state)
    called = step_fn._model  # noqa: SLF001 (what the forward calls)
    layers = [type(called).__name__, type(called._orig_mod).__name__]  # noqa: SLF001
    state = af.run(program, state, DataLoader(classification_data(), batch_size=2), backend=backend, epochs=2,
                   progress=False)
    if backend.is_main_process:
        save_file({name: p.detach().contiguous() for name, p in state.model.named_parameters()},
                  str(args.out / "params.safetensors"))
        (args.out / "rank0.json").write_text(json.dumps({"layers": layers, "step": state.step}))


if __name__ == "__main__":
    main()
