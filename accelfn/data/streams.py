"""Streams: a DataLoader over an IterableDataset split over processes x workers, and the
readers' own state, which checkpoints carry so that a resumed epoch continues the stream.

A *reader* is one DataLoader worker of one process (the process itself without workers):
``R = world_size * max(num_workers, 1)`` of them. Every item of an epoch is read by exactly
one reader; where readers outnumber shards the rule below says who reads what, and a
RuntimeWarning says what it costs (nothing is ever dropped):

- A Hugging Face ``datasets.IterableDataset`` is split by ``datasets`` itself: over the
  processes by ``datasets.distributed.split_dataset_by_node`` (whole shards when its
  ``num_shards`` divides by the world size; otherwise each process keeps every
  world-size-th example and so streams every shard), then over a process's workers by
  ``datasets``' own worker split (whole shards of the process's part; workers beyond its
  shards read nothing, and ``datasets`` stops them). Its ``set_epoch(epoch)`` is called (on
  a copy) with the run's epoch, so a shuffled stream reshuffles every epoch.
- Any other ``IterableDataset`` is dealt round-robin (:class:`ShardedIterable`): reader
  ``i`` keeps items ``i, i + R, i + 2R, ...`` of the stream, which every reader iterates
  whole. The dataset must not split itself by worker (``get_worker_info``): that would
  split it twice.

The readers' state (:class:`Readers`) is what a checkpoint saves for the epoch in
progress, per process, as JSON values and tensors: without workers the reader dataset's
own ``state_dict()`` (``datasets``' position in its shards, or :class:`ShardedIterable`'s
position in the stream with its dataset's ``state_dict()`` when it has one); with workers,
torchdata's ``StatefulDataLoader`` (which reads the epoch then) and its ``state_dict()``,
its workers' dataset states taken with each batch. A resumed epoch loads that state into
the rebuilt readers and continues where they stopped; it reads no item again, but for a
dataset without ``state_dict()``, whose items before the position are read and skipped
(``datasets`` itself resumes inside its current shard as its ``state_dict()`` says, reading
a generator's or a file's shard from its start up to the saved example). A ``datasets``
stream shuffled through a buffer (``.shuffle()``) resumes by reading again instead: its
``state_dict()`` does not keep the buffer, whose examples would be lost.
Without torchdata, a stream read by workers has no state to save: a resumed epoch reads
its first batches again and skips them (a RuntimeWarning says so).

The state is taken after every batch the readers give, since the epoch's iterator reads
one batch ahead (to know the last), and the one after the micro-batches the step consumed
is saved.
"""

from __future__ import annotations

import collections
import copy
import itertools
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from accelfn.data._loaders import rebuild
from accelfn.data._workers import start_iterating, worker_generator

#: what a saved readers' state holds besides the state itself, and must equal this run's
#: for the state to apply: how the stream was split, and the epoch it is in
_HEADER = ("reader", "world_size", "rank", "num_workers", "epoch")


