"""``shard_data``: each process reads its own shard of every epoch."""

from __future__ import annotations

from typing import ClassVar

import attrs

from accelfn.errors import boolean, non_negative_int
from accelfn.step import Phase, TransformBase
from accelfn.transforms.replicate import Replicate
from accelfn.transforms.shard_params import ShardParams


@attrs.frozen
class ShardData(TransformBase):
    """Each process reads its own shard of every epoch (``torch.utils.data.DistributedSampler``).

    Attributes:
        seed: base of the shuffle; epoch ``e`` uses ``seed + e`` on every rank.
        drop_last: drop the tail that does not divide evenly by the world size instead of
            padding it by wrapping around.
        even_batches: pad (by wrapping) so every rank runs the same number of batches.
            ``False`` keeps each sample exactly once, so ranks may differ by one batch; it
            cannot be combined with ``replicate()`` or ``shard_params()``, whose collectives
            would wait forever.
        split_batches: the DataLoader's ``batch_size`` is the global batch, split over the
            ranks (Accelerate's ``split_batches``): rank ``r`` reads samples
            ``[r * b, (r + 1) * b)`` of every global batch, ``b = batch_size / world_size``,
            so the union of the ranks' ``k``-th micro-batches is the ``k``-th batch the
            DataLoader would give in one process (same shuffle); the last, partial batch is
            split as evenly as possible (padded by wrapping as above, or cut with
            ``drop_last``). Needs a DataLoader over a map-style dataset whose
            ``batch_size`` divides by the world size.
    """

    phase: ClassVar[Phase] = Phase.DATA
    kind: ClassVar[str] = "shard_data"
    verb: ClassVar[str] = "shard_data"

    seed: int = attrs.field(default=0, validator=non_negative_int)
    drop_last: bool = attrs.field(default=False, validator=boolean)
    even_batches: bool = attrs.field(default=True, validator=boolean)
    split_batches: bool = attrs.field(default=False, validator=boolean)

    def conflicts_with(self, other: TransformBase) -> str | None:
        if self.even_batches or self.drop_last:
            return None
        if isinstance(other, Replicate):
            waits = "replicate()'s gradient all-reduce"
        elif isinstance(other, ShardParams):
            waits = "shard_params()'s parameter all-gathers"
        else:
            return None
        return (
            "shard_data(even_batches=False) lets ranks run different numbers of batches, "
            f"so {waits} would hang; keep even_batches=True (pad by wrapping) or use drop_last=True"
        )


def shard_data(*, seed: int = 0, drop_last: bool = False, even_batches: bool = True,
               split_batches: bool = False) -> ShardData:
    """Each process reads its own shard of every epoch; see :class:`ShardData`.

    Args:
        seed: base of the shuffle, agreed by all ranks; epoch ``e`` shuffles with ``seed + e``.
        drop_last: drop the tail that does not divide by the world size (default: pad it).
        even_batches: pad so that every rank runs the same number of batches (default True).
        split_batches: the DataLoader's batch is the global batch, split over the ranks
            (default False: it is each rank's batch).

    Returns:
        ShardData: the transform.

    Raises:
        ValueError: ``seed`` negative.
        TypeError: a flag that is not a bool, or ``seed`` not an int.

    Example:
        >>> import accelfn as af
        >>> af.shard_data(seed=1)
        ShardData(seed=1, drop_last=False, even_batches=True, split_batches=False)
    """
    return ShardData(seed=seed, drop_last=drop_last, even_batches=even_batches, split_batches=split_batches)
