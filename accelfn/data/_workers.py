"""DataLoader worker processes: per-batch seeding for exact resumes, and surviving SIGTERM.

Both act only through the DataLoader's own hooks (its dataset's ``__getitems__`` and its
``worker_init_fn``), so the user's loader keeps its workers, collate function and pinning.
"""

from __future__ import annotations

import random
import signal
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader


def worker_generator(seed: int, epoch: int, rank: int) -> torch.Generator:
    """The generator a rank's DataLoader draws its workers' base seed from in ``epoch``.

    Seeded from ``(seed, epoch, rank)`` (``numpy.random.SeedSequence``): the workers of every
    rank and epoch draw their own random augmentations (as ``DistributedSampler`` with a
    per-rank seed gives), and a resumed run, which rebuilds the same generator, draws the same.
    """
    state = np.random.SeedSequence([seed, epoch, rank]).generate_state(2)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


class SeededFetch(torch.utils.data.Dataset):
    """Fetches the samples of batch ``k`` of an epoch with the RNGs seeded from ``(seed, epoch, rank, k)``.

    In DataLoader workers, random augmentation otherwise depends on which worker fetches a
    batch and how many it fetched before, which a resumed run changes. Seeding torch,
    ``random`` and NumPy per batch (``numpy.random.SeedSequence``) makes every batch's random
    draws a function of its place in the epoch and of the rank that reads it, so ranks draw
    different augmentations and a resumed run reads the same batches, whatever the number of
    workers. Sampler keys are ``(batch number, dataset index)``.

    With ``collate_fn`` the batch is collated inside the keyed draws too (a random collate is
    keyed as the samples are) and returned as a list of one batch (the DataLoader's own
    ``collate_fn`` is then :func:`only_batch`). In the main process (no workers) the
    generators are put back afterwards, so the fetch leaves the program's own draws as they
    were; a worker's are left seeded (the DataLoader's collate, run next, draws from them).
    """

    def __init__(self, dataset: Any, seed: int, epoch: int, rank: int,
                 collate_fn: Callable[[list[Any]], Any] | None = None):
        self.dataset, self.seed, self.epoch, self.rank = dataset, seed, epoch, rank
        self.collate_fn = collate_fn

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[Any]:
        in_main = torch.utils.data.get_worker_info() is None
        saved = (torch.get_rng_state(), random.getstate(), np.random.get_state()) if in_main else None
        state = np.random.SeedSequence([self.seed, self.epoch, self.rank, keys[0][0]]).generate_state(2)
        torch.default_generator.manual_seed(int(state[0]) << 32 | int(state[1]))
        random.seed(int(state[0]))
        np.random.seed(int(state[1]))
        try:
            indices = [i for _, i in keys]
            fetch = getattr(self.dataset, "__getitems__", None)
            samples = fetch(indices) if fetch is not None else [self.dataset[i] for i in indices]
            return samples if self.collate_fn is None else [self.collate_fn(samples)]
        finally:
            if saved is not None:
                torch.set_rng_state(saved[0])
                random.setstate(saved[1])
                np.random.set_state(saved[2])

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.__getitems__([key])[0]

    def __len__(self) -> int:
        return len(self.dataset)


def only_batch(batches: list[Any]) -> Any:
    """The DataLoader ``collate_fn`` of a :class:`SeededFetch` that collates itself: its one batch."""
    return batches[0]


def start_iterating(data: Iterable[Any]) -> Iterator[Any]:
    """``iter(data)``; a DataLoader's worker processes are started ignoring SIGTERM.

    A scheduler preempts a job with SIGTERM to all its processes, DataLoader workers
    included, which die of it at once: their parent's next batch, or its SIGCHLD handler in
    the middle of a step, then raises ``DataLoader worker ... is killed by signal:
    Terminated`` instead of letting ``run`` finish the micro-batch and checkpoint. Workers
    that ignore SIGTERM keep serving until their parent shuts them down as usual (SIGINT
    already works so), or exit by themselves once it is gone (torch's worker watchdog).
    """
    if not (isinstance(data, DataLoader) and data.num_workers > 0):
        return iter(data)
    user_init = data.worker_init_fn
    data.worker_init_fn = _IgnoreSigterm(user_init)  # read once, when iter() starts the workers
    try:
        return iter(data)
    finally:
        data.worker_init_fn = user_init


class _IgnoreSigterm:
    """A DataLoader ``worker_init_fn`` that makes the worker ignore SIGTERM, then calls the
    user's (picklable, for the spawn and forkserver start methods)."""

    def __init__(self, user_init: Callable[[int], None] | None):
        self.user_init = user_init

    def __call__(self, worker_id: int) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.user_init is not None:
            self.user_init(worker_id)
