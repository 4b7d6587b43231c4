"""Worker for tests/backends/test_deepspeed.py: one 2-process scenario runs every training check.

``train_all`` trains each case of ``tests.helpers.deepspeed_programs.CASES`` (ZeRO stages 1,
2, 3 and 3 with CPU offload, with and without ``accumulate(2)`` + ``clip(1.0)``) and one bf16
run, and returns (as JSON) each case's full parameters, logged metrics and counters.
"""

from __future__ import annotations

from typing import Any

import torch

import accelfn as af
from tests.helpers import deepspeed_programs as D
from tests.helpers import programs as P


class Record:
    """A tracker that keeps every logged point (the loop logs on the main process)."""

    def __init__(self) -> None:
        self.points: list[dict[str, float]] = []

    def log(self, metrics: Any, step: int) -> None:
        self.points.append({k: float(v) for k, v in metrics.items()})

    def close(self) -> None:
        pass


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole parameters on every rank (gathered from the partitions at stage 3)."""
    import deepspeed

    params = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: p.detach().float().clone() for name, p in params.items()}


def _run(zero: dict[str, Any], n: int, clip: float | None, *, bf16: bool = False) -> dict[str, Any]:
    model = D.make_model()
    state = af.TrainState.create(model, D.make_optimizer(model))
    transforms: list[Any] = [af.shard_data(), af.deepspeed({"zero_optimization": zero})]
    if n > 1:
        transforms.append(af.accumulate(n))
    if clip is not None:
        transforms.append(af.clip(clip))
    if bf16:
        transforms.append(af.with_precision("bf16"))
    record = Record()
    state = af.run(af.compose(*transforms)(af.train_step(P.mse)), state, D.loader(), backend=af.backends.CPU(),
                   epochs=D.epochs(n), progress=False, trackers=[record], log_every=1)
    return {"params": D.to_json(full_parameters(state.model)), "points": record.points, "step": state.step,
            "micro_step": state.micro_step}


def train_all() -> dict[str, Any]:
    """Every case of ``D.CASES``, then ZeRO-2 under ``with_precision("bf16")`` (no accumulation)."""
    results = {name: _run(D.ZERO[zero], n, clip) for name, (zero, n, clip) in D.CASES.items()}
    results["s2_bf16"] = _run(D.ZERO["s2"], 1, None, bf16=True)
    return results
