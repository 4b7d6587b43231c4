"""``shard_data(split_batches=True)``: the DataLoader's batch is the global batch; rank ``r``
reads its contiguous part of every batch (each rank's batches built here, for every rank of
worlds of 2, 3 and 4 processes, against the batches of the same loader on one process)."""

from __future__ import annotations

import itertools

import pytest
from torch.utils.data import DataLoader

import accelfn as af
from accelfn.data import epoch_batches, num_batches
from tests.helpers import programs as P


def rank_batches(loader: DataLoader, shard: af.ShardData, world_size: int, epoch: int = 0) -> list[list[list[int]]]:
    """Each rank's index batches of ``epoch``; each rank's count is the one num_batches predicts."""
    ranks = []
    for rank in range(world_size):
        batches = [index.tolist() for (_, index), _ in epoch_batches(loader, shard, rank=rank, world_size=world_size,
                                                                      epoch=epoch)]
        assert num_batches(loader, shard, rank=rank, world_size=world_size) == len(batches)
        ranks.append(batches)
    return ranks


@pytest.mark.parametrize("world_size,num_samples", [(2, 28), (2, 29), (3, 31), (4, 22), (4, 13), (4, 2)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_the_ranks_parts_of_each_batch_make_the_one_process_batch(world_size, num_samples, shuffle):
    """Full batches: rank r holds samples [r*b, (r+1)*b) of the one-process batch. The last,
    partial batch of m samples: contiguous parts of ceil(m/W) or one fewer; with
    even_batches (the default) each shorter part ends with one sample wrapped from the
    epoch's start (DistributedSampler's padding, on the ranks m % W, ...)."""
    batch = 2 * world_size
    loader = DataLoader(P.IndexDataset(num_samples), batch_size=batch, shuffle=shuffle)
    shard = af.shard_data(seed=5, split_batches=True)
    (whole,) = rank_batches(loader, shard, 1, epoch=3)
    assert sorted(itertools.chain(*whole)) == list(range(num_samples))
    ranks = rank_batches(loader, shard, world_size, epoch=3)
    assert len({len(r) for r in ranks}) == 1 == len({len(r[:-1]) for r in ranks})
    full, m = divmod(num_samples, batch)
    for k in range(full):
        assert [i for r in ranks for i in r[k]] == whole[k]
        assert all(len(r[k]) == 2 for r in ranks)
    if m:
        share, extra = divmod(m, world_size)
        real = [r[-1][:share + (rank < extra)] for rank, r in enumerate(ranks)]
        assert [i for part in real for i in part] == whole[-1]
        for rank, r in enumerate(ranks):
            padding = r[-1][len(real[rank]):]
            assert padding == ([whole[0][rank - extra]] if extra and rank >= extra else [])


@pytest.mark.parametrize("world_size,num_samples", [(2, 29), (4, 22), (4, 13)])
def test_drop_last_options_and_uneven_batches(world_size, num_samples):
    """The DataLoader's drop_last drops the partial global batch; shard_data(drop_last=True)
    cuts every rank's part of it to m // W; even_batches=False keeps it as it falls (each
    sample once, a rank may run one batch fewer)."""
    batch = 2 * world_size
    full, m = divmod(num_samples, batch)
    kept = DataLoader(P.IndexDataset(num_samples), batch_size=batch, drop_last=True)
    assert all(len(r) == full for r in rank_batches(kept, af.shard_data(split_batches=True), world_size))

    loader = DataLoader(P.IndexDataset(num_samples), batch_size=batch)
    cut = rank_batches(loader, af.shard_data(split_batches=True, drop_last=True), world_size)
    share = m // world_size
    assert all(len(r) == full + (share > 0) for r in cut)
    assert [i for r in cut for i in (r[-1] if share else [])] == [
        full * batch + rank * share + j for rank in range(world_size) for j in range(share)]

    uneven = rank_batches(loader, af.shard_data(split_batches=True, even_batches=False), world_size)
    assert sorted(i for r in uneven for b in r for i in b) == list(range(num_samples))
    assert {len(r) for r in uneven} <= {full, full + 1}


def test_count_updates_and_run_agree_with_the_split(cpu):
    """On one process split_batches reads the loader's batches whole: 5 batches of 6, 6, 6, 6, 4."""
    step = af.compose(af.shard_data(split_batches=True), af.accumulate(2))(af.train_step(P.mse))
    loader = DataLoader(P.regression_data(), batch_size=6)
    assert af.count_updates(step, loader, backend=cpu, epochs=2) == af.UpdateCount(
        per_epoch=3, total=6, micro_batches_per_epoch=5)
    assert af.run(step, P.make_state(), loader, backend=cpu, epochs=2, progress=False).step == 6


def test_what_split_batches_cannot_split_is_refused_before_training(cpu):
    step = af.shard_data(split_batches=True)(af.train_step(P.mse))
    with pytest.raises(ValueError, match=r"batch_size=6 does not divide by 4; build the DataLoader with a batch "
                                         r"size that is a multiple of 4"):
        num_batches(DataLoader(P.IndexDataset(12), batch_size=6), step.transforms[0], rank=0, world_size=4)
    with pytest.raises(ValueError, match=r"split_batches=True\) splits the batches of a DataLoader over a map-style"):
        epoch_batches(DataLoader(P.CountingStream(8), batch_size=4), step.transforms[0], rank=0, world_size=2,
                      epoch=0)
    with pytest.raises(ValueError, match=r"split_batches=True\) splits the batches of a DataLoader over a map-style"):
        af.count_updates(step, [P.regression_data(4)[:]] * 3, backend=cpu)
    with pytest.raises(TypeError):
        af.shard_data(split_batches=1)  # type: ignore[arg-type]
