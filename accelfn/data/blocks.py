"""Data under ``invariant()``: one epoch order for every world size, cut into rank blocks.

Every rank draws the same permutation of the dataset from ``seed + epoch`` (the generator
``shard_data(split_batches=True)`` uses), cuts it into micro-batches of ``b`` (the
DataLoader's ``batch_size``), and numbers them ``0, 1, ...``: the global micro-batches of the
epoch, which do not depend on the world size. Update ``u`` reads global micro-batches
``[u L, (u+1) L)``, ``L = W A``, and rank ``r`` the contiguous block
``[u L + r A, u L + (r+1) A)``.

The tail policy: an epoch holds ``floor(N / (L b))`` updates; the samples of the last,
incomplete global batch (fewer than ``L b``) are not read in that epoch (the next epoch's
permutation differs, so no sample is left out for good). Every update of every topology
with the same ``L`` and ``b`` then sees the same samples, in the same micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from accelfn.data import batches
from accelfn.data._workers import SeededFetch, only_batch, worker_generator
from accelfn.data.batches import _shuffles
from accelfn.step import Step
from accelfn.transforms import Accumulate, Invariant, ShardData


def _check(loader: Any) -> int:
    """Raises unless ``invariant()`` can cut ``loader`` into blocks; returns its dataset size."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        raise ValueError(
            f"invariant() reads a DataLoader over a map-style dataset (with __len__ and __getitem__), so that "
            f"every world size cuts the same epoch order into the same micro-batches; got {type(loader).__name__}"
            f"{' over an IterableDataset' if isinstance(loader, DataLoader) else ''}: build "
            "DataLoader(dataset, batch_size=b, shuffle=...)"
        )
    if loader.batch_size is None:
        raise ValueError("invariant() needs a DataLoader built with batch_size=... (the micro-batch size b); "
                         "this one has batch_size=None (a custom batch_sampler)")
    _shuffles(loader)
    return len(loader.dataset)  # type: ignore[arg-type]  # map-style: sized


def updates_per_epoch(loader: DataLoader, *, world_size: int, num_micro_batches: int) -> int:
    """Updates in one epoch: whole global batches of ``W * A * b`` samples."""
    num_samples = _check(loader)
    return num_samples // (world_size * num_micro_batches * loader.batch_size)  # type: ignore[operator]  # checked


def num_batches(loader: DataLoader, *, world_size: int, num_micro_batches: int) -> int:
    """This rank's micro-batches in one epoch (the same on every rank)."""
    return updates_per_epoch(loader, world_size=world_size, num_micro_batches=num_micro_batches) * num_micro_batches


def block_indices(num_samples: int, *, batch_size: int, rank: int, world_size: int, num_micro_batches: int,
                  shuffle: bool, seed: int, epoch: int) -> list[tuple[int, list[int]]]:
    """This rank's micro-batches of ``epoch``: ``(global micro-batch index, dataset indices)`` pairs."""
    order = list(range(num_samples))
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = torch.randperm(num_samples, generator=g).tolist()
    per_update = world_size * num_micro_batches
    updates = num_samples // (per_update * batch_size)
    mine = []
    for u in range(updates):
        for p in range(num_micro_batches):
            k = u * per_update + rank * num_micro_batches + p
            mine.append((k, order[k * batch_size:(k + 1) * batch_size]))
    return mine


class _BatchSampler(Sampler[Any]):
    """Fixed batches of indices (a DataLoader ``batch_sampler``)."""

    def __init__(self, batches: Sequence[Sequence[Any]]):
        self.batches = batches

    def __iter__(self) -> Iterator[Sequence[Any]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def block_loader(loader: DataLoader, *, seed: int, rank: int, world_size: int, num_micro_batches: int,
                 epoch: int, start: int) -> DataLoader:
    """A DataLoader of this rank's micro-batches of ``epoch`` from its ``start``-th on.

    Each micro-batch is fetched and collated with the RNGs (torch's CPU generator, Python's
    ``random``, NumPy's global one) seeded from ``(seed, epoch, global micro-batch index)``
    (``SeededFetch``), in DataLoader workers and in the main process alike, as one rank would
    draw them: random augmentation in ``__getitem__`` or the collate function does not depend
    on W. Without workers the generators are put back after each fetch.

    Raises:
        ValueError: a loader ``invariant()`` cannot cut into blocks.
    """
    num_samples = _check(loader)
    pairs = block_indices(num_samples, batch_size=loader.batch_size, rank=rank, world_size=world_size,  # type: ignore[arg-type]  # checked
                          num_micro_batches=num_micro_batches, shuffle=_shuffles(loader), seed=seed,
                          epoch=epoch)[start:]
    workers = loader.num_workers
    dataset = SeededFetch(loader.dataset, seed, epoch, 0, collate_fn=loader.collate_fn)
    batches: list[list[Any]] = [[(k, i) for i in indices] for k, indices in pairs]
    return DataLoader(
        dataset, batch_sampler=_BatchSampler(batches), num_workers=workers, collate_fn=only_batch,
        pin_memory=loader.pin_memory, timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context if workers else None,
        generator=worker_generator(seed, epoch, 0),
        prefetch_factor=loader.prefetch_factor if workers else None,
        persistent_workers=loader.persistent_workers if workers else False,
        pin_memory_device=loader.pin_memory_device,
    )


def epoch_length(data: Any, step: Step, *, rank: int, world_size: int) -> int | None:
    """This rank's micro-batches in one epoch of ``data`` as ``step`` reads it (under
    ``invariant()`` its blocks, else ``batches.num_batches``), or None when not known."""
    if step.find(Invariant) is None:
        return batches.num_batches(data, step.find(ShardData), rank=rank, world_size=world_size)
    accumulate = step.find(Accumulate)
    return num_batches(data, world_size=world_size,
                       num_micro_batches=accumulate.num_micro_batches if accumulate is not None else 1)


def epoch_blocks(data: Any, step: Step, *, rank: int, world_size: int, epoch: int, start: int,
                 place: Callable[[Any], Any]) -> batches.EpochBatches:
    """This rank's blocks of micro-batches of ``epoch`` under ``invariant()``, from micro-batch
    ``start`` on, each placed by ``place``: ``block_loader`` with ``step``'s ``shard_data`` seed
    and ``accumulate`` window.

    Raises:
        TypeError, ValueError: ``data`` is not a DataLoader ``invariant()`` can cut (``_check``).
    """
    shard, accumulate = step.find(ShardData), step.find(Accumulate)
    n = accumulate.num_micro_batches if accumulate is not None else 1
    total = num_batches(data, world_size=world_size, num_micro_batches=n)
    loader = block_loader(data, seed=shard.seed if shard is not None else 0, rank=rank, world_size=world_size,
                          num_micro_batches=n, epoch=epoch, start=start)
    return batches.EpochBatches(loader, num_batches=total, start=start, place=place)
