"""Sharded and unsharded checkpoints go through one flow: the same mid-window rule, the same
checks before anything changes, the same two phases (open, then put)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

import accelfn as af
from accelfn.checkpoint import open_checkpoint
from accelfn.distributed import ProcessContext, fsdp
from tests.helpers import programs as P
from tests.helpers.sharded import make_state


def _loader() -> DataLoader:
    return DataLoader(P.regression_data(), batch_size=P.PER_RANK_BATCH)


def _sharded_in_one_process(state: af.TrainState) -> af.TrainState:
    """``state`` with its model sharded by FSDP2 over a world of one process (each block, then
    the root) and its optimizer pointed at the DTensor parameters."""
    fsdp.single_process_group(torch.device("cpu"))
    mesh = init_device_mesh("cpu", (1,))
    names = {id(p): n for n, p in state.model.named_parameters()}
    for block in state.model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(state.model, mesh=mesh)
    sharded = dict(state.model.named_parameters())
    for group in state.optimizer.param_groups:
        group["params"] = [sharded[names[id(p)]] for p in group["params"]]
    return state


def _mid_window(state: af.TrainState, program: af.Step, path: Path) -> Path:
    """Saves ``state`` after the first micro-batch of a window of 2 (gradients accumulated, not applied)."""
    state, step_fn = af.backends.CPU().prepare(program, state)
    state, metrics = step_fn(state, next(iter(_loader())))
    assert not metrics and "window" in state.transforms_state
    return af.save(state, path)


def test_a_sharded_and_an_unsharded_mid_window_checkpoint_refuse_another_world_size_alike(tmp_path: Path) -> None:
    """A checkpoint saved in the middle of an accumulation window, sharded (FSDP2's DTensor
    gradients) or not, is refused by a world of another size with the same message, before
    anything in the state changes."""
    plain = _mid_window(make_state(), af.accumulate(2)(af.train_step(P.mse)), tmp_path / "plain")
    sharded = _mid_window(_sharded_in_one_process(make_state()),
                          af.compose(af.shard_params(), af.accumulate(2))(af.train_step(P.mse)), tmp_path / "sharded")
    messages = {}
    for name, path in (("plain", plain), ("sharded", sharded)):
        into = make_state()
        before = {k: v.clone() for k, v in into.model.state_dict().items()}
        with pytest.raises(af.CheckpointError) as error:
            af.load(path, into=into, backend=ProcessContext(rank=0, world_size=2, local_world_size=2))
        assert all(torch.equal(v, before[k]) for k, v in into.model.state_dict().items())
        messages[name] = str(error.value).replace(str(path), "<checkpoint>")
    assert messages["plain"] == messages["sharded"] == (
        "<checkpoint> was saved by 1 process in the middle of an accumulation window, whose gradients are per "
        "process; resume it with 1 process (this world has 2)")


def test_opening_checks_everything_and_changes_nothing_until_put(tmp_path: Path) -> None:
    """``open_checkpoint`` verifies the files and checks the checkpoint against the state,
    leaving the state untouched; ``put`` then restores it, at the saved position or at the
    one the caller gives."""
    state = make_state()
    step = af.train_step(P.mse)
    state = af.run(step, state, _loader(), backend=af.backends.CPU(), max_steps=3, epochs=None,
                   progress=False)
    path = af.save(state, tmp_path / "ckpt")
    into = make_state(seed=1)
    before = {k: v.clone() for k, v in into.model.state_dict().items()}
    opened = open_checkpoint(path, into=into)
    assert opened.counters["step"] == 3 and opened.world_size == 1
    assert all(torch.equal(v, before[k]) for k, v in into.model.state_dict().items())
    assert opened.other_program(step) is None
    restored = opened.put(epoch_micro_step=1)
    assert (restored.step, restored.epoch_micro_step) == (3, 1)
    assert all(torch.equal(v, state.model.state_dict()[k]) for k, v in restored.model.state_dict().items())


def test_save_of_something_other_than_a_train_state_says_what_it_takes(tmp_path: Path) -> None:
    """``af.save`` of a dict fails with a TypeError naming TrainState and what to use for a
    dict of tensors, before anything is written."""
    with pytest.raises(TypeError, match=r"af\.save\(state, \.\.\.\) takes a TrainState, got a dict; .*to save a "
                                        r"plain dict of tensors use safetensors\.torch\.save_file"):
        af.save({"w": torch.zeros(2)}, tmp_path / "ckpt")  # type: ignore[arg-type]
    assert not (tmp_path / "ckpt").exists()


def _modules_walked(fn: Callable[[], object]) -> list[str]:
    """The accelfn.checkpoint modules whose functions run during ``fn()`` (a profile hook)."""
    seen: set[str] = set()

    def profile(frame: Any, event: str, arg: object) -> None:
        name = frame.f_globals.get("__name__", "")
        if event == "call" and name.startswith("accelfn.checkpoint"):
            seen.add(name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return sorted(seen)


def test_a_save_and_a_load_each_walk_at_most_nine_checkpoint_modules(tmp_path: Path) -> None:
    """af.save of a trained state runs code of at most 9 modules of accelfn.checkpoint, and
    af.load of it at most 8: the same ones but ``_frozen`` (which writes the frozen base's
    files, read as any model file): a save checks what it writes by the reader a load runs
    (counted by a profile hook on every Python call)."""
    state = make_state()
    state = af.run(af.train_step(P.mse), state, _loader(), backend=af.backends.CPU(), max_steps=2, epochs=None,
                   progress=False)
    saved = _modules_walked(lambda: af.save(state, tmp_path / "ckpt"))
    loaded = _modules_walked(lambda: af.load(tmp_path / "ckpt", into=make_state()))
    assert len(saved) <= 9, saved
    assert len(loaded) <= 8, loaded
    assert set(saved) - set(loaded) == {"accelfn.checkpoint._frozen"} and set(loaded) <= set(saved)
