"""Resume is invisible: a run saved and resumed ends bitwise where an uninterrupted one does."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import accelfn as af
from tests.helpers.states import assert_same_state, build, loader, program

# these tests stop the 15-update job of ``states.build`` part-way (``max_steps``) to resume or inspect
# it: the plan of such a run rightly warns that its cosine schedule stops part-way, and that is expected
pytestmark = pytest.mark.filterwarnings(r"ignore:\[scheduler-not-finished\]:accelfn.errors.PlanWarning")


def _perturb_global_rng() -> None:
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    torch.rand(100), random.random(), np.random.rand(3)


def test_resume_at_step_7_of_15_is_bitwise(cpu, tmp_path) -> None:
    """Saving at step 7 of a 15-step, 3-epoch run (shard_data shuffle, dropout, AdamW, cosine
    lr, accumulate(2), clip), perturbing the global RNG and loading into a freshly built
    state finishes with parameters, optimizer state, lr and RNG bitwise equal to the
    uninterrupted run."""
    step, data = program(), loader()
    uninterrupted = af.run(step, build(0), data, backend=cpu, epochs=3, progress=False)
    rng_after = torch.get_rng_state()
    assert uninterrupted.step == 15

    first = af.run(step, build(0), data, backend=cpu, epochs=3, max_steps=7, progress=False)
    assert (first.step, first.epoch, first.epoch_micro_step) == (7, 1, 4)  # mid-epoch
    af.save(first, tmp_path / "ckpt")
    _perturb_global_rng()
    fresh = build(99)
    assert not torch.equal(fresh.model.fc1.weight, first.model.fc1.weight)
    resumed = af.load(tmp_path / "ckpt", into=fresh)
    assert (resumed.step, resumed.epoch, resumed.epoch_micro_step) == (7, 1, 4)
    resumed = af.run(step, resumed, data, backend=cpu, epochs=3, progress=False)

    assert_same_state(resumed, uninterrupted)
    assert resumed.optimizer.param_groups[0]["lr"] == uninterrupted.optimizer.param_groups[0]["lr"]
    assert torch.equal(torch.get_rng_state(), rng_after)


@pytest.mark.parametrize("via", ["snapshot", "checkpoint"])
def test_resume_mid_accumulation_window_is_bitwise(cpu, tmp_path, via) -> None:
    """A state captured after the first micro-batch of an accumulation window (gradients
    accumulated, window open) and restored into a fresh state continues bitwise like the
    original."""
    step, data = program(), loader()
    state, step_fn = cpu.prepare(step, build(0))
    batches = iter(cpu.batches(data, step, 0))
    for _ in range(5):
        batch, last = next(batches)
        state, _ = step_fn(state, batch, flush=last)
    assert "window" in state.transforms_state and state.model.fc1.weight.grad is not None
    if via == "snapshot":
        saved = af.snapshot(state)
    else:
        af.save(state, tmp_path / "ckpt")
    for batch, last in batches:
        state, _ = step_fn(state, batch, flush=last)

    _perturb_global_rng()
    fresh, fresh_fn = cpu.prepare(step, build(99))
    if via == "snapshot":
        fresh = af.restore(fresh, saved)
    else:
        fresh = af.load(tmp_path / "ckpt", into=fresh)
    assert fresh.epoch_micro_step == 5 and "window" in fresh.transforms_state
    for batch, last in cpu.batches(data, step, 0, start=fresh.epoch_micro_step):
        fresh, _ = fresh_fn(fresh, batch, flush=last)
    assert_same_state(fresh, state)


@pytest.mark.parametrize("via", ["snapshot", "checkpoint"])
def test_fp16_resume_keeps_the_loss_scale_and_is_bitwise(cpu, tmp_path, via) -> None:
    """An fp16 run whose loss scale has grown continues, after a snapshot or a checkpoint is
    restored into a fresh state, with the same scale and growth tracker and bitwise equal
    to the uninterrupted run."""
    step, data = program(af.with_precision("fp16", growth_interval=2)), loader()
    uninterrupted = af.run(step, build(0), data, backend=cpu, epochs=2, progress=False)

    first = af.run(step, build(0), data, backend=cpu, epochs=2, max_steps=5, progress=False)
    scale = first.transforms_state["loss_scale"]
    assert (scale.scale, scale.growth_tracker) == (2.0**18, 1)  # grew at steps 2 and 4
    saved = af.snapshot(first) if via == "snapshot" else af.save(first, tmp_path / "ckpt")
    _perturb_global_rng()
    fresh = af.restore(build(99), saved) if via == "snapshot" else af.load(saved, into=build(99))
    assert fresh.transforms_state["loss_scale"] == scale
    assert fresh.transforms_state["skips"] == first.transforms_state["skips"]
    resumed = af.run(step, fresh, data, backend=cpu, epochs=2, progress=False)
    assert_same_state(resumed, uninterrupted)


def test_checkpoints_keep_the_last_two_and_auto_resume_continues(cpu, tmp_path) -> None:
    """Checkpoints(every_steps=2, keep=2) over 10 steps leaves exactly step 8 and step 10, and
    run(resume="auto") from a fresh state continues from step 10 to the same end as an
    uninterrupted 15-step run."""
    step, data = program(), loader()
    checkpoints = af.Checkpoints(tmp_path / "ckpts", every_steps=2, keep=2)
    ten = af.run(step, build(0), data, backend=cpu, epochs=2, checkpoints=checkpoints, progress=False)
    assert ten.step == 10
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == ["step_00000008", "step_00000010"]
    assert checkpoints.latest() == tmp_path / "ckpts" / "step_00000010"

    _perturb_global_rng()
    resumed = af.run(step, build(99), data, backend=cpu, epochs=3, checkpoints=checkpoints, resume="auto",
                     progress=False)
    uninterrupted = af.run(step, build(0), data, backend=cpu, epochs=3, progress=False)
    assert_same_state(resumed, uninterrupted)
    assert checkpoints.steps() == [12, 14]


def test_auto_resume_without_checkpoints_starts_fresh(cpu, tmp_path) -> None:
    """resume="auto" with an empty checkpoint directory trains from the given state."""
    step, data = program(), loader()
    fresh = af.run(step, build(0), data, backend=cpu, epochs=1, progress=False,
                   checkpoints=af.Checkpoints(tmp_path / "none"), resume="auto")
    plain = af.run(step, build(0), data, backend=cpu, epochs=1, progress=False)
    assert_same_state(fresh, plain)


def _untouched(state: af.TrainState, seed: int) -> bool:
    """True if ``state`` is still a freshly built ``build(seed)``: parameters, counters, no optimizer state."""
    fresh = build(seed)
    return (all(torch.equal(a, b) for a, b in zip(state.model.state_dict().values(), fresh.model.state_dict().values()))
            and (state.step, state.micro_step, state.epoch, state.epoch_micro_step) == (0, 0, 0, 0)
            and not state.optimizer.state)


def test_resuming_beyond_the_epoch_is_refused_before_the_state_changes(cpu, tmp_path, capsys) -> None:
    """A checkpoint at micro-batch 8 of an epoch resumed on data with 3 micro-batches per epoch
    (a DataLoader with shard_data, or a plain list) raises a ValueError that says what probably
    changed and what to do, before the state changes or run announces the resume."""
    checkpoints = af.Checkpoints(tmp_path / "loader", every_steps=4)
    af.run(program(), build(0), loader(), backend=cpu, max_steps=4, checkpoints=checkpoints, progress=False)
    target = build(99)
    with pytest.raises(ValueError) as error:
        af.run(program(), target, loader(12), backend=cpu, resume=checkpoints.latest(), progress=False)
    assert str(error.value) == (
        "cannot resume at micro-batch 8 of epoch 0: the data has 3 micro-batches per epoch on this process. The "
        "batch size or the dataset probably differs from the run that wrote the checkpoint (on 1 process, as this "
        "run); resume with the same data and batch size, or start a fresh run (without resume=...)")
    assert _untouched(target, 99) and "resumed" not in capsys.readouterr().err

    step = af.train_step(lambda model, batch: torch.nn.functional.cross_entropy(model(batch[0]), batch[1]))
    batches = list(loader())
    checkpoints = af.Checkpoints(tmp_path / "list", every_steps=8)
    af.run(step, build(0), batches, backend=cpu, max_steps=8, checkpoints=checkpoints, progress=False)
    target = build(99)
    with pytest.raises(ValueError, match=r"^cannot resume at micro-batch 8 of epoch 0: the data has 3 micro-batches"):
        af.run(step, target, batches[:3], backend=cpu, resume=checkpoints.latest(), progress=False)
    assert _untouched(target, 99) and "resumed" not in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^cannot resume at micro-batch 8 of an epoch of 3 micro-batches \(on this "
                                         r"process\): the batch size, the dataset or the number of processes"):
        cpu.batches(batches[:3], step, 0, start=8)


def test_a_checkpoint_at_the_end_of_an_epoch_starts_the_next(cpu, tmp_path) -> None:
    """The checkpoint saved after an epoch's last update records the next epoch at micro-batch
    0, and a run resumed from it ends bitwise where the uninterrupted one does."""
    step, data = program(), loader()
    checkpoints = af.Checkpoints(tmp_path, every_steps=5)
    uninterrupted = af.run(step, build(0), data, backend=cpu, epochs=2, checkpoints=checkpoints, progress=False)
    counters = af.load(checkpoints.path_for(5), into=build(0))
    assert (counters.step, counters.micro_step, counters.epoch, counters.epoch_micro_step) == (5, 10, 1, 0)
    resumed = af.run(step, build(99), data, backend=cpu, epochs=2, resume=checkpoints.path_for(5), progress=False)
    assert_same_state(resumed, uninterrupted)


def test_auto_resume_from_a_corrupted_checkpoint_names_it_and_the_previous_one(cpu, tmp_path) -> None:
    """resume="auto" whose latest checkpoint has a flipped byte fails (it is not skipped),
    naming that checkpoint and the previous one to resume from; with no previous one, it says
    to start a fresh run."""
    step, data = program(), loader()
    checkpoints = af.Checkpoints(tmp_path, every_steps=2)
    af.run(step, build(0), data, backend=cpu, max_steps=4, checkpoints=checkpoints, progress=False)
    tensors = checkpoints.path_for(4) / "model.safetensors"
    corrupted = bytearray(tensors.read_bytes())
    corrupted[-1] ^= 1
    tensors.write_bytes(bytes(corrupted))
    with pytest.raises(af.CheckpointError) as error:
        af.run(step, build(99), data, backend=cpu, epochs=1, checkpoints=checkpoints, resume="auto", progress=False)
    message = str(error.value)
    assert message.startswith(f"{tensors}: xxh3_128 ")
    assert message.endswith(
        f"\nrun(resume='auto'): the latest checkpoint, {checkpoints.path_for(4)}, failed to load; it is not skipped, "
        f"since that could hide a bug. If it is damaged, resume from the previous one with "
        f"run(resume='{checkpoints.path_for(2)}', ...) or move {checkpoints.path_for(4)} aside so that "
        "resume='auto' takes it")
    resumed = af.run(step, build(99), data, backend=cpu, max_steps=3, resume=checkpoints.path_for(2), progress=False)
    assert resumed.step == 3

    checkpoints = af.Checkpoints(tmp_path / "one", every_steps=2)
    af.run(step, build(0), data, backend=cpu, max_steps=2, checkpoints=checkpoints, progress=False)
    (checkpoints.path_for(2) / "manifest.json").write_bytes(b"{}")
    with pytest.raises(af.CheckpointError, match=r"failed to load; it is not skipped, since that could hide a bug\. "
                                                 r"There is no earlier checkpoint: .* if the checkpoint is damaged, or "
                                                 r"to train this state from scratch, start a fresh run in another "
                                                 r"checkpoint directory than .*/one$"):
        af.run(step, build(99), data, backend=cpu, epochs=1, checkpoints=checkpoints, resume="auto", progress=False)
