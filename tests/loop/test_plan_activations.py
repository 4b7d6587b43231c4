"""``af.plan``'s traced peak of one micro-batch (forward and backward on fake tensors) is within
10 % of the real peak of the same micro-batch, measured with
``torch.distributed._tools.mem_tracker.MemTracker`` in real mode on the CPU (peak of all tracked
bytes minus parameters and buffers), for the digits CNN, the byte LM (bf16 autocast) and the
2-layer GPT-2 of the examples."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.data import DataLoader, Dataset

import accelfn as af
from accelfn.step import unpack
from tests.helpers import launch as _launch


def _example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"{name}_plan_example", _launch.ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Items(Dataset):
    def __init__(self, items: list[Any]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


def _case(name: str) -> tuple[torch.nn.Module, Any, DataLoader, str]:
    torch.manual_seed(0)
    if name == "digits":
        module = _example("digits")
        items = [(torch.rand(1, 8, 8), torch.tensor(i % 10)) for i in range(64)]
        return module.Net(), module.loss_fn, DataLoader(_Items(items), batch_size=16), "fp32"
    if name == "byte_lm":
        module = _example("byte_lm")
        config = module.Config()
        items = [(torch.randint(0, 256, (config.context,)), torch.randint(0, 256, (config.context,)))
                 for _ in range(32)]
        return module.ByteLM(config), module.loss_fn, DataLoader(_Items(items), batch_size=config.batch_size), "bf16"
    module = _example("hf_gpt2")
    items = [{"input_ids": (ids := torch.randint(0, 256, (64,))), "labels": ids} for _ in range(16)]
    return module.gpt2(64), module.loss_fn, DataLoader(_Items(items), batch_size=8), "fp32"


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


@pytest.mark.parametrize("name", ["digits", "byte_lm", "hf_gpt2"])
def test_traced_micro_batch_peak_is_within_ten_percent_of_the_real_one(name):
    """The plan's micro-batch peak, traced without allocating, is within 10 % of the real one."""
    if name == "hf_gpt2":
        pytest.importorskip("transformers")
    if name == "digits":
        pytest.importorskip("sklearn")
    model, loss_fn, loader, precision = _case(name)
    state = af.TrainState.create(model, torch.optim.AdamW(model.parameters()))
    step = af.with_precision(precision)(af.train_step(loss_fn))
    planned = af.plan(step, state, loader).memory[0].micro_batch
    assert all(p.grad is None for p in model.parameters())  # the trace touched nothing real
    real = _real_peak(model, loss_fn, next(iter(loader)), precision)
    print(f"{name}: planned {planned} B, real {real} B, {100 * (planned - real) / real:+.1f} %")
    assert abs(planned - real) <= 0.10 * real
