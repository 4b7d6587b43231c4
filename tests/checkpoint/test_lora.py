"""LoRA (peft) checkpoints write the frozen base once per run, and exports in PEFT's layout
and merged under the base model's names load with peft and transformers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

import accelfn as af
from accelfn.errors import CheckpointError
from tests.helpers import lora
from tests.helpers.pool import Pools

FROZEN = "frozen.safetensors"


def _prepared(state=None):
    state = state if state is not None else lora.state()
    return af.backends.CPU().prepare(af.train_step(lora.loss_fn), state)


def _train(state, step_fn, batches):
    for batch in batches:
        state, _ = step_fn(state, batch)
    return state


def _assert_bitwise(a, b) -> None:
    for (name, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(x, y), name
    for x, y in zip(a.optimizer.state.values(), b.optimizer.state.values()):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_a_checkpoint_after_the_first_writes_only_the_adapters_optimizer_and_manifest(tmp_path: Path) -> None:
    """With a LoRA adapter, the first checkpoint writes the frozen base (frozen.safetensors);
    each later one writes exactly the bytes of its adapter (model.safetensors), optimizer
    (state.safetensors) and manifest files, its frozen file a hard link to the first's; the
    run resumed from the second checkpoint ends bitwise equal to the uninterrupted run."""
    data = lora.batches(6)
    checkpoints = af.Checkpoints(tmp_path / "ckpt")
    state, step_fn = _prepared()
    written = {}
    for i, batch in enumerate(data[:4]):
        state, _ = step_fn(state, batch)
        before = lora.io_written()
        path = checkpoints.save(state)
        written[i + 1] = (lora.io_written() - before, path)
    first, second = checkpoints.path_for(1), checkpoints.path_for(2)
    frozen_bytes = (first / FROZEN).stat().st_size
    assert frozen_bytes > 10 * (second / "model.safetensors").stat().st_size  # the base dwarfs the adapter
    assert written[1][0] >= frozen_bytes
    for step in (2, 3, 4):
        count, path = written[step]
        own = {p.name: p.stat().st_size for p in path.iterdir() if p.name != FROZEN}
        assert sorted(own) == ["manifest.json", "manifest.sha256", "model.safetensors", "state.safetensors"]
        assert count == sum(own.values()), (step, count, own)
        assert (path / FROZEN).stat().st_ino == (first / FROZEN).stat().st_ino
    assert (first / FROZEN).stat().st_nlink == 4
    keys = set(af.checkpoint._tensorfiles.read(second, af.checkpoint._format.read(second).files)["model"])
    assert keys == set(state.model.state_dict())

    uninterrupted = _train(state, step_fn, data[4:])
    resumed, resumed_fn = _prepared()
    resumed = af.load(second, into=resumed)
    assert resumed.step == 2
    resumed = _train(resumed, resumed_fn, data[2:])
    _assert_bitwise(uninterrupted, resumed)


def test_retention_keeps_the_frozen_file_of_a_deleted_checkpoint(tmp_path: Path) -> None:
    """With keep=1 each new checkpoint replaces the last; the frozen file written at step 1
    lives on in step 3's checkpoint (a link), which loads bitwise."""
    checkpoints = af.Checkpoints(tmp_path / "ckpt", keep=1)
    state, step_fn = _prepared()
    for batch in lora.batches(3):
        state, _ = step_fn(state, batch)
        checkpoints.save(state)
    assert checkpoints.steps() == [3]
    loaded = af.load(checkpoints.latest(), into=_prepared()[0])
    _assert_bitwise(state, loaded)


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_missing_or_corrupt_linked_base_file_is_refused_naming_it(tmp_path: Path, damage: str) -> None:
    """A later checkpoint whose linked frozen file is missing or corrupted is refused by a
    CheckpointError naming that file; nothing is loaded."""
    checkpoints = af.Checkpoints(tmp_path / "ckpt")
    state, step_fn = _prepared()
    for batch in lora.batches(2):
        state, _ = step_fn(state, batch)
        checkpoints.save(state)
    target = checkpoints.path_for(2) / FROZEN
    if damage == "missing":
        target.unlink()
    else:
        data = bytearray(target.read_bytes())
        data[-3] ^= 0xFF
        target.unlink()  # a new file, so that step 1's stays intact
        target.write_bytes(bytes(data))
    into = _prepared()[0]
    before = {k: v.clone() for k, v in into.model.state_dict().items()}
    with pytest.raises(CheckpointError, match=str(target)):
        af.load(checkpoints.path_for(2), into=into)
    assert all(torch.equal(before[k], v) for k, v in into.model.state_dict().items())
    af.load(checkpoints.path_for(1), into=into)  # the first is intact


