"""Every public entry that takes a TrainState refuses anything else (a dict, the model, a
path) with a TypeError that names the call and what to build instead, before it writes or
changes anything."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import accelfn as af

_FIX = r"af\.TrainState\.create\(model, optimizer\)"


def _state() -> af.TrainState:
    model = torch.nn.Linear(2, 1)
    return af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _entries(tmp: Path, saved: Path) -> dict[str, Callable[[Any], object]]:
    step = af.train_step(lambda m, b: m(b).sum())
    data = [torch.randn(2, 2)]
    cpu = af.backends.CPU()
    return {
        "af.save(state, ...)": lambda s: af.save(s, tmp / "ckpt"),
        "af.load(path, into=...)": lambda s: af.load(saved, into=s),
        "af.snapshot(state)": lambda s: af.snapshot(s),
        "af.restore(state, snapshot)": lambda s: af.restore(s, af.snapshot(_state())),
        "af.save_model(state, directory)": lambda s: af.save_model(s, tmp / "export"),
        "Checkpoints.save(state)": lambda s: af.Checkpoints(tmp / "ckpts").save(s),
        "af.run(step, state, ...)": lambda s: af.run(step, s, data, backend=cpu, epochs=1,
                                                     checkpoints=af.Checkpoints(tmp / "run"),
                                                     trackers=[af.JSONL(tmp / "m.jsonl")]),
        "af.evaluate(fn, state, ...)": lambda s: af.evaluate(lambda m, b: m(b), s, data, backend=cpu),
        "backend.prepare(step, state)": lambda s: cpu.prepare(step, s),
        "af.count_updates(..., state=...)": lambda s: af.count_updates(step, data, backend=cpu, state=s, epochs=1),
    }


_CALLS = sorted(_entries(Path("."), Path(".")))


@pytest.mark.parametrize("call", _CALLS)
def test_a_dict_is_refused_with_what_to_build_before_anything_is_written(call: str, tmp_path: Path) -> None:
    """Each entry given a dict of tensors raises a TypeError naming the call, the dict and
    TrainState.create (and safetensors for plain tensors), and writes no file."""
    saved = af.save(_state(), tmp_path / "saved")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(TypeError, match=rf"^{call.replace('(', '[(]').replace(')', '[)]').replace('.', '[.]')} takes "
                                        rf"a TrainState, got a dict; .*{_FIX}.*safetensors\.torch\.save_file"):
        _entries(tmp_path, saved)[call]({"weight": torch.zeros(1, 2)})
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("call", _CALLS)
def test_the_model_itself_is_refused_with_how_to_wrap_it(call: str, tmp_path: Path) -> None:
    """Each entry given the bare model raises a TypeError saying to wrap it with its optimizer
    in TrainState.create, and leaves the model's parameters as they were."""
    saved = af.save(_state(), tmp_path / "saved")
    model = torch.nn.Linear(2, 1)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=rf"takes a TrainState, got the model \(Linear\) itself; .*{_FIX}"):
        _entries(tmp_path, saved)[call](model)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"]


def test_swapped_arguments_of_save_are_named_as_such(tmp_path: Path) -> None:
    """``af.save(path, state)`` says the arguments look swapped (a path where the state is due)."""
    with pytest.raises(TypeError, match=r"af\.save\(state, \.\.\.\) takes a TrainState, got a path .*swapped"):
        af.save(str(tmp_path / "ckpt"), _state())  # type: ignore[arg-type]
    assert not (tmp_path / "ckpt").exists()
