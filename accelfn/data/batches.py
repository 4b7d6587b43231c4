"""Data: sharding over ranks, resumable position, the last batch of an epoch, placement.

Sharding follows ``torch.utils.data.DistributedSampler`` (DESIGN.md §7.1): every rank draws
the same permutation from ``seed + epoch``, pads it by wrapping to a multiple of the world
size (or drops the tail), and takes every world-size-th index from its rank. A sharded
DataLoader is rebuilt around that sampler with the user's batch size, collate function and
workers; its own generator is seeded per epoch and rank so that iterating never draws from the
global RNG (which would make a resumed run diverge) and ranks draw their own augmentations.
"""

from __future__ import annotations

import itertools
import math
import sys
import warnings
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence, Sized
from typing import Any, cast

import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from accelfn.data import streams
from accelfn.data._loaders import rebuild as _rebuild
from accelfn.data._workers import SeededFetch, start_iterating, worker_generator
from accelfn.data.streams import Readers, ShardedIterable
from accelfn.data.tree import num_samples
from accelfn.transforms import ShardData

_NOTHING = object()


def shard_indices(
    num_samples: int, *, rank: int, world_size: int, shuffle: bool, seed: int, epoch: int,
    drop_last: bool = False, even_batches: bool = True,
) -> list[int]:
    """This rank's dataset indices for one epoch, in the order it reads them.

    ``DistributedSampler``'s, except that ``even_batches=False`` (without ``drop_last``)
    pads nothing: each index appears exactly once over all ranks.
    """
    if even_batches or drop_last:
        sampler: DistributedSampler[int] = DistributedSampler(
            range(num_samples),  # type: ignore[arg-type]  # any Sized serves; torch's stub says Dataset
            num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last,
        )
        sampler.set_epoch(epoch)
        return list(sampler)
    whole: DistributedSampler[int] = DistributedSampler(
        range(num_samples), num_replicas=1, rank=0, shuffle=shuffle, seed=seed)  # type: ignore[arg-type]  # as above
    whole.set_epoch(epoch)
    return list(whole)[rank::world_size]


def split_indices(
    num_samples: int, *, batch_size: int, rank: int, world_size: int, shuffle: bool, seed: int, epoch: int,
    drop_last: bool = False, even_batches: bool = True, drop_last_batch: bool = False,
) -> list[int]:
    """This rank's dataset indices for one epoch under ``shard_data(split_batches=True)``:
    its contiguous part of every global batch of ``batch_size`` samples, in order.

    Every rank draws the same permutation (``seed + epoch``, as ``DistributedSampler``) and
    cuts it into global batches of ``batch_size``; rank ``r`` takes samples
    ``[r * b, (r + 1) * b)`` of each, ``b = batch_size // world_size``. The last, partial
    global batch of ``m`` samples (unless ``drop_last_batch``, the DataLoader's
    ``drop_last``, drops it) is cut into contiguous parts of ``ceil(m / world_size)`` or one
    fewer samples; with ``even_batches`` the shorter parts end with one sample wrapped from
    the epoch's start (the ranks ``m % world_size, ...``, as ``DistributedSampler`` pads),
    with ``drop_last`` the parts are ``m // world_size`` samples (the last ``m % world_size``
    dropped, as ``DistributedSampler`` drops its tail), and otherwise the parts
    stay as they are (a rank may get none).
    """
    if batch_size % world_size:
        raise ValueError(_split_error(batch_size, world_size))
    order = list(range(num_samples))
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = torch.randperm(num_samples, generator=g).tolist()
    full, m = divmod(num_samples, batch_size)
    b = batch_size // world_size
    mine = [i for k in range(full) for i in order[k * batch_size + rank * b: k * batch_size + (rank + 1) * b]]
    if m and not drop_last_batch:
        tail, (share, extra) = order[full * batch_size:], divmod(m, world_size)
        if drop_last:  # the tail's last m % world_size samples dropped
            part = tail[rank * share: (rank + 1) * share]
        else:
            first = rank * share + min(rank, extra)
            part = tail[first: first + share + (rank < extra)]
        if even_batches and not drop_last and extra and rank >= extra:
            part.append(order[(rank - extra) % num_samples])
        mine += part
    return mine


def _split_error(batch_size: int, world_size: int) -> str:
    return (f"shard_data(split_batches=True) splits each batch of the DataLoader over the {world_size} processes, "
            f"but its batch_size={batch_size} does not divide by {world_size}; build the DataLoader with a "
            f"batch size that is a multiple of {world_size} (the global batch), or use split_batches=False "
            "(batch_size is then each process's batch)")


