"""Data: each rank's batches of an epoch (sharding as ``DistributedSampler``, resumable
position, even batches across ranks, per-batch worker seeding), streams split over
processes x workers whose readers' state checkpoints carry, and the keyed stream
``evaluate`` reads."""

from accelfn.data.batches import (
    EpochBatches,
    epoch_batches,
    even_out,
    keyed_batches,
    num_batches,
    shard_indices,
    split_indices,
)
from accelfn.data.streams import Readers, ShardedIterable

__all__ = ["EpochBatches", "Readers", "ShardedIterable", "epoch_batches", "even_out", "keyed_batches", "num_batches",
           "shard_indices", "split_indices"]
