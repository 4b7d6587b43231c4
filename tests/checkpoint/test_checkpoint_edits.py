"""Corrupted or edited manifests: refused, naming the file and the field, before anything changes."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import orjson
import pytest
import torch

import accelfn as af
from accelfn.errors import CheckpointError
from tests.helpers.corrupt import header, safetensors_file, signed
from tests.helpers.states import Counter, assert_same_state, build, everything, loader, program, same_tree

Edit = Callable[[dict[str, Any]], None]


@pytest.fixture
def saved(cpu, tmp_path) -> tuple[Path, af.TrainState]:
    """A checkpoint of an fp16 state mid-window (AdamW moments, cosine schedule, an extra
    object), and the state; the global generators have moved on since it was saved."""
    step = program(af.with_precision("fp16"))
    state, step_fn = cpu.prepare(step, build(0, extra=True))
    for batch, last in list(cpu.batches(loader(), step, 0))[:5]:
        state, _ = step_fn(state, batch, flush=last)
    path = af.save(state, tmp_path / "ckpt")
    torch.rand(3), random.random(), np.random.rand()
    return path, state


def _edit(path: Path, change: Edit, *, checksum: bool = True) -> None:
    """Applies ``change`` to manifest.json; with ``checksum``, rewrites manifest.sha256 to match."""
    manifest = orjson.loads((path / "manifest.json").read_bytes())
    change(manifest)
    data = orjson.dumps(manifest)
    (path / "manifest.json").write_bytes(data)
    if checksum:
        (path / "manifest.sha256").write_text(f"{hashlib.sha256(data).hexdigest()}  manifest.json\n")


def _set(*keys: Any, value: Any) -> Edit:
    def change(manifest: dict[str, Any]) -> None:
        node = manifest
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value

    return change


def _shorten_python_rng(manifest: dict[str, Any]) -> None:
    internal = manifest["ranks"][0]["rng"]["fields"]["python"]["__tuple__"][1]["__tuple__"]
    del internal[10:]


def _renumber_first_optimizer_state(manifest: dict[str, Any]) -> None:
    manifest["optimizer"]["state"]["__dict__"][0][0] = 7


def _refused(path: Path, target: af.TrainState, message: str) -> None:
    before = everything(target)
    with pytest.raises(CheckpointError) as error:
        af.load(path, into=target)
    assert message in str(error.value), str(error.value)
    after = everything(target)
    assert same_tree(after, before), "the state or a global generator changed"


@pytest.mark.parametrize(("change", "message"), [
    (_set("counters", "step", value="x"), "ckpt: invalid values in manifest.json:\n  counters.step: 'x' (a str), "
                                          "must be an int >= 0"),
    (_set("counters", "epoch", value=-1), "counters.epoch: -1 (an int), must be an int >= 0"),
    (_set("ranks", 0, "rng", "fields", "torch_cpu", value="00"),
     "ckpt: invalid values in manifest.json:\n  ranks[0].rng.torch_cpu: not a state of torch's CPU generator"),
    (_shorten_python_rng, "ranks[0].rng.python: not a state of Python's random"),
    (_set("optimizer", "param_groups", 0, "lr", value="fast"),
     "ckpt: the checkpoint does not match the state it is loaded into:\n  optimizer.param_groups[0].lr: 'fast' "
     "(a str) in manifest.json, 0.01 (a float) here"),
    (_set("optimizer", "param_groups", 0, "amsgrad", value="no"),
     "optimizer.param_groups[0].amsgrad: 'no' (a str) in manifest.json, False (a bool) here"),
    (_set("optimizer", "param_groups", 0, "eps", value={"__float__": "abc"}),
     "ckpt/manifest.json: optimizer.param_groups[0].eps: a malformed __float__ value"),
    (_renumber_first_optimizer_state, "optimizer.state: entries for parameters 7 in manifest.json; the optimizer "
                                      "has parameters 0..3"),
    (_set("scheduler", "T_max", value="zz"), "scheduler.T_max: 'zz' (a str) in manifest.json, 15 (an int) here"),
    (_set("ranks", 0, "transforms_state", "loss_scale", "fields", "scale", value="big"),
     "ckpt/manifest.json: ranks[0].transforms_state.loss_scale.scale: 'big' (a str), must be float"),
    (_set("model", "fc1.weight", value=3), "model 'fc1.weight': 3 (an int) in the checkpoint, a tensor here"),
    (_set("ranks", 0, "transforms_state", "loss_scale", "fields", "scale", value=0.0),
     "ckpt/manifest.json: ranks[0].transforms_state.loss_scale: LossScale(scale=0.0): must be a finite number > 0"),
    (_set("ranks", 0, "transforms_state", "loss_scale", "fields", "scale", value=-65536.0),
     "ranks[0].transforms_state.loss_scale: LossScale(scale=-65536.0): must be a finite number > 0"),
    (_set("ranks", 0, "transforms_state", "loss_scale", "fields", "scale", value={"__float__": "inf"}),
     "ranks[0].transforms_state.loss_scale: LossScale(scale=inf): must be a finite number > 0"),
    (_set("ranks", 0, "transforms_state", "loss_scale", "fields", "scale", value={"__float__": "nan"}),
     "ranks[0].transforms_state.loss_scale: LossScale(scale=nan): must be a finite number > 0"),
    (_set("ranks", 0, "transforms_state", "loss_scale", "fields", "growth_tracker", value=-1),
     "ranks[0].transforms_state.loss_scale: LossScale(growth_tracker=-1): must be >= 0"),
    (_set("ranks", 0, "transforms_state", "skips", "fields", "num_skipped", value=-3),
     "ranks[0].transforms_state.skips: SkipCount(num_skipped=-3): must be >= 0"),
    (_set("counters", "micro_step", value=1),
     "ckpt: invalid values in manifest.json:\n  counters.micro_step: 1, below counters.step (2); every optimizer "
     "update consumes at least one micro-batch"),
    (_set("optimizer", "param_groups", 0, "betas", value={"__tuple__": [0.9, 0.999, 0.5]}),
     "ckpt: the checkpoint does not match the state it is loaded into:\n  optimizer.param_groups[0].betas: "
     "(0.9, 0.999, 0.5) (a tuple) in manifest.json, (0.9, 0.999) (a tuple) here (3 items, not 2)"),
    (_set("scheduler", "base_lrs", value=[]),
     "scheduler.base_lrs: [] (a list) in manifest.json, [0.01] (a list) here (0 items, not 1)"),
    (_set("optimizer", "param_groups", 0, "lr", value=-1.0),
     "optimizer.param_groups[0]: AdamW refuses the hyperparameters in manifest.json: Invalid learning rate: -1.0"),
    (_set("optimizer", "param_groups", 0, "betas", value={"__tuple__": [1.5, 0.999]}),
     "optimizer.param_groups[0]: AdamW refuses the hyperparameters in manifest.json: Invalid beta parameter at "
     "index 0: 1.5"),
])
def test_an_edited_value_is_refused_before_anything_changes(saved, change: Edit, message: str) -> None:
    """A manifest edited with its checksum updated to match (a counter that is not an int >= 0,
    fewer micro-batches than updates, an RNG state of the wrong size, a hyperparameter or
    scheduler value of another type or length than the live one, a loss scale that is not a
    finite number > 0, a negative growth tracker or skip count, a malformed or mistyped value)
    fails to load with a CheckpointError naming the file and the field, and the model,
    optimizer, scheduler, extra objects, counters and global generators are exactly as before."""
    path, _ = saved
    _edit(path, change)
    _refused(path, build(99, extra=True), message)


def test_an_edited_manifest_fails_its_checksum(saved) -> None:
    """One digit of a counter changed in manifest.json (still valid JSON, a plausible value)
    fails the sha256 in manifest.sha256; nothing in the target changes."""
    path, _ = saved
    _edit(path, _set("counters", "step", value=3), checksum=False)
    _refused(path, build(99, extra=True), f"{path / 'manifest.json'}: sha256 ")
    with pytest.raises(CheckpointError, match="does not match [0-9a-f]{64} in manifest.sha256; the manifest is "
                                              "corrupted or was changed"):
        af.load(path, into=build(99, extra=True))


def test_a_missing_or_garbled_checksum_file_is_refused(saved) -> None:
    """A format-2 checkpoint without manifest.sha256, or with a garbled one, does not load."""
    path, _ = saved
    (path / "manifest.sha256").write_text("0123  manifest.json\n")
    _refused(path, build(99, extra=True), "manifest.sha256: not a sha256 line for manifest.json")
    (path / "manifest.sha256").unlink()
    _refused(path, build(99, extra=True), "manifest.sha256 is missing: a checkpoint of format version 4 has the "
                                          "sha256 of its manifest.json in it")


def test_a_format_1_checkpoint_without_checksum_loads(saved) -> None:
    """A checkpoint of format version 1 (no manifest.sha256) still loads exactly, and its
    values are still checked."""
    path, state = saved
    (path / "manifest.sha256").unlink()
    _edit(path, _set("format_version", value=1), checksum=False)
    assert_same_state(af.load(path, into=build(99, extra=True)), state)
    _edit(path, _set("optimizer", "param_groups", 0, "lr", value="fast"), checksum=False)
    _refused(path, build(99, extra=True), "optimizer.param_groups[0].lr: 'fast' (a str) in manifest.json")


def test_restoring_a_snapshot_with_an_invalid_counter_changes_nothing(cpu) -> None:
    """restore() of a snapshot whose counter is negative raises naming it; the state is untouched."""
    snap = af.snapshot(build(0))
    bad = attrs.evolve(snap, counters={**snap.counters, "micro_step": -2})
    target = build(5)
    before = everything(target)
    with pytest.raises(CheckpointError, match=r"invalid values in the snapshot:\n  counters.micro_step: -2"):
        af.restore(target, bad)
    assert same_tree(everything(target), before)


def _several(manifest: dict[str, Any]) -> None:
    manifest["counters"]["step"] = "2"
    del manifest["ranks"][0]["grads"]
    manifest["ranks"][0]["zz"] = 1
    manifest["files"]["model.safetensors"]["num_bytes"] = -4
    manifest["world_size"] = True


def test_every_problem_of_the_manifest_s_schema_is_named_at_once(saved) -> None:
    """A manifest with a str counter, a rank entry missing its gradients and holding an unknown
    key, a negative file size and a bool world size is refused with all five problems, each
    at its path, before anything changes."""
    path, _ = saved
    _edit(path, _several)
    _refused(path, build(99, extra=True), "ckpt: invalid values in manifest.json:\n"
             "  world_size: True (a bool), must be an int >= 1\n"
             "  counters.step: '2' (a str), must be an int >= 0\n"
             "  ranks[0].grads: missing\n"
             "  ranks[0]: unexpected keys: 'zz'\n"
             "  files.model.safetensors.num_bytes: -4 (an int), must be an int >= 0")


def test_a_scalar_optimizer_step_of_another_shape_is_refused_by_a_state_not_yet_trained(saved) -> None:
    """The issue's case: AdamW's scalar ``step`` of parameter 0 given the shape (1, 1, 1, 1, 1)
    in state.safetensors' header (its checksum recomputed) is refused by a freshly built state,
    whose optimizer holds no state yet: it is checked against the state AdamW would hold."""
    path, _ = saved
    data = (path / "state.safetensors").read_bytes()
    head, body = header(data)
    head["optimizer.state.0.step"]["shape"] = [1, 1, 1, 1, 1]
    for name, changed in signed({p.name: p.read_bytes() for p in path.iterdir()},
                                {"state.safetensors": safetensors_file(head, body)}).items():
        (path / name).write_bytes(changed)
    _refused(path, build(99, extra=True), "the checkpoint does not match the state it is loaded into:\n"
             "  optimizer.state[0].step: a float32 tensor of shape (1, 1, 1, 1, 1) in manifest.json, "
             "a float32 tensor of shape () here")


class Strict(Counter):
    """A Counter whose load_state_dict refuses a negative count (its own check)."""

    def load_state_dict(self, state: dict) -> None:
        if state["seen"] < 0:
            raise ValueError(f"seen must be >= 0, got {state['seen']}")
        super().load_state_dict(state)


def test_an_extra_object_refusing_its_state_is_a_checkpoint_error_and_nothing_else_changes(tmp_path) -> None:
    """An ``extra`` object whose own load_state_dict raises on the saved state: the load raises
    a CheckpointError naming it (the object's error in it), and the model, optimizer, counters
    and generators are as they were."""
    state = build(0)
    state = state.replace(step=0, extra={"strict": Strict()})
    state.extra["strict"].seen = -1
    path = af.save(state, tmp_path / "ckpt")
    target = build(99).replace(extra={"strict": Strict()})
    before = everything(target)
    with pytest.raises(CheckpointError, match=r"extra\['strict'\]\.load_state_dict refused the saved state: "
                                              r"ValueError: seen must be >= 0, got -1"):
        af.load(path, into=target)
    assert same_tree(everything(target), before)
