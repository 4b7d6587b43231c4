"""The counts of a plan: per epoch and rank, the micro-batches, updates and samples ``run`` reads.

Pure arithmetic over the data's length, the sharding (``shard_data``'s padding, ``drop_last``,
``even_batches``, ``split_batches``), the DataLoader's batch size and ``drop_last``,
``accumulate(n)`` and the resume position, for any world size in one process: the same
arithmetic ``num_batches`` and ``count_updates`` use, extended to samples.

Per rank ``r`` of ``W`` over ``N`` samples (``DistributedSampler``'s rules, DESIGN.md §7.1):
``L_r = ceil(N / W)`` samples when padding (ranks ``r >= N mod W`` get one wrapped sample),
``ceil((N - W) / W)`` with ``drop_last`` (``N - W L`` dropped), ``|{r, r+W, ...} ∩ [0, N)|``
with ``even_batches=False``; the DataLoader cuts ``L_r`` into batches of ``B`` (dropping
``L_r mod B`` with its ``drop_last``). Updates from micro-batch ``s`` of an epoch of ``m``:
``ceil(m / n) - floor(s / n)`` (the partial last window is one more), capped by ``max_steps``;
``n`` is ``accumulate``'s, or a DeepSpeed config's ``gradient_accumulation_steps``.

``W`` and ``r`` are the data dimensions of the program's mesh (``distributed.mesh``), as the
run reads them: the ranks of one tensor-parallel group or one pipeline read the same shard,
so rank ``r`` reads data shard ``Mesh.data_coordinates(r)``. Under ``invariant()`` an epoch
is cut into blocks (``data.blocks``): ``floor(N / (W n b))`` updates of ``n`` micro-batches
of ``b`` samples per rank, nothing padded, the rest of the samples not read in that epoch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sized
from typing import Any

import attrs
from torch.utils.data import DataLoader, IterableDataset

from accelfn.data import blocks, num_batches
from accelfn.distributed.mesh import Mesh
from accelfn.state import TrainState
from accelfn.step import Step
from accelfn.transforms import Invariant, ShardData
from accelfn.transforms.deepspeed import micro_batches_per_update


@attrs.frozen
class EpochCounts:
    """What one epoch of the run does on each rank (tuples indexed by rank).

    Attributes:
        epoch: the epoch's number (``state.epoch`` counts from 0).
        micro_batches: micro-batches each rank reads in this run (after a resume position,
            before ``max_steps``), or None for data of unknown length.
        updates: optimizer updates each rank applies in this epoch, or None when unknown.
        samples: samples each rank reads, padding included, or None where a batch's size is
            not known in advance (an iterable of ready batches).
        padded: of those, samples added by wrapping (``shard_data``'s even batches), or None.
        dropped: samples of the dataset that no rank reads in a whole epoch (``drop_last`` of
            ``shard_data`` or of the DataLoader), or None when unknown.
        num_epochs: the consecutive epochs, from ``epoch`` on, that these counts stand for
            (whole epochs all alike, so a plan of a million epochs stays small).
    """

    epoch: int
    micro_batches: tuple[int | None, ...]
    updates: tuple[int | None, ...]
    samples: tuple[int | None, ...]
    padded: tuple[int | None, ...]
    dropped: int | None
    num_epochs: int = 1


@attrs.frozen
class _Layout:
    """One rank's epoch: micro-batches, the samples of a full one and of its last, its padding."""

    micro_batches: int | None
    batch: int | None  # samples of a full micro-batch
    last: int | None  # samples of the last micro-batch
    padded: int | None  # wrapped samples in the last micro-batch
    dropped: int | None  # the job's dropped samples (the same on every rank)


def _loader_samples(loader: DataLoader, shard: ShardData | None, rank: int, world_size: int) -> _Layout:
    n = len(loader.dataset)  # type: ignore[arg-type]  # map-style: sized
    mb = num_batches(loader, shard, rank=rank, world_size=world_size)
    assert mb is not None and loader.batch_size is not None
    big = loader.batch_size
    if shard is None:  # every rank reads the whole loader
        length, pad, sampler_dropped = n, 0, 0
    elif shard.split_batches:
        big //= world_size
        full, m = divmod(n, loader.batch_size)
        share, extra = divmod(m, world_size)
        tail = 0 if m == 0 or loader.drop_last else (
            share if shard.drop_last else share + 1 if extra and (shard.even_batches or rank < extra) else share)
        length = full * big + tail
        pad = int(bool(tail) and shard.even_batches and not shard.drop_last and extra > 0 and rank >= extra)
        dropped = (m if loader.drop_last else extra if shard.drop_last else 0)
        return _Layout(mb, big, tail if tail else min(big, length), pad, dropped)
    elif shard.drop_last and n % world_size:
        length = math.ceil((n - world_size) / world_size)
        pad, sampler_dropped = 0, n - length * world_size
    elif shard.even_batches or shard.drop_last:
        length = math.ceil(n / world_size)
        pad, sampler_dropped = int(bool(n % world_size) and rank >= n % world_size), 0
    else:
        length, pad, sampler_dropped = len(range(rank, n, world_size)), 0, 0
    cut = length % big if loader.drop_last else 0
    last = big if cut or length % big == 0 else length % big
    if cut:
        pad = 0  # the wrapped sample ends the rank's list, in the dropped part
    if shard is None:
        dropped = n % big if loader.drop_last else 0
    else:  # the wrapped samples repeat the epoch's first ones (never dropped but by a loader dropping all)
        kept = sum(_kept(length_r, big, loader.drop_last) - (pad_r if _kept(length_r, big, loader.drop_last) ==
                                                             length_r else 0)
                   for length_r, pad_r in _shard_lengths(n, shard, world_size))
        dropped = n - kept if sampler_dropped or loader.drop_last else 0
    return _Layout(mb, big, last if mb else 0, pad, dropped)


def _kept(length: int, batch: int, drop_last: bool) -> int:
    return length - length % batch if drop_last else length


def _shard_lengths(n: int, shard: ShardData, world_size: int) -> list[tuple[int, int]]:
    """(samples, wrapped samples not dropped...) of every rank, for the job's dropped count."""
    if shard.drop_last and n % world_size:
        return [(math.ceil((n - world_size) / world_size), 0)] * world_size
    if shard.even_batches or shard.drop_last:
        length = math.ceil(n / world_size)
        return [(length, int(bool(n % world_size) and r >= n % world_size)) for r in range(world_size)]
    return [(len(range(r, n, world_size)), 0) for r in range(world_size)]


def _layout(data: Iterable[Any], shard: ShardData | None, rank: int, world_size: int) -> _Layout:
    if isinstance(data, DataLoader):
        if isinstance(data.dataset, IterableDataset):
            num_batches(data, shard, rank=rank, world_size=world_size)  # its checks
            return _Layout(None, None, None, None, None)
        if data.batch_size is None:  # a custom batch sampler: batches only
            return _Layout(num_batches(data, shard, rank=rank, world_size=world_size), None, None, None, None)
        return _loader_samples(data, shard, rank, world_size)
    # ready batches (a list, a generator): their number, when known, not their sizes
    return _Layout(num_batches(data, shard, rank=rank, world_size=world_size), None, None, None, None)


def _blocks_layout(data: Iterable[Any], n: int, world_size: int) -> _Layout:
    """A rank's epoch under ``invariant()`` (``data.blocks``): whole global batches of ``W n b``
    samples, none padded, the incomplete last one not read."""
    mb = blocks.num_batches(data, world_size=world_size, num_micro_batches=n)  # type: ignore[arg-type]  # checks it
    assert isinstance(data, DataLoader)  # else num_batches raised
    b = data.batch_size
    assert b is not None
    size = len(data.dataset)  # type: ignore[arg-type]  # map-style: checked
    return _Layout(mb, b, b, 0, size - mb * world_size * b)


def _samples_read(layout: _Layout, start: int, read: int) -> tuple[int | None, int | None]:
    """Samples and wrapped samples in micro-batches ``[start, start + read)`` of the epoch."""
    if layout.batch is None or layout.micro_batches is None:
        return None, None
    mb = layout.micro_batches
    if read == 0:
        return 0, 0
    includes_last = start + read == mb
    assert layout.last is not None and layout.padded is not None
    samples = (read - 1) * layout.batch + (layout.last if includes_last else layout.batch)
    return samples, layout.padded if includes_last else 0


def epoch_counts(step: Step, state: TrainState, data: Iterable[Any], *, mesh: Mesh, epochs: int | None,
                 max_steps: int | None) -> tuple[tuple[EpochCounts, ...], tuple[int | None, ...]]:
    """Every epoch ``run`` trains from ``state`` on: the counts per rank of ``mesh`` (each rank
    reads the data shard of its data coordinates), and each rank's final step (None where the
    data's length is unknown and no ``max_steps`` bounds it).

    Raises:
        ValueError: data that cannot be sharded or cut as the program asks (the message says why).
    """
    shard = step.find(ShardData)
    n = micro_batches_per_update(step)
    invariant = step.find(Invariant) is not None
    world_size = mesh.world_size
    ranks = range(world_size)
    cache: dict[tuple[int, ...], _Layout] = {}

    def layout(rank: int) -> _Layout:
        data_rank, data_world = mesh.data_coordinates(rank)
        if invariant:  # every rank reads blocks of the same size
            key: tuple[int, ...] = (0,)
        elif shard is None or (shard.even_batches or shard.drop_last) and not shard.split_batches:
            key = (0,) if shard is None else (int(_is_padded(data, data_rank, data_world)),)
        else:
            key = (data_rank,)
        if key not in cache:
            cache[key] = (_blocks_layout(data, n, data_world) if invariant
                          else _layout(data, shard, data_rank, data_world))
        return cache[key]

    steps: list[int | None] = [state.step] * world_size
    result: list[EpochCounts] = []
    if state.stopped is not None or (max_steps is not None and state.step >= max_steps):
        return (), tuple(steps)
    epoch, start = state.epoch, state.epoch_micro_step
    while epochs is None or epoch < epochs:
        layouts = [layout(r) for r in ranks]
        if layouts[0].micro_batches is None:  # unknown length: until max_steps (or the data ends)
            result.append(EpochCounts(epoch, (None,) * world_size, (None,) * world_size, (None,) * world_size,
                                      (None,) * world_size, None))
            steps = [max_steps] * world_size
            break
        micro, updates, samples, padded = [], [], [], []
        for r in ranks:
            mb = layouts[r].micro_batches
            assert mb is not None
            done = steps[r]
            assert done is not None
            possible = 0 if start >= mb else math.ceil(mb / n) - start // n
            k = possible if max_steps is None else max(0, min(possible, max_steps - done))
            read = mb - start if k == possible else (start // n + k) * n - start
            read = max(read, 0)
            s, p = _samples_read(layouts[r], start, read)
            micro.append(read)
            updates.append(k)
            samples.append(s)
            padded.append(p)
            steps[r] = done + k
        if all(m == 0 for m in micro) and start == 0:
            result.append(EpochCounts(epoch, tuple(micro), tuple(updates), tuple(samples), tuple(padded),
                                      layouts[0].dropped))
            break  # an empty epoch: run warns and (without epochs) stops
        if max_steps is not None and all(s is not None and s >= max_steps for s in steps):
            result.append(EpochCounts(epoch, tuple(micro), tuple(updates), tuple(samples), tuple(padded),
                                      layouts[0].dropped))
            break
        # whole epochs from position 0 are all alike: count the ones max_steps leaves whole at once
        alike = 1
        if start == 0:
            more = math.inf if epochs is None else epochs - epoch - 1
            if max_steps is not None:
                more = min(more, *((max_steps - done) // k if k else math.inf  # type: ignore[operator]
                                   for done, k in zip(steps, updates)))
            if more == math.inf:
                raise ValueError("plan(epochs=None) needs max_steps (or data whose epochs apply updates)")
            alike += int(more)
            steps = [s + int(more) * k for s, k in zip(steps, updates)]  # type: ignore[operator]
        result.append(EpochCounts(epoch, tuple(micro), tuple(updates), tuple(samples), tuple(padded),
                                  layouts[0].dropped, alike))
        epoch, start = epoch + alike, 0
    return tuple(result), tuple(steps)


def _is_padded(data: Iterable[Any], rank: int, world_size: int) -> bool:
    """Whether ``rank`` gets a wrapped sample (ranks differ only in that under even batches)."""
    if isinstance(data, DataLoader) and not isinstance(data.dataset, IterableDataset):
        size = len(data.dataset)  # type: ignore[arg-type]
    elif isinstance(data, Sized) and not isinstance(data, DataLoader):
        size = len(data)
    else:
        return False
    return bool(size % world_size) and rank >= size % world_size
