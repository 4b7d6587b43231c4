"""What ``run``'s plan check costs next to a first update: ``check_before_run`` (the plan without
its trace) of the byte LM example's program, against the time of its first optimizer update
(accumulate(2) micro-batches of 16 x 128 bytes, bf16 autocast, on the CPU).

Usage: python benchmarks/plan_in_run.py   (prints one JSON line)
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import accelfn as af
from accelfn.loop.planning.report import check_before_run

ROOT = Path(__file__).resolve().parents[1]


def main() -> dict[str, float]:
    spec = importlib.util.spec_from_file_location("byte_lm", ROOT / "examples" / "byte_lm.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    config = example.Config()
    torch.manual_seed(0)
    model = example.ByteLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.1)
    state = af.TrainState.create(model, optimizer,
                                 scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, example.warmup_cosine(config)))
    ids = torch.randint(0, 256, (4096, config.context + 1))
    loader = DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=config.batch_size, shuffle=True)
    step = af.compose(af.shard_data(), af.replicate(), af.with_precision("bf16"), af.accumulate(config.accumulate),
                      af.clip(1.0))(af.train_step(example.loss_fn))
    backend = af.backends.CPU(af.backends.LaunchEnv())
    check_before_run(step, state, loader, backend, 1000, config.max_steps)  # warm (imports, first calls)
    start = time.perf_counter()
    for _ in range(5):
        check_before_run(step, state, loader, backend, 1000, config.max_steps)
    planning = (time.perf_counter() - start) / 5
    start = time.perf_counter()
    af.run(step, state, loader, backend=backend, max_steps=1, progress=False, plan=False)
    first_update = time.perf_counter() - start
    return {"plan_check_s": planning, "first_update_s": first_update, "percent": 100 * planning / first_update}


if __name__ == "__main__":
    print(json.dumps(main()))
