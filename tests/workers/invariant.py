"""Worker for tests/transforms/test_invariant.py: one topology trains every variant under
``af.invariant()`` (and a control without it) and records a hash of the whole state after
every update, plus the logged points, so the test compares topologies update by update.

Usage: accelfn launch --nproc-per-node W invariant.py --out DIR [--resume CKPT]

The micro-batch is ``B`` samples and an update ``L = 8`` micro-batches: each topology runs
``accumulate(8 // W)``. Rank 0 writes DIR/<variant>.json: ``{"hashes": [...], "points":
[...]}``, the hash after each update and the JSONL points (step, loss, grad_norm).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import accelfn as af
from accelfn.distributed import is_dtensor

B, L, EPOCHS = 2, 8, 2
UPDATES_PER_EPOCH = 20  # the topologies agree on each update's bits; the 1000-update run is long_run's
UPDATES = EPOCHS * UPDATES_PER_EPOCH
NUM_SAMPLES = B * L * UPDATES_PER_EPOCH + 5  # the last 5 samples are the dropped tail
VARIANTS = ("sgd", "adamw", "loss_bf16", "clip_value", "sharded", "control", "shard_control")
CONTROL_UPDATES = 20  # the control (without invariant()) differs from the first update on


class Samples(Dataset):
    """``(x, y, w)``: features, a class and an item weight in 0..3 (half of them 0)."""

    def __init__(self, num_samples: int = NUM_SAMPLES) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(num_samples, 6, generator=g)
        self.y = torch.randint(0, 3, (num_samples,), generator=g)
        self.w = torch.randint(1, 4, (num_samples,), generator=g) * (torch.rand(num_samples, generator=g) < 0.5)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i], self.w[i]


class Augmented(Samples):
    """``Samples`` with a random augmentation in ``__getitem__`` (torch noise, a flip drawn from
    Python's ``random``, a scale from NumPy), fetched in the main process (no workers): keyed
    per global micro-batch under invariant(), as in DataLoader workers."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.x[i] + 0.1 * torch.randn(6)
        if random.random() < 0.5:
            x = x.flip(0)
        return x * float(np.random.uniform(0.9, 1.1)), self.y[i], self.w[i]


def mean_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y, _ = batch
    return F.cross_entropy(model(x), y)


def noisy_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The mean loss times a factor drawn from Python's ``random`` and NumPy (keyed per
    global micro-batch under invariant(), as torch's generator is)."""
    return mean_loss(model, batch) * (1.0 + 0.5 * random.random() + 0.5 * float(np.random.rand()))


class ItemLoss:
    """An ``af.Loss`` over items weighted 0..3; counts the micro-batches whose count is 0."""

    def __init__(self) -> None:
        self.empty = 0

    def __call__(self, model: torch.nn.Module, batch: Any) -> af.Loss:
        x, y, w = batch
        per_sample = F.cross_entropy(model(x).float(), y, reduction="none")
        count = int(w.sum())
        self.empty += count == 0
        return af.Loss(total=(per_sample * w).sum(), count=count)


def build(variant: str, world_size: int, micro_batches: int = L,
          num_samples: int = NUM_SAMPLES) -> tuple[af.Step, af.TrainState, DataLoader, Any]:
    """The program, state, data and loss function of ``variant`` for ``world_size`` processes."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(32, 3))
    scheduler = None
    if variant in ("sgd", "control", "clip_value", "shard_control"):
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.02 * s))
    state = af.TrainState.create(model, optimizer, scheduler=scheduler)
    a = micro_batches // world_size
    loss_fn: Any = ItemLoss() if variant == "loss_bf16" else noisy_loss if variant == "sgd" else mean_loss
    if variant in ("control", "shard_control"):  # the same samples per update, reduced as DDP (FSDP2) does
        parallel = af.replicate() if variant == "control" else af.shard_params()
        transforms = [af.shard_data(seed=3, split_batches=True), parallel, af.accumulate(a), af.clip(1.0)]
        loader = DataLoader(Samples(num_samples), batch_size=B * world_size, shuffle=True, drop_last=True)
    else:
        parallel = af.shard_params() if variant == "sharded" else af.replicate()
        # under shard_params() the clip bites at most updates: its norm is read from the whole gradient
        transforms = [af.invariant(seed=7), af.shard_data(seed=3), parallel, af.accumulate(a),
                      af.clip(0.5 if variant == "sharded" else 1.0)]
        if variant == "loss_bf16":
            transforms.append(af.with_precision("bf16"))
        if variant == "clip_value":  # clip_value and skip_nonfinite in place of clip
            transforms[-1:] = [af.clip_value(0.05), af.skip_nonfinite()]
        dataset = Augmented(num_samples) if variant == "sgd" else Samples(num_samples)
        loader = DataLoader(dataset, batch_size=B, shuffle=True)
    return af.compose(*transforms)(af.train_step(loss_fn)), state, loader, loss_fn


def state_hash(state: af.TrainState, world_size: int) -> str:
    """sha256 of every tensor and value of the state: model, optimizer, scheduler, and the
    counters in global units (micro-batches consumed over all ranks)."""
    h = hashlib.sha256()

    def add(value: Any) -> None:
        if isinstance(value, torch.Tensor) and is_dtensor(value):  # shard_params: the whole tensor
            value = value.full_tensor()  # type: ignore[attr-defined]
        if isinstance(value, torch.Tensor):
            h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                h.update(str(k).encode())
                add(value[k])
        elif isinstance(value, (list, tuple)):
            for v in value:
                add(v)
        else:
            h.update(repr(value).encode())

    add(state.model.state_dict())
    add(state.optimizer.state_dict())
    add({k: v for k, v in state.scheduler.state_dict().items() if k != "lr_lambdas"} if state.scheduler else None)
    add([state.step, state.epoch, state.micro_step * world_size, state.epoch_micro_step * world_size])
    return h.hexdigest()


def train(out: str, variants: list[str] = list(VARIANTS)) -> dict[str, Any]:
    """Trains each of ``variants`` on this topology with ``af.run`` and writes rank 0's results to ``out``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same kernels in every topology
    try:
        backend = af.backends.CPU()
        results: dict[str, Any] = {}
        for variant in variants:
            step, state, loader, loss_fn = build(variant, backend.world_size)
            hashes: list[str] = []
            log = Path(out) / f"{variant}.points.jsonl"
            if backend.is_main_process and log.exists():
                log.unlink()

            def record(state: af.TrainState, backend: Any, hashes: list[str] = hashes) -> None:
                hashes.append(state_hash(state, backend.world_size))

            random.seed(5)  # the draws of loss_fn under invariant() leave these generators as they were
            np.random.seed(5)
            with warnings.catch_warnings():  # the sharded variants' 1-process reference shards nothing, as said
                warnings.filterwarnings("ignore", r"\[shard-params-one-process\]", af.PlanWarning)
                state = af.run(step, state, loader, backend=backend, epochs=EPOCHS, progress=False,
                               max_steps=CONTROL_UPDATES if "control" in variant else None,
                               trackers=[af.JSONL(log)], hooks=[af.Hook(record, every_steps=1)])
            outer = [random.random(), float(np.random.rand())]
            random.seed(5)
            np.random.seed(5)
            untouched = outer == [random.random(), float(np.random.rand())]
            empty = backend.reduce(torch.tensor(float(getattr(loss_fn, "empty", 0))), "sum").item()
            if backend.is_main_process:
                points = [json.loads(line) for line in log.read_text().splitlines()]
                results[variant] = {"hashes": hashes, "points": [[p["step"], p["loss"], p.get("grad_norm")]
                                                                 for p in points], "empty_micro_batches": empty,
                                    "outer_rng_untouched": untouched, "dtensors": all(is_dtensor(p) for p in state.model.parameters())}
                (Path(out) / f"{variant}.json").write_text(json.dumps(results[variant]))
        return {"world_size": backend.world_size, "variants": sorted(results)}
    finally:
        torch.set_num_threads(threads)


def segment(out: str, name: str, variant: str = "adamw", resume: str | None = None,
            stop: list[int] | None = None) -> list[str]:
    """Trains ``variant`` by hand (prepare, batches, step function) from ``resume`` (a checkpoint
    of any topology) until ``stop = [update, micro-batch]`` (``state.step`` and the position in
    its window; None: to the end), where it saves to OUT/NAME as a killed job would have
    last; rank 0 writes the hashes after each update to OUT/NAME.json."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        backend = af.backends.CPU()
        step, state, loader, _ = build(variant, backend.world_size)
        state, step_fn = backend.prepare(step, state)
        if resume is not None:
            state = af.load(resume, into=state, backend=backend)
        a, hashes = L // backend.world_size, []
        while state.epoch < EPOCHS:
            epoch = state.epoch
            for batch, last in backend.batches(loader, step_fn.step, epoch, start=state.epoch_micro_step):
                if stop is not None and [state.step, state.epoch_micro_step % a] == stop:
                    af.save(state, Path(out) / name, backend=backend)
                    break
                state, metrics = step_fn(state, batch, flush=last)
                if last:
                    state = state.replace(epoch=epoch + 1, epoch_micro_step=0)
                if metrics:
                    hashes.append(state_hash(state, backend.world_size))
            else:
                continue
            break
        if backend.is_main_process:
            (Path(out) / f"{name}.json").write_text(json.dumps(hashes))
        return hashes
    finally:
        torch.set_num_threads(threads)


def long_run(out: str, updates: int = 1000) -> list[str]:
    """1000 updates of 6 micro-batches (``accumulate(6 // W)``: W = 1 or 3, not powers of two)
    of the SGD variant; rank 0 writes the hashes after every 100th update to OUT/long{W}.json,
    and the parameters then to OUT/long{W}.params.json."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        backend = af.backends.CPU()
        step, state, loader, _ = build("sgd", backend.world_size, micro_batches=6, num_samples=B * 6 * 250 + 7)
        hashes: list[str] = []
        params: list[list[list[float]]] = []

        def record(state: af.TrainState, backend: Any) -> None:
            hashes.append(state_hash(state, backend.world_size))
            params.append([p.detach().reshape(-1).tolist() for p in state.model.parameters()])

        af.run(step, state, loader, backend=backend, epochs=None, max_steps=updates, progress=False,
               hooks=[af.Hook(record, every_steps=100)])
        if backend.is_main_process:
            (Path(out) / f"long{backend.world_size}.json").write_text(json.dumps(hashes))
            (Path(out) / f"long{backend.world_size}.params.json").write_text(json.dumps(params))
        return hashes
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--segment", action="append", default=[],
                        help="NAME:VARIANT:CHECKPOINT: also train a segment of VARIANT resumed from CHECKPOINT")
    parser.add_argument("--long", action="store_true", help="only long_run")
    args = parser.parse_args()
    if args.long:
        long_run(args.out)
        raise SystemExit
    train(args.out, args.variants.split(","))
    for spec in args.segment:
        name, variant, checkpoint = spec.split(":", 2)
        segment(args.out, name, variant, resume=checkpoint)
