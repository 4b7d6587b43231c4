"""A run stopped mid-epoch and continued reads exactly the batches of an uninterrupted run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import accelfn as af


class Augmented(Dataset):
    """Sample i is i plus uniform noise drawn from torch's global RNG (an augmentation)."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int):
        return torch.full((2,), float(i)) + torch.rand(2), torch.zeros(1)


def batches_read(loader, *, stop_at=None, shard=True):
    """The inputs loss_fn sees over 2 epochs, optionally stopping at ``stop_at`` updates and
    continuing with a second ``run`` from a snapshot of the state."""
    seen = []

    def loss_fn(model, batch):
        seen.append(batch[0].clone())
        return F.mse_loss(model(batch[0]), batch[1])

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.0))
    step = af.train_step(loss_fn)
    if shard:
        step = af.shard_data()(step)
    cpu = af.backends.CPU(af.backends.LaunchEnv())
    if stop_at is not None:
        state = af.run(step, state, loader, backend=cpu, epochs=2, max_steps=stop_at, progress=False)
        snap = af.snapshot(state)  # as a checkpoint would: counters, RNG, ...
        torch.manual_seed(123)  # whatever the global RNG does in between
        state = af.restore(state, snap)
    af.run(step, state, loader, backend=cpu, epochs=2, progress=False)
    return seen


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resumed_epoch_reads_the_same_augmented_batches(num_workers):
    """With shard_data, a continued run reads the same (randomly augmented) batches as an
    uninterrupted one, also when DataLoader workers draw the augmentation."""
    loader = DataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=num_workers)
    whole = batches_read(loader)
    resumed = batches_read(loader, stop_at=5)
    assert len(whole) == len(resumed) == 16
    for a, b in zip(whole, resumed):
        assert torch.equal(a, b)


def test_workers_do_not_change_the_augmentation():
    """Each batch's random draws depend on its place in the epoch, not on the worker count."""
    draws = [batches_read(DataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=w)) for w in (1, 2)]
    assert all(torch.equal(a, b) for a, b in zip(*draws))


def test_resuming_a_shuffled_loader_without_shard_data_warns():
    """Without shard_data a shuffled DataLoader cannot replay its order, and says so."""
    loader = DataLoader(TensorDataset(torch.randn(20, 2), torch.zeros(20, 1)), batch_size=4, shuffle=True)
    with pytest.warns(RuntimeWarning, match=r"resuming at micro-batch 2 of epoch 1 .*af.shard_data\(\)"):
        batches_read(loader, stop_at=7, shard=False)
