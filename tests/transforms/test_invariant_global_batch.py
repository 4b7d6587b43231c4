"""``af.invariant(micro_batches_per_update=L)``: the global batch stated once, the accumulation
following the world size (``transforms.invariant_per_world``), for elastic jobs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import accelfn as af
from accelfn.checkpoint._format import same_program, transforms_record
from accelfn.transforms import invariant_per_world


def _loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _job(spec: af.Invariant, *extra: af.Transform) -> tuple[af.Step, af.TrainState, DataLoader]:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 6), torch.randint(0, 3, (64,)))
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(8, 3))
    state = af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    step = af.compose(spec, af.shard_data(seed=3), af.replicate(), *extra)(af.train_step(_loss))
    return step, state, DataLoader(data, batch_size=2, shuffle=True)


def test_the_accumulation_follows_the_world_size() -> None:
    """invariant(micro_batches_per_update=8) accumulates 8, 4, 2, 1 micro-batches on 1, 2, 4, 8
    processes; a world that does not divide 8, or an accumulate() of another count, is refused
    naming both; the same count is kept, and programs without the option are unchanged."""
    base = af.train_step(_loss)
    step = af.invariant(micro_batches_per_update=8)(base)
    assert [invariant_per_world(step, w).find(af.Accumulate) for w in (1, 2, 4, 8)] == [
        af.Accumulate(8), af.Accumulate(4), af.Accumulate(2), af.Accumulate(1)]
    with pytest.raises(af.TransformError, match="3 processes cannot share 8 micro-batches"):
        invariant_per_world(step, 3)
    with pytest.raises(af.TransformError, match=r"accumulates 4 .* has accumulate\(2\)"):
        invariant_per_world(af.accumulate(2)(step), 2)
    same = af.accumulate(4)(step)
    assert invariant_per_world(same, 2) is same
    plain = af.compose(af.invariant(), af.accumulate(3))(base)
    assert invariant_per_world(plain, 4) is plain
    with pytest.raises(ValueError, match="micro_batches_per_update"):
        af.invariant(micro_batches_per_update=0)


def test_stated_global_batch_trains_as_the_explicit_accumulation(cpu: af.backends.CPU) -> None:
    """A run under invariant(micro_batches_per_update=4) on one process is bit for bit the run
    under invariant() + accumulate(4), and count_updates and af.plan count its updates as run
    applies them (8 per epoch of 32 micro-batches); its step function runs accumulate(4)."""
    stated, state_a, loader = _job(af.invariant(micro_batches_per_update=4))
    explicit, state_b, _ = _job(af.invariant(), af.accumulate(4))
    counted = af.count_updates(stated, loader, backend=cpu, epochs=2)
    assert (counted.per_epoch, counted.total) == (8, 16)
    assert af.plan(stated, state_a, loader, backend=cpu, epochs=2, trace=False).total_updates == 16
    a = af.run(stated, state_a, loader, backend=cpu, epochs=2, progress=False)
    b = af.run(explicit, state_b, loader, backend=cpu, epochs=2, progress=False)
    assert (a.step, a.micro_step) == (b.step, b.micro_step) == (16, 64)
    for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()):
        assert torch.equal(x, y)
    _, fn = cpu.prepare(stated, _job(af.invariant(micro_batches_per_update=4))[1])
    assert fn.step.find(af.Accumulate) == af.Accumulate(4)


def test_a_resume_on_another_world_under_invariant_does_not_warn(tmp_path: Path) -> None:
    """A checkpoint's program and the resuming one under invariant() differ only in
    accumulate's count on another world size: the same run (invariant checks the global
    batch itself), so no "written by a program with the transforms" warning; any other
    difference, or accumulate without invariant(), still reads as another program."""
    two = invariant_per_world(_job(af.invariant(micro_batches_per_update=8))[0], 2)
    four = invariant_per_world(_job(af.invariant(micro_batches_per_update=8))[0], 4)
    assert same_program(transforms_record(two), transforms_record(four))
    other_seed = invariant_per_world(_job(af.invariant(seed=1, micro_batches_per_update=8))[0], 4)
    assert not same_program(transforms_record(two), transforms_record(other_seed))
    plain = af.compose(af.replicate(), af.accumulate(2))(af.train_step(_loss))
    assert not same_program(transforms_record(plain), transforms_record(af.accumulate(4)(af.replicate()(
        af.train_step(_loss)))))
