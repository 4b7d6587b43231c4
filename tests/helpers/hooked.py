"""A small job with a per-epoch evaluation hook, shared by the 2-process worker ``tracked.py``
and the single-process tests: the two differ only in the number of processes and the
per-process batch size (replicate over 2 ranks with batch b equals 1 rank with batch 2b)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import accelfn as af
from tests.helpers import programs as P

PER_RANK_BATCH = 3  # 24 samples: 4 updates per epoch on 2 ranks (and on 1 rank with batch 6)
NUM_SAMPLES = 24
EPOCHS = 3
UPDATES_PER_EPOCH = 4
EVERY_STEPS = 3  # the custom-value hook: steps 3, 6, 9, 12
CHECKPOINT_EVERY = 5
CRASH_AT = 7  # the loss function raises on its 8th call: after step 7, past the checkpoint of step 5
CONFIG = {"lr": 1e-2, "model": {"hidden": 8, "activation": "tanh"}, "tags": ["a", "b"]}


class Crash(RuntimeError):
    """The simulated failure of a crashed attempt."""


def val_loader(batch_size: int) -> DataLoader:
    return DataLoader(P.regression_data(10, seed=5), batch_size=batch_size)


def evaluate_every_epoch(batch_size: int) -> af.Hook:
    """At each epoch's end: the validation MSE over all 10 samples (``af.evaluate``)."""
    data = val_loader(batch_size)

    def validate(state: af.TrainState, backend: af.backends.Backend) -> dict[str, float]:
        errors = af.evaluate(lambda m, b: (m(b[0]) - b[1]) ** 2, state, data, backend=backend)
        return {"val/loss": errors.mean().item(), "val/epoch": float(state.epoch)}

    return af.Hook(validate, at_epoch_end=True)


def count_steps(state: af.TrainState, backend: af.backends.Backend) -> dict[str, float]:
    return {"hook/step": float(state.step)}


def train(backend: af.backends.Backend, batch_size: int, *, trackers: Sequence[Any] = (),
          config: dict[str, Any] | None = None, checkpoints: af.Checkpoints | None = None,
          resume: str | None = None, crash_at: int | None = None) -> af.TrainState:
    """A fresh state trained EPOCHS epochs with both hooks (raising Crash at call ``crash_at``)."""
    calls = [0]

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if crash_at is not None and calls[0] == crash_at:
            raise Crash(f"simulated crash at loss call {crash_at}")
        calls[0] += 1
        return F.mse_loss(model(batch[0]), batch[1])

    step = af.compose(af.shard_data(seed=P.SHARD_SEED), af.replicate())(af.train_step(loss_fn))
    loader = DataLoader(P.regression_data(NUM_SAMPLES), batch_size=batch_size, shuffle=True)
    hooks = [evaluate_every_epoch(batch_size), af.Hook(count_steps, every_steps=EVERY_STEPS)]
    return af.run(step, P.make_state(), loader, backend=backend, epochs=EPOCHS, progress=False,
                  trackers=trackers, config=config, hooks=hooks, checkpoints=checkpoints, resume=resume)


def flat_parameters(state: af.TrainState) -> list[float]:
    return torch.cat([p.detach().cpu().reshape(-1) for p in state.model.parameters()]).tolist()