class ShardedIterable(IterableDataset):
    """Item ``i`` of ``dataset`` goes to exactly one (rank, DataLoader worker) pair.

    The stream is split round-robin over ``world_size * num_workers`` readers, so every
    item is read exactly once. Do not also split by worker inside ``dataset``.

    ``state_dict()`` is this reader's position: ``{"position": items of the stream passed,
    "dataset": dataset.state_dict() or None}``; after ``load_state_dict(state)`` the next
    iteration continues after that position: from the dataset's own state when it has one,
    else by reading the ``position`` items before it again and skipping them.
    """

    def __init__(self, dataset: Iterable[Any], *, rank: int, world_size: int):
        self.dataset, self.rank, self.world_size = dataset, rank, world_size
        self.stateful = _stateful(dataset)
        self._position = 0
        self._start: Mapping[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        # a copy: a dataset may hand out the dict it goes on updating, and this state is kept
        # while the stream is read on (a batch ahead)
        inner = copy.deepcopy(self.dataset.state_dict()) if self.stateful else None  # type: ignore[attr-defined]  # checked
        return {"position": self._position, "dataset": inner}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self._start = state_dict

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        num_workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        readers = self.world_size * num_workers
        me = self.rank * num_workers + worker
        start, self._start = self._start, None
        position = 0 if start is None else int(start["position"])
        if start is not None and start["dataset"] is not None and self.stateful:
            self.dataset.load_state_dict(start["dataset"])  # type: ignore[attr-defined]  # checked
            it = iter(self.dataset)
        else:  # read again up to the position: the dataset keeps no state of its own
            it = itertools.islice(iter(self.dataset), position, None)
        self._position = position
        offset = (me - position) % readers
        return self._read(itertools.islice(it, offset, None, readers), position + offset, readers)

    def _read(self, mine: Iterator[Any], first: int, readers: int) -> Iterator[Any]:
        for k, item in enumerate(mine):
            self._position = first + k * readers + 1
            yield item


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def is_hf_stream(dataset: Any) -> bool:
    """True if ``dataset`` is a Hugging Face ``datasets.IterableDataset`` (without importing
    ``datasets``: an object of it exists only once it is imported)."""
    module = sys.modules.get("datasets")
    return module is not None and isinstance(dataset, getattr(module, "IterableDataset", ()))


def stateful_loader_class() -> type[DataLoader] | None:
    """torchdata's ``StatefulDataLoader``, or None where torchdata is not installed."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return None
    return StatefulDataLoader


def is_stateful_loader(data: Any) -> bool:
    """True if ``data`` is a torchdata ``StatefulDataLoader``."""
    module = sys.modules.get("torchdata.stateful_dataloader")
    return module is not None and isinstance(data, module.StatefulDataLoader)


def hf_part(dataset: Any, *, rank: int, world_size: int, epoch: int, num_workers: int) -> Any:
    """This rank's part of a ``datasets.IterableDataset`` for ``epoch``: a new dataset (the
    user's is not changed), split by ``split_dataset_by_node``, at ``set_epoch(epoch)``;
    on rank 0, the rule's RuntimeWarnings where processes or workers outnumber shards.

    Raises:
        ValueError: a dataset already split over processes (``split_dataset_by_node``), which
            ``shard_data()`` would split again.
    """
    from datasets.distributed import split_dataset_by_node

    if getattr(dataset, "_distributed", None) is not None:  # datasets keeps its split here
        raise ValueError(
            "shard_data() splits a datasets.IterableDataset over the processes itself, but this one was already "
            "split with split_dataset_by_node: it would be split twice and most of it never read. Pass the "
            "dataset before split_dataset_by_node, or drop shard_data() and keep your own split")
    part = split_dataset_by_node(dataset, rank=rank, world_size=world_size)
    part.set_epoch(epoch)
    if rank == 0:
        _warn_hf_rule(_num_shards(dataset), _num_shards(part), world_size, num_workers)
    return part


def _num_shards(dataset: Any) -> int:
    """A ``datasets.IterableDataset``'s shards (``num_shards``; ``n_shards`` before datasets 3.x's rename)."""
    return int(getattr(dataset, "num_shards", None) or dataset.n_shards)


def _warn_hf_rule(shards: int, per_process: int, world_size: int, num_workers: int) -> None:
    if world_size > 1 and shards % world_size:
        warnings.warn(
            f"the datasets.IterableDataset has {shards} shard{'s' if shards != 1 else ''}, which do not divide over "
            f"{world_size} processes: split_dataset_by_node gives each process every {world_size}th example, so "
            f"every process streams all {shards} shards (each item is still read once in the epoch). Give it a "
            f"multiple of {world_size} shards (more files, or dataset.reshard()) to read each shard once",
            RuntimeWarning, stacklevel=2)
    if num_workers > per_process:
        warnings.warn(
            f"each process's part of the datasets.IterableDataset has {per_process} shard"
            f"{'s' if per_process != 1 else ''} for its {num_workers} DataLoader workers: datasets gives each worker "
            f"whole shards, so {num_workers - per_process} worker{'s' if num_workers - per_process != 1 else ''} per "
            f"process read nothing (each item is still read once). Use at most {per_process} workers, or a "
            "dataset with more shards",
            RuntimeWarning, stacklevel=2)


class Readers:
    """One process's readers of one epoch: the loader reading it, and their saved state
    after the micro-batches consumed (``state_dict``), for checkpoints.

    Iterating yields the loader's batches (``skip`` of them first read and dropped: a resume
    without a saved state). ``consumed`` is set by the epoch's iterator to the batches it has
    given to the step since iteration began; ``state_dict()`` is the readers' state after
    the last of them (the last state taken when more were consumed than read: padding
    batches), with the header that says which readers it belongs to.

    Args:
        loader: the DataLoader that reads the epoch.
        state_of: the readers' state now, given the loader's iterator (the reader dataset's
            ``state_dict()``, or the StatefulDataLoader iterator's).
        header: ``reader``, ``world_size``, ``rank``, ``num_workers``, ``epoch``.
        initial: the state iteration starts from (loaded into the readers), or None for
            the epoch's start.
        skip: batches to read and drop before the first one yielded.
        ahead: whether the epoch's iterator reads a batch ahead of the step (data of unknown
            length): the state is then taken after every batch; otherwise it is read when
            asked, the loader being exactly at the batches consumed.
    """

    def __init__(self, loader: DataLoader, state_of: Callable[[Iterator[Any]], Any], header: Mapping[str, Any],
                 *, initial: Any = None, skip: int = 0, ahead: bool = True):
        self.loader, self._state_of, self._header = loader, state_of, dict(header)
        self._initial, self._skip, self._ahead = initial, skip, ahead
        self._states: collections.deque[tuple[int, Any]] = collections.deque(maxlen=3)
        self._it: Iterator[Any] | None = None
        self.consumed = 0

    def __iter__(self) -> Iterator[Any]:
        self._it = it = start_iterating(self.loader)
        self.consumed = 0
        self._states.clear()
        batches = itertools.islice(it, self._skip, None) if self._skip else it
        return self._taking(batches, it) if self._ahead else self._reading(batches, it)

    def _taking(self, batches: Iterator[Any], it: Iterator[Any]) -> Iterator[Any]:
        state_of, states = self._state_of, self._states
        try:
            for read, batch in enumerate(batches, 1):
                states.append((read, state_of(it)))
                yield batch
        finally:
            _shut_down(it)

    def _reading(self, batches: Iterator[Any], it: Iterator[Any]) -> Iterator[Any]:
        try:
            yield from batches
        finally:
            _shut_down(it)

    def state_dict(self) -> dict[str, Any]:
        """The readers' saved state after the batches consumed, with its header."""
        state = self._initial
        if not self._ahead:
            if self._it is not None:
                state = self._state_of(self._it)
        else:
            for read, taken in self._states:
                if read <= self.consumed:
                    state = taken
        return {**self._header, "state": state}