def test_a_frozen_tensor_that_changed_is_written_again(tmp_path: Path) -> None:
    """A frozen base weight changed between checkpoints (edited by hand) gives a frozen file
    of other content, written afresh rather than linked, and the checkpoint loads it."""
    checkpoints = af.Checkpoints(tmp_path / "ckpt")
    state, step_fn = _prepared()
    data = lora.batches(2)
    state, _ = step_fn(state, data[0])
    checkpoints.save(state)
    base = state.model.get_base_model().model.layers[0].mlp.up_proj.weight
    with torch.no_grad():
        base.add_(1.0)
    state, _ = step_fn(state, data[1])
    checkpoints.save(state)
    one, two = checkpoints.path_for(1) / FROZEN, checkpoints.path_for(2) / FROZEN
    assert one.stat().st_ino != two.stat().st_ino
    loaded = af.load(checkpoints.path_for(2), into=_prepared()[0])
    _assert_bitwise(state, loaded)


def test_adapter_and_merged_exports_reload_with_peft_and_transformers(tmp_path: Path) -> None:
    """After 3 updates, save_model(adapters="peft") writes PEFT's layout, which
    PeftModel.from_pretrained loads onto a fresh base, and adapters="merged" the merged
    model with its config.json, which AutoModelForCausalLM.from_pretrained loads; each gives
    the trained model's logits (<= 1e-6, fp32); the state is untouched."""
    state, step_fn = _prepared()
    state = _train(state, step_fn, lora.batches(3))
    before = {k: v.clone() for k, v in state.model.state_dict().items()}
    expected = lora.logits(state.model)
    assert not torch.allclose(expected, lora.logits(lora.base()), atol=1e-3)  # the adapter matters
    adapter = af.save_model(state, tmp_path / "adapter", adapters="peft")
    merged = af.save_model(state, tmp_path / "merged", adapters="merged")
    assert sorted(os.listdir(adapter)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert sorted(os.listdir(merged)) == ["config.json", "model.safetensors"]
    peft_logits, merged_logits = lora.reloaded(adapter, merged)
    assert (peft_logits - expected).abs().max() <= 1e-6
    assert (merged_logits - expected).abs().max() <= 1e-6
    assert all(torch.equal(before[k], v) for k, v in state.model.state_dict().items())


def test_save_model_adapters_refuses_bad_values_and_models_without_adapters(tmp_path: Path) -> None:
    """adapters= other than None/"peft"/"merged", or for a model that is not a PeftModel,
    is a ValueError saying what is accepted; nothing is written."""
    with pytest.raises(ValueError, match="'peft'.*'merged'"):
        af.save_model(lora.state(), tmp_path / "a", adapters="lora")
    plain = lora.base()
    with pytest.raises(ValueError, match="not a peft.PeftModel"):
        af.save_model(af.TrainState.create(plain, torch.optim.SGD(plain.parameters(), lr=0.1)), tmp_path / "b",
                      adapters="merged")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.multiprocess
def test_exports_of_a_sharded_and_a_tensor_parallel_lora_model_reload_with_peft_and_transformers(
        pool: Pools, tmp_path: Path) -> None:
    """On 2 processes, under shard_params() and under tensor_parallel (MLP split, adapters
    whole), the adapter export loads with PeftModel.from_pretrained and the merged one with
    AutoModelForCausalLM.from_pretrained, each giving the trained model's logits (<= 1e-6)."""
    pool.launch("--nproc-per-node", "2", script="lora_exports.py", script_args=(tmp_path,))
    for mode in ("fsdp", "tp"):
        expected = safetensors.torch.load_file(tmp_path / mode / "logits.safetensors")["logits"]
        peft_logits, merged_logits = lora.reloaded(tmp_path / mode / "adapter", tmp_path / mode / "merged")
        assert (peft_logits - expected).abs().max() <= 1e-6, mode
        assert (merged_logits - expected).abs().max() <= 1e-6, mode


@pytest.mark.parametrize("asynchronous", [False, True])
def test_run_checkpoints_link_the_frozen_base_also_in_the_background(tmp_path: Path, asynchronous: bool) -> None:
    """run's checkpoints (every update; written in the background or not) hold one frozen
    file between them: every later checkpoint's is a hard link to the first's."""
    state = lora.state()
    step = af.train_step(lora.loss_fn)
    checkpoints = af.Checkpoints(tmp_path / "ckpt", every_steps=1, asynchronous=asynchronous)
    af.run(step, state, lora.batches(3), backend=af.backends.CPU(), epochs=1, checkpoints=checkpoints,
           progress=False)
    assert checkpoints.steps() == [1, 2, 3]
    inodes = {(checkpoints.path_for(s) / FROZEN).stat().st_ino for s in (1, 2, 3)}
    assert len(inodes) == 1
