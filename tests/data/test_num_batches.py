"""``num_batches`` counts each rank's micro-batches of an epoch without building a loader:
exactly what ``epoch_batches`` then yields."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import accelfn as af
from accelfn.data import epoch_batches, num_batches


class _Stream(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(5))


@pytest.mark.parametrize("num_samples", [1, 5, 7, 12, 13])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_num_batches_is_what_epoch_batches_yields_on_every_rank(num_samples: int, world_size: int) -> None:
    """For map-style DataLoaders (shuffled or not, with or without the loader's drop_last) and
    sequences, under shard_data with its drop_last and even_batches options or without
    shard_data, on every rank, the count equals the batches the epoch yields."""
    dataset = TensorDataset(torch.arange(num_samples, dtype=torch.float32))
    shards = [None, *(af.shard_data(drop_last=d, even_batches=e, seed=1)
                      for d, e in itertools.product([False, True], [False, True]))]
    for shard, batch_size, shuffle, drop_last in itertools.product(shards, [1, 2, 5], [False, True], [False, True]):
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last)
        sequence = [dataset[i] for i in range(num_samples)]
        for data, rank in itertools.product([loader, sequence], range(world_size)):
            expected = sum(1 for _ in epoch_batches(data, shard, rank=rank, world_size=world_size, epoch=2))
            assert num_batches(data, shard, rank=rank, world_size=world_size) == expected, (
                shard, batch_size, shuffle, drop_last, type(data).__name__, rank)


def test_data_of_unknown_length_has_no_count() -> None:
    """An IterableDataset's DataLoader and a generator have no count in advance (None)."""
    for shard in (None, af.shard_data()):
        assert num_batches(DataLoader(_Stream(), batch_size=2), shard, rank=0, world_size=2) is None
        assert num_batches((x for x in range(3)), shard, rank=1, world_size=2) is None


def test_a_loader_shard_data_cannot_shard_is_refused_as_epoch_batches_refuses_it() -> None:
    """A DataLoader without batch_size under shard_data raises the ValueError epoch_batches raises."""
    loader = DataLoader(TensorDataset(torch.arange(4.0)), batch_size=None)
    with pytest.raises(ValueError, match="batch_size=None"):
        num_batches(loader, af.shard_data(), rank=0, world_size=2)
    with pytest.raises(ValueError, match="batch_size=None"):
        epoch_batches(loader, af.shard_data(), rank=0, world_size=2, epoch=0)