def _shut_down(it: Iterator[Any]) -> None:
    """Ends the worker processes of a DataLoader iterator the epoch no longer reads (torch's
    own shutdown, which a DataLoader's iterator otherwise runs when it is collected).

    A ``StatefulDataLoader`` keeps its iterator, and the readers' state is kept (in the
    TrainState) past the epoch: its workers would live on, ignoring SIGTERM
    (``start_iterating``), until multiprocessing's exit handler, which ends them with SIGTERM
    and then waits for them, hung the interpreter's exit.
    """
    shutdown = getattr(it, "_shutdown_workers", None)  # torch's _MultiProcessingDataLoaderIter
    if shutdown is not None:
        shutdown()


def header(reader: str, *, world_size: int, rank: int, num_workers: int, epoch: int) -> dict[str, Any]:
    """What a saved readers' state must match to apply (``usable_state``)."""
    return {"reader": reader, "world_size": world_size, "rank": rank, "num_workers": num_workers, "epoch": epoch}


def usable_state(data_state: Any, expected: Mapping[str, Any]) -> tuple[Any, str | None]:
    """The saved readers' state of ``data_state`` (``TrainState.data_state``: None, a saved
    mapping or live :class:`Readers`) if it belongs to the readers ``expected`` describes,
    and otherwise None with the reason."""
    if data_state is None:
        return None, ("the checkpoint holds no state of the stream's readers (written without shard_data(), or by "
                      "an accelfn before it)")
    saved = data_state if isinstance(data_state, Mapping) else data_state.state_dict()
    if not isinstance(saved, Mapping) or "state" not in saved:
        return None, "the checkpoint's data_state is not a readers' state"
    differ = [f"{key} {saved.get(key)!r} in the checkpoint, {expected[key]!r} here"
              for key in _HEADER if saved.get(key) != expected[key]]
    if differ:
        return None, (f"the checkpoint's readers differ ({'; '.join(differ)}): their state applies to the same "
                      "processes and DataLoader workers only, and other readers read the stream in another order")
    return saved["state"], None