def _split_length(num_samples: int, batch_size: int, shard: ShardData, *, rank: int, world_size: int,
                  drop_last_batch: bool) -> int:
    """``len(split_indices(...))`` without drawing the permutation."""
    if batch_size % world_size:
        raise ValueError(_split_error(batch_size, world_size))
    full, m = divmod(num_samples, batch_size)
    total = full * (batch_size // world_size)
    if m and not drop_last_batch:
        share, extra = divmod(m, world_size)
        total += share if shard.drop_last else share + 1 if extra and (shard.even_batches or rank < extra) else share
    return total


class _IndexSampler(Sampler[Any]):
    """A fixed list of indices: one rank's shard of one epoch, after the skipped ones."""

    def __init__(self, indices: Sequence[Any]):
        self.indices = indices

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _is_map_style(loader: DataLoader) -> bool:
    return not isinstance(loader.dataset, IterableDataset)


def _random_samplers() -> tuple[type, ...]:
    """The samplers ``shuffle=True`` builds: torch's ``RandomSampler``, and torchdata's own
    (a ``StatefulDataLoader(shuffle=True)``'s, not a subclass of torch's) once imported."""
    torchdata = sys.modules.get("torchdata.stateful_dataloader.sampler")
    return (RandomSampler,) if torchdata is None else (RandomSampler, torchdata.RandomSampler)


def _shuffles(loader: DataLoader) -> bool:
    sampler = loader.sampler
    if isinstance(sampler, _random_samplers()):
        if sampler.replacement or sampler._num_samples is not None:  # type: ignore[attr-defined]  # noqa: SLF001  # both kinds have them
            raise ValueError(
                "shard_data() cannot shard a RandomSampler that draws with replacement or a "
                "custom num_samples; use shuffle=True without them"
            )
        return True
    if isinstance(sampler, SequentialSampler):
        return False
    raise ValueError(
        f"shard_data() replaces the DataLoader's sampler, but this one uses "
        f"{type(sampler).__name__}; build the DataLoader with shuffle=True/False (or drop "
        "shard_data() and shard the data yourself)"
    )


class EpochBatches:
    """One rank's micro-batches of one epoch, from position ``start``, as ``(batch, is_last)``.

    ``is_last`` is True for the epoch's final micro-batch (its accumulation window is then
    flushed). ``num_batches`` is the epoch's total on this rank when it is known in advance
    (map-style data), else None, in which case the iterator looks one batch ahead.

    Raises:
        ValueError: ``start`` beyond ``num_batches``.

    Attributes:
        num_batches: micro-batches in the whole epoch on this rank, or None.
        padding_ranks: the ranks whose final batch ends with one sample added by wrapping
            (the samples ``gather_for_metrics`` drops).
        is_last: whether the batch most recently yielded is the epoch's last.
        readers: when ``source`` is a stream's :class:`~accelfn.data.streams.Readers`, they
            (their ``state_dict()`` is where the epoch stands: ``TrainState.data_state``),
            else None.
    """

    def __init__(self, source: Iterable[Any], *, num_batches: int | None, start: int,
                 place: Callable[[Any], Any], padding_ranks: frozenset[int] = frozenset(),
                 sync: Callable[[Iterator[Any]], Iterator[Any]] | None = None):
        if num_batches is not None and start > num_batches:
            raise ValueError(
                f"cannot resume at micro-batch {start} of an epoch of {num_batches} micro-batches (on this "
                "process): the batch size, the dataset or the number of processes probably differs from the "
                "run that wrote the checkpoint; resume with the same data and world size, or start a fresh "
                "run (without resume=...)"
            )
        self._source, self.num_batches, self.start = source, num_batches, start
        self._place, self._sync = place, sync
        self.padding_ranks = padding_ranks
        self.is_last = False
        self.readers = source if isinstance(source, Readers) else None

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("the number of batches of this data is not known in advance")
        return max(self.num_batches - self.start, 0)

    def __iter__(self) -> Generator[tuple[Any, bool], None, None]:
        it: Iterator[Any] = start_iterating(self._source)
        if self._sync is not None:
            it = self._sync(it)
        yield from (self._batches(it) if self.readers is None else self._counted(it, self.readers))

    def _counted(self, it: Iterator[Any], readers: Readers) -> Iterator[tuple[Any, bool]]:
        """The batches of ``it``, each counted in ``readers.consumed`` as it is given out."""
        for pair in self._batches(it):
            readers.consumed += 1
            yield pair

    def _batches(self, it: Iterator[Any]) -> Iterator[tuple[Any, bool]]:
        place = self._place
        if self.num_batches is not None:
            remaining = len(self)
            for i, batch in enumerate(it):
                self.is_last = i == remaining - 1
                yield place(batch), self.is_last
            return
        previous = _NOTHING
        for batch in it:
            if previous is not _NOTHING:
                self.is_last = False
                yield place(previous), False
            previous = batch
        if previous is not _NOTHING:
            self.is_last = True
            yield place(previous), True


def _check_not_split(shard: ShardData) -> None:
    if shard.split_batches:
        raise ValueError("shard_data(split_batches=True) splits the batches of a DataLoader over a map-style "
                         "dataset; this data is another iterable (or an IterableDataset): build a "
                         "DataLoader(dataset, batch_size=global batch, shuffle=...) of a dataset with __len__ "
                         "and __getitem__, or use split_batches=False")


def _check_shardable(loader: DataLoader) -> bool:
    """Raises unless ``shard_data`` can shard ``loader`` by samples; returns whether it shuffles
    (a map-style dataset's sampler; an IterableDataset is read in stream order)."""
    if loader.batch_size is None:
        raise ValueError(
            "shard_data() needs a DataLoader built with batch_size=...; this one has "
            "batch_size=None (unbatched samples, or a custom batch_sampler), which cannot be "
            "sharded by samples"
        )
    return _is_map_style(loader) and _shuffles(loader)


def _shard_length(num_samples: int, shard: ShardData, *, rank: int, world_size: int) -> int:
    """``len(shard_indices(num_samples, ...))``, without drawing the permutation."""
    if shard.drop_last and num_samples % world_size:  # DistributedSampler's own arithmetic
        return math.ceil((num_samples - world_size) / world_size)
    if shard.even_batches or shard.drop_last:
        return math.ceil(num_samples / world_size)
    return len(range(rank, num_samples, world_size))


def num_batches(data: Iterable[Any], shard: ShardData | None, *, rank: int, world_size: int) -> int | None:
    """This rank's micro-batches in one epoch of ``data``, as ``epoch_batches`` reads it, without
    building a loader or reading anything; None when it is not known in advance (an
    IterableDataset, a generator).

    Raises:
        ValueError: a DataLoader that ``shard_data`` cannot shard (as ``epoch_batches``).
    """
    if shard is not None and not (isinstance(data, DataLoader) and _is_map_style(data)):
        _check_not_split(shard)
    if shard is None or world_size == 1 and not isinstance(data, DataLoader):
        return len(data) if isinstance(data, (DataLoader, Sized)) and _sized(data) else None
    if isinstance(data, DataLoader):
        _check_shardable(data)
        if not _is_map_style(data):
            return None
        if shard.split_batches:
            samples = _split_length(len(data.dataset), data.batch_size, shard, rank=rank,  # type: ignore[arg-type]  # map-style: sized; checked above
                                    world_size=world_size, drop_last_batch=data.drop_last)
            return -(-samples // (data.batch_size // world_size))  # type: ignore[operator]  # checked above
        samples = _shard_length(len(data.dataset), shard, rank=rank, world_size=world_size)  # type: ignore[arg-type]  # map-style: sized
        full, partial = divmod(samples, data.batch_size)  # type: ignore[operator]  # checked above
        return full + (1 if partial and not data.drop_last else 0)
    if isinstance(data, Sequence):
        return _shard_length(len(data), shard, rank=rank, world_size=world_size)
    return None


def epoch_batches(
    data: Iterable[Any], shard: ShardData | None, *, rank: int, world_size: int, epoch: int,
    start: int = 0, place: Callable[[Any], Any] = lambda b: b,
    sync: Callable[[Iterator[Any]], Iterator[Any]] | None = None, data_state: Any = None,
) -> EpochBatches:
    """This rank's micro-batches of ``epoch`` from position ``start`` (micro-batches skipped).

    A stream (a DataLoader over an IterableDataset under ``shard_data``, or a torchdata
    ``StatefulDataLoader``) is read by :class:`~accelfn.data.streams.Readers`, whose state
    the returned ``readers`` keeps for checkpoints; resumed from ``data_state``, the saved
    state of the same readers, it continues where they stopped instead of reading the first
    ``start`` micro-batches again (``accelfn.data.streams``).

    Args:
        data: a DataLoader (map-style or iterable dataset) or any iterable of batches.
        shard: the program's ``shard_data`` transform, or None to read ``data`` as it is.
        rank, world_size: this process's place in the world.
        epoch: the epoch (seeds the shuffle: ``seed + epoch``).
        start: micro-batches of this epoch already consumed (a resumed run skips them).
        place: moves a batch to the device.
        sync: for data whose length is unknown, a wrapper that keeps ranks in step (pads
            ranks that run out by replaying a batch) so that no collective hangs.
        data_state: ``TrainState.data_state``: the readers' saved state at ``start`` (or the
            live readers of an earlier call), or None.

    Raises:
        ValueError: a DataLoader whose sampler cannot be sharded, ``start`` beyond the
            epoch, or a ``datasets.IterableDataset`` already split over processes.

    Warns:
        RuntimeWarning: a mid-epoch resume that does not continue exactly (a DataLoader
            that reshuffles on every pass) or reads batches again (a stream without its
            readers' saved state); the cost of a stream's split (``accelfn.data.streams``).
    """
    if shard is not None and not (isinstance(data, DataLoader) and _is_map_style(data)):
        _check_not_split(shard)
    if shard is None or world_size == 1 and not isinstance(data, DataLoader):
        num = num_batches(data, shard, rank=rank, world_size=world_size)
        if streams.is_stateful_loader(data):
            readers = streams.own_loader(cast(DataLoader, data), rank=rank, world_size=world_size, epoch=epoch,
                                         start=start, data_state=data_state, ahead=num is None)
            if readers is not None:
                return EpochBatches(readers, num_batches=num, start=start, place=place,
                                    sync=sync if world_size > 1 and num is None else None)
        if start and isinstance(data, DataLoader) and _is_map_style(data) and not isinstance(
                data.sampler, SequentialSampler):
            warnings.warn(
                f"resuming at micro-batch {start} of epoch {epoch} of a DataLoader whose "
                f"{type(data.sampler).__name__} draws a new order on every pass: the rest of "
                "this epoch will not be the batches the interrupted run would have read. Add "
                "af.shard_data() to the program (it works in one process too): its shuffle is "
                "seeded by (seed, epoch), so a resumed run continues exactly",
                RuntimeWarning,
                stacklevel=4,
            )
        return EpochBatches(_LazySlice(data, start), num_batches=num, start=start, place=place,
                            sync=sync if world_size > 1 and num is None else None)
    if isinstance(data, DataLoader):
        if _is_map_style(data):
            return _map_style(data, shard, rank=rank, world_size=world_size, epoch=epoch, start=start, place=place)
        _check_shardable(data)
        source = streams.epoch_stream(data, seed=shard.seed, rank=rank, world_size=world_size, epoch=epoch,
                                      start=start, data_state=data_state)
        return EpochBatches(source, num_batches=None, start=start, place=place,
                            sync=sync if world_size > 1 else None)
    if isinstance(data, Sequence):
        indices = shard_indices(len(data), rank=rank, world_size=world_size, shuffle=False, seed=shard.seed,
                                epoch=epoch, drop_last=shard.drop_last, even_batches=shard.even_batches)
        return EpochBatches((data[i] for i in indices[start:]), num_batches=len(indices), start=start, place=place)
    return EpochBatches(_LazySlice(data, start, rank=rank, world_size=world_size), num_batches=None,
                        start=start, place=place, sync=sync if world_size > 1 else None)


class _LazySlice:
    """Items ``rank, rank + world_size, ...`` of ``data``, from the ``start``-th of those on.

    An iterable, not an iterator: ``data`` is first iterated when the epoch is, so building
    an epoch's batches starts no DataLoader workers and
    draws no random numbers from the global RNG (a shuffled DataLoader draws its seed in
    ``iter``); iterating it is ``itertools.islice`` itself, with no Python frame per batch.
    """

    def __init__(self, data: Iterable[Any], start: int, *, rank: int = 0, world_size: int = 1):
        self._data, self._first, self._stride = data, rank + start * world_size, world_size

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(start_iterating(self._data), self._first, None, self._stride)


def _sized(data: Any) -> bool:
    if isinstance(data, DataLoader):
        return _is_map_style(data)
    try:
        len(data)
    except TypeError:
        return False
    return True


def _map_style(loader: DataLoader, shard: ShardData, *, rank: int, world_size: int, epoch: int, start: int,
               place: Callable[[Any], Any]) -> EpochBatches:
    shuffle = _check_shardable(loader)
    num_samples = len(loader.dataset)  # type: ignore[arg-type]  # map-style: sized, unlike Dataset's stub
    assert loader.batch_size is not None
    if shard.split_batches:
        indices = split_indices(
            num_samples, batch_size=loader.batch_size, rank=rank, world_size=world_size, shuffle=shuffle,
            seed=shard.seed, epoch=epoch, drop_last=shard.drop_last, even_batches=shard.even_batches,
            drop_last_batch=loader.drop_last)
        batch_size, tail = loader.batch_size // world_size, num_samples % loader.batch_size
        padded = shard.even_batches and not shard.drop_last and not loader.drop_last and tail % world_size
        padding_ranks = frozenset(range(tail % world_size, world_size)) if padded else frozenset()
    else:
        indices = shard_indices(
            num_samples, rank=rank, world_size=world_size, shuffle=shuffle, seed=shard.seed,
            epoch=epoch, drop_last=shard.drop_last, even_batches=shard.even_batches,
        )
        batch_size = loader.batch_size
        padded = shard.even_batches and not shard.drop_last and num_samples % world_size
        padding_ranks = frozenset(range(num_samples % world_size, world_size)) if padded else frozenset()
    total = num_batches(loader, shard, rank=rank, world_size=world_size)
    generator = worker_generator(shard.seed, epoch, rank)
    remaining = indices[start * batch_size:]
    if loader.num_workers == 0:
        rebuilt = _rebuild(loader, sampler=_IndexSampler(remaining), generator=generator, batch_size=batch_size)
    else:  # a worker fetches each batch with its RNGs seeded by (seed, epoch, rank, batch number)
        keys = [(start + j // batch_size, i) for j, i in enumerate(remaining)]
        rebuilt = _rebuild(loader, dataset=SeededFetch(loader.dataset, shard.seed, epoch, rank),
                           sampler=_IndexSampler(keys), generator=generator, batch_size=batch_size)
    return EpochBatches(rebuilt, num_batches=total, start=start, place=place, padding_ranks=padding_ranks)


def even_out(it: Iterator[Any], any_rank: Callable[[bool], bool],
             first: Callable[[Any, bool], tuple[bool, Any]], *, replays: bool = False) -> Iterator[Any]:
    """Keeps ranks in step over data of unknown length: one tiny all-reduce per batch
    (``any_rank``: whether any rank still has a batch, ``distributed.any_rank``).

    While any rank still has batches, a rank that has run out replays its first batch (the
    way DistributedSampler pads by wrapping); the epoch ends for all ranks together. A rank
    that has no batch at all replays a copy of another rank's first batch: ``first(batch,
    present)`` is the first round's collective, which returns whether any rank has a batch
    and the batch this rank starts from (its own, or that copy).

    Args:
        it: this rank's batches.
        any_rank, first: the collectives (every rank calls them alike).
        replays: yield ``(batch, replayed)`` pairs, ``replayed`` True for a replay.
    """
    batch = next(it, _NOTHING)
    present, start = first(None if batch is _NOTHING else batch, batch is not _NOTHING)
    if not present:
        return
    yield (start, batch is _NOTHING) if replays else start
    while True:
        batch = next(it, _NOTHING)
        if not any_rank(batch is not _NOTHING):
            return
        replayed = batch is _NOTHING
        if replayed:
            batch = start
        yield (batch, replayed) if replays else batch


class _Keyed(torch.utils.data.Dataset):
    """``dataset[i]`` as ``(i, dataset[i])``: each sample carries its dataset index."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __getitem__(self, index: int) -> tuple[int, Any]:
        return index, self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)


class _Enumerated:
    """``(position, item)`` pairs of an iterable, from the start at each ``iter`` (as a dataset)."""

    def __init__(self, dataset: Iterable[Any]):
        self.dataset = dataset

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return enumerate(self.dataset)


class _KeyedCollate:
    """Collates ``(key, sample)`` pairs into ``(keys, collate(samples))``; picklable for workers."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any]):
        self.collate_fn = collate_fn

    def __call__(self, items: list[tuple[int, Any]]) -> tuple[torch.Tensor, Any]:
        keys = torch.tensor([k for k, _ in items], dtype=torch.int64)
        return keys, self.collate_fn([x for _, x in items])


def keyed_batches(data: Iterable[Any], *, rank: int, world_size: int) -> Iterable[tuple[torch.Tensor, Any]]:
    """This rank's part of ``data`` for evaluation, each batch with the keys of its samples.

    Every sample goes to exactly one rank (nothing is padded: ranks may differ by a batch),
    and sorting all ranks' keys puts the samples back in the order of ``data``. A key is
    the dataset index (map-style DataLoader), the position in the stream (DataLoader over
    an IterableDataset, split over ranks x workers), or ``batch_number * 2**32 + position``
    (any other iterable of batches, split over ranks batch by batch).

    Args:
        data: a DataLoader built with ``batch_size=...``, or an iterable of batches.
        rank, world_size: this process's place in the world.

    Returns:
        Iterable of ``(keys, batch)``: ``keys`` an int64 tensor of shape ``(batch,)``.

    Raises:
        ValueError: a DataLoader without ``batch_size`` (a custom batch sampler), or over a
            ``datasets.IterableDataset`` with workers (which split it by shards themselves).
    """
    if isinstance(data, DataLoader):
        if data.batch_size is None:
            raise ValueError(
                "evaluate() needs a DataLoader built with batch_size=...; one with a custom "
                "batch_sampler cannot be split by samples"
            )
        if data.num_workers and streams.is_hf_stream(data.dataset):
            raise ValueError(
                "evaluate() puts the outputs back in stream order by each item's position in the stream, but in "
                f"DataLoader workers a datasets.IterableDataset gives each worker only its own shards ({data.num_workers} "
                "workers here), so those positions are lost (and items with them); evaluate it with num_workers=0, "
                "or a map-style datasets.Dataset")
        collate = _KeyedCollate(data.collate_fn)
        if _is_map_style(data):
            indices = shard_indices(len(data.dataset), rank=rank, world_size=world_size,  # type: ignore[arg-type]  # map-style: sized
                                    shuffle=False, seed=0, epoch=0, even_batches=False)
            return _rebuild(data, dataset=_Keyed(data.dataset), sampler=_IndexSampler(indices),
                            collate_fn=collate, drop_last=False)
        keyed = ShardedIterable(_Enumerated(cast(Iterable[Any], data.dataset)), rank=rank, world_size=world_size)
        return _rebuild(data, dataset=keyed, collate_fn=collate, drop_last=False)
    return _keyed_stream(data, rank=rank, world_size=world_size)


def _keyed_stream(data: Iterable[Any], *, rank: int, world_size: int) -> Iterator[tuple[torch.Tensor, Any]]:
    for number, batch in itertools.islice(enumerate(data), rank, None, world_size):
        size = num_samples(batch)
        yield torch.arange(size, dtype=torch.int64) + number * 2**32, batch


def check_eval_loader(data: Any) -> None:
    """Raises unless ``data`` is a DataLoader that ``eval_batches`` can shard by samples.

    Raises:
        TypeError: ``data`` is not a DataLoader, or one over an IterableDataset (its padding
            could not be told apart), or with a sampler other than ``shuffle=False``/
            ``shuffle=True``'s (which ``eval_batches`` replaces).
        ValueError: a DataLoader without ``batch_size`` (a custom batch sampler), or with
            ``drop_last=True`` (evaluation reads every sample).
    """
    if not isinstance(data, DataLoader):
        raise TypeError(
            f"eval_batches() takes a torch.utils.data.DataLoader, got {type(data).__name__}; "
            "for any other iterable of batches use af.evaluate(fn, state, data, backend=...)"
        )
    if isinstance(data.dataset, IterableDataset):
        raise TypeError(
            "eval_batches() needs a DataLoader over a map-style dataset (with __len__ and "
            "__getitem__), so that gather_for_metrics can drop the padding; for an "
            "IterableDataset use af.evaluate(fn, state, loader, backend=...)"
        )
    if data.batch_size is None:
        raise ValueError(
            "eval_batches() needs a DataLoader built with batch_size=...; this one has "
            "batch_size=None (a custom batch_sampler, or unbatched samples)"
        )
    if data.drop_last:
        raise ValueError(
            "eval_batches() reads every sample once (the padding of the last batches is dropped by "
            "gather_for_metrics), so it cannot honour drop_last=True; build the evaluation DataLoader "
            "with drop_last=False"
        )
    if not isinstance(data.sampler, (SequentialSampler, *_random_samplers())):
        raise TypeError(
            f"eval_batches() replaces the DataLoader's sampler, but this one uses "
            f"{type(data.sampler).__name__}; build the DataLoader with shuffle=False"
        )
