"""A user's DataLoader rebuilt around another sampler or dataset, keeping everything else."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler


def rebuild(loader: DataLoader, *, dataset: Any = None, sampler: Sampler | None = None,
            generator: torch.Generator | None = None, collate_fn: Callable[[list[Any]], Any] | None = None,
            drop_last: bool | None = None, batch_size: int | None = None,
            cls: type[DataLoader] = DataLoader, **options: Any) -> DataLoader:
    """The same DataLoader (batch size, collate, workers, pinning) over a new sampler/dataset.

    Args:
        loader: the user's DataLoader.
        dataset, sampler, generator, collate_fn, drop_last, batch_size: what changes (None:
            the loader's own; the sampler and generator default to none).
        cls: the class to build (``DataLoader``, or torchdata's ``StatefulDataLoader``).
        options: further keyword arguments of ``cls`` (``snapshot_every_n_steps``).
    """
    workers = loader.num_workers
    return cls(
        loader.dataset if dataset is None else dataset,
        batch_size=loader.batch_size if batch_size is None else batch_size,
        sampler=sampler,
        num_workers=workers,
        collate_fn=loader.collate_fn if collate_fn is None else collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last if drop_last is None else drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context if workers else None,
        generator=generator,
        prefetch_factor=loader.prefetch_factor if workers else None,
        persistent_workers=loader.persistent_workers if workers else False,
        pin_memory_device=loader.pin_memory_device,
        **options,
    )