def warn_replay(batches: int, epoch: int, reason: str) -> None:
    """The RuntimeWarning of a resumed stream that reads its first ``batches`` again."""
    warnings.warn(
        f"resuming epoch {epoch} of a stream at micro-batch {batches} by reading its first {batches} batches again "
        f"and skipping them: {reason}",
        RuntimeWarning, stacklevel=4)


def _buffer_shuffled(dataset: Any) -> bool:
    """True if a ``datasets.IterableDataset`` shuffles through a buffer (``.shuffle()``), whose
    examples its ``state_dict()`` does not keep: a resume from it would lose them (datasets'
    documented limit). Read from its chain of example iterables (``ex_iterable(s)``)."""
    pending = [getattr(dataset, "_ex_iterable", None)]
    while pending:
        ex = pending.pop()
        if ex is None:
            continue
        if type(ex).__name__ == "BufferShuffledExamplesIterable":
            return True
        pending.append(getattr(ex, "ex_iterable", None))
        pending.extend(getattr(ex, "ex_iterables", None) or ())
    return False


def _loader_state(it: Iterator[Any]) -> Any:
    return it.state_dict()  # type: ignore[attr-defined]  # a StatefulDataLoader's iterator


class _Skipping:
    """The batches of ``loader`` after its first ``skip`` (read and dropped), lazily."""

    def __init__(self, loader: DataLoader, skip: int):
        self._loader, self._skip = loader, skip

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(start_iterating(self._loader), self._skip, None)


