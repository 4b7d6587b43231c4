"""``af.plan``'s traced peak of one micro-batch (forward and backward on fake tensors) is within
10 % of the real peak of the same micro-batch, measured with
``torch.distributed._tools.mem_tracker.MemTracker`` in real mode on the CPU (peak of all tracked
bytes minus parameters and buffers), for the digits CNN, the byte LM (bf16 autocast) and the
2-layer GPT-2 of the examples."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

import accelfn as af
from accelfn.step import unpack
from tests.helpers import planning


def _real_peak(model: torch.nn.Module, loss_fn: Any, batch: Any, precision: str) -> int:
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = unpack(loss_fn(model, batch))[0]
        loss.backward()
    peak = tracker.get_tracker_snapshot("peak")
    held = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    return sum(v["Total"] for v in peak.values()) - held


@pytest.mark.parametrize("name", planning.EXAMPLES)
def test_traced_micro_batch_peak_is_within_ten_percent_of_the_real_one(name):
    """The plan's micro-batch peak, traced without allocating, is within 10 % of the real one."""
    if name == "hf_gpt2":
        pytest.importorskip("transformers", reason="the GPT-2 example needs transformers (pip install transformers)")
    if name == "digits":
        pytest.importorskip("sklearn", reason="the digits example needs scikit-learn (the examples and dev extras have it)")
    model, loss_fn, loader, precision = planning.example_case(name)
    state = af.TrainState.create(model, torch.optim.AdamW(model.parameters()))
    step = af.with_precision(precision)(af.train_step(loss_fn))
    planned = af.plan(step, state, loader).memory[0].micro_batch
    assert all(p.grad is None for p in model.parameters())  # the trace touched nothing real
    real = _real_peak(model, loss_fn, next(iter(loader)), precision)
    print(f"{name}: planned {planned} B, real {real} B, {100 * (planned - real) / real:+.1f} %")
    assert abs(planned - real) <= 0.10 * real
