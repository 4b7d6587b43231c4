"""Data: each rank's batches of an epoch (sharding as ``DistributedSampler``, resumable
position, even batches across ranks, per-batch worker seeding) and the keyed stream
``evaluate`` reads."""

from accelfn.data.batches import (
    EpochBatches,
    ShardedIterable,
    epoch_batches,
    even_out,
    keyed_batches,
    num_batches,
    shard_indices,
    split_indices,
)

__all__ = ["EpochBatches", "ShardedIterable", "epoch_batches", "even_out", "keyed_batches", "num_batches",
           "shard_indices", "split_indices"]