def epoch_stream(loader: DataLoader, *, seed: int, rank: int, world_size: int, epoch: int, start: int,
                 data_state: Any) -> Iterable[Any]:
    """This rank's batches of ``epoch`` of a DataLoader over an IterableDataset under
    ``shard_data()``, from micro-batch ``start``: :class:`Readers` whose state checkpoints
    carry, resumed from ``data_state`` when it is theirs; else (a stream read by workers
    without torchdata) the batches after the first ``start``, read again.

    The readers are the DataLoader rebuilt (batch size, collate function, workers) around
    this rank's part of the stream (the module's rule), its workers' base seed drawn from
    ``worker_generator(seed, epoch, rank)``; a ``StatefulDataLoader`` when it has workers.

    Warns:
        RuntimeWarning: (rank 0) a resume that reads batches again, and why; where processes
            or workers outnumber a ``datasets.IterableDataset``'s shards (the rule's cost).

    Raises:
        ValueError: a ``datasets.IterableDataset`` already split over processes.
    """
    dataset, workers = loader.dataset, loader.num_workers
    if is_hf_stream(dataset):
        reader: Any = hf_part(dataset, rank=rank, world_size=world_size, epoch=epoch, num_workers=workers)
    else:
        reader = ShardedIterable(cast(Iterable[Any], dataset), rank=rank, world_size=world_size)
    generator = worker_generator(seed, epoch, rank)
    expected = header("shard_data", world_size=world_size, rank=rank, num_workers=workers, epoch=epoch)
    saved, reason = usable_state(data_state, expected) if start else (None, None)
    if saved is not None and is_hf_stream(dataset) and _buffer_shuffled(dataset):
        saved, reason = None, ("datasets does not save the examples in an IterableDataset.shuffle() buffer, which a "
                               "resume from its state_dict() would lose (and the same seed gives the same order again)")
    if workers == 0:
        if saved is not None:
            reader.load_state_dict(saved)
        batches = rebuild(loader, dataset=reader, generator=generator)

        def state_of(it: Iterator[Any]) -> Any:
            return reader.state_dict()
    else:
        stateful = stateful_loader_class()
        if stateful is None:
            if start and rank == 0:
                warn_replay(start, epoch, f"its {workers} DataLoader workers' state can be saved only with torchdata "
                                          "installed (pip install 'accelfn[streaming]')")
            return _Skipping(rebuild(loader, dataset=reader, generator=generator), start)
        with warnings.catch_warnings():  # torchdata's own call of a deprecated torch API, nothing to act on
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
            batches = rebuild(loader, dataset=reader, generator=generator, cls=stateful, snapshot_every_n_steps=1)
        if saved is not None:
            batches.load_state_dict(saved)  # type: ignore[attr-defined]  # a StatefulDataLoader
        state_of = _loader_state
    if start and saved is None and rank == 0:
        warn_replay(start, epoch, reason or "")
    if saved is not None and rank == 0 and isinstance(reader, ShardedIterable) and not reader.stateful:
        warnings.warn(
            f"resuming epoch {epoch} of a {type(dataset).__name__} without state_dict()/load_state_dict(): each "
            "reader reads its stream again up to its saved position and skips those items. Give the dataset "
            "state_dict() and load_state_dict() (torchdata's Stateful protocol) to continue without reading it again",
            RuntimeWarning, stacklevel=3)
    return Readers(batches, state_of, expected, initial=saved, skip=0 if saved is not None else start)


def own_loader(loader: DataLoader, *, rank: int, world_size: int, epoch: int, start: int, data_state: Any,
               ahead: bool) -> Readers | None:
    """The user's own ``StatefulDataLoader`` read as it is (no ``shard_data()``), as
    :class:`Readers` of its own ``state_dict()``: from the start of the epoch, or resumed at
    ``start`` from ``data_state`` when that is its saved state (loaded with its
    ``load_state_dict``). None when it is resumed without such a state (the caller reads
    its first ``start`` batches again; a RuntimeWarning on rank 0 says why). ``ahead``: the
    epoch is read a batch ahead (data of unknown length)."""
    expected = header("loader", world_size=world_size, rank=rank, num_workers=loader.num_workers, epoch=epoch)
    saved, reason = usable_state(data_state, expected) if start else (None, None)
    if start and saved is None:
        if rank == 0:
            warn_replay(start, epoch, reason or "")
        return None
    if saved is not None:
        loader.load_state_dict(saved)  # type: ignore[attr-defined]  # a StatefulDataLoader
    # without workers, its state holds the dataset's own state_dict(), which may be the dict
    # the dataset goes on updating: copied, since it is kept while the loader reads ahead
    state_of = _loader_state if loader.num_workers or not ahead else _copied_loader_state
    return Readers(loader, state_of, expected, initial=saved, ahead=ahead)


def _copied_loader_state(it: Iterator[Any]) -> Any:
    return copy.deepcopy(_loader_state(it))
