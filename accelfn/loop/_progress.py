"""Metrics of a run: reduced over ranks and turned into floats only every ``log_every`` updates."""

from __future__ import annotations

import time
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from accelfn.backends.base import Backend
from accelfn.tracking import Tracker


class Progress:
    """The progress bar (main process only) and the trackers of one ``run``.

    Every update counts its samples and ticks the bar; every ``log_every``-th update the
    metrics are reduced across ranks in one collective, read to the host, shown on the bar
    and written to the trackers at ``x = state.step``.
    """

    def __init__(self, backend: Backend, trackers: Sequence[Tracker], *, show: bool, log_every: int,
                 total: int | None, initial: int):
        self._backend = backend
        self._trackers = trackers if backend.is_main_process else ()
        self._log_every = log_every
        self._updates = 0
        self._samples = 0
        self._since = time.perf_counter()
        self._shown = show and backend.is_main_process
        self._skipped = 0  # updates skipped (non-finite gradients) since the last log point
        self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, disable=not self._shown)
        self.last: dict[str, float] = {}
        for tracker in self._trackers:  # the optional start(step): the run logs only after `initial`
            start = getattr(tracker, "start", None)
            if callable(start):
                start(initial)

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Records one optimizer update (applied or skipped) that ended at ``step``."""
        self._updates += 1
        self._samples += metrics["num_samples"]
        skipped = metrics.get("skipped")  # a host int (0 or 1), present with fp16 or skip_nonfinite
        if skipped is not None:
            self._skipped += skipped
        if self._shown:
            self._bar.update(1)
        if self._updates % self._log_every:
            return
        if skipped is not None:  # logged as the count over the logging window
            metrics = {**metrics, "skipped": self._skipped}
            self._skipped = 0
        values = self._reduce(metrics)
        now = time.perf_counter()
        values["samples_per_s"] = self._samples * self._backend.world_size / max(now - self._since, 1e-9)
        self._samples, self._since = 0, now
        self.last = values
        if self._backend.is_main_process:
            self._bar.set_postfix(step=step, loss=f"{values['loss']:.4g}",
                                  samples_s=f"{values['samples_per_s']:.4g}", refresh=False)
            for tracker in self._trackers:
                tracker.log(values, step)

    def _reduce(self, metrics: Mapping[str, Any]) -> dict[str, float]:
        """The metrics as floats, averaged over ranks: one collective and one device read
        (two in a multi-process world, where the ranks first agree on the metric names).

        Raises:
            ValueError: on every rank, when the ranks' metric names differ (``loss_fn``
                returned other metrics on some rank); the message lists each rank's.
        """
        names = [k for k in metrics if k != "num_samples"]
        device = self._backend.collective_device
        if self._backend.world_size > 1:  # reduced in sorted order: the same on every rank
            names = sorted(names)
            _check_same_names(self._backend, names)
        # float64 from the start: a Python float (the lr) through float32 would log 0.10000000149
        stacked = torch.stack([torch.as_tensor(metrics[k], dtype=torch.float64, device=device).reshape(())
                               for k in names])
        if self._backend.world_size > 1:
            stacked = self._backend.reduce(stacked, "mean")
        values = dict(zip(names, stacked.tolist()))
        return {k: values[k] for k in metrics if k != "num_samples"}  # in the order loss_fn gave them

    def flush(self) -> None:
        """Has the trackers that can (an optional ``flush()``) write their points to disk."""
        for tracker in self._trackers:
            flush = getattr(tracker, "flush", None)
            if callable(flush):
                flush()

    def close(self) -> None:
        """Closes the bar and flushes the trackers."""
        self._bar.close()
        for tracker in self._trackers:
            tracker.close()


def _check_same_names(backend: Backend, names: list[str]) -> None:
    """Raises on every rank unless every rank reduces the same metric names.

    The all-reduce of the metrics pairs the ranks' tensors element by element: with other
    names (or another number of them) on some rank it would average unrelated values or
    wait forever for a tensor of another size. One all-reduce of a fingerprint of the names
    finds out first; only when they differ are the names themselves gathered, for the message.
    """
    fingerprint = zlib.crc32("\0".join(names).encode())
    t = torch.tensor([fingerprint, len(names), -fingerprint, -len(names)], dtype=torch.int64,
                     device=backend.collective_device)
    highest, longest, lowest, shortest = backend.reduce(t, "max").tolist()
    if highest == -lowest and longest == -shortest:
        return
    each = "; ".join(f"rank {r}: {', '.join(n)}" for r, n in enumerate(backend.gather_object(names)))
    raise ValueError(
        f"loss_fn returned other metrics on some ranks ({each}); metrics are averaged over the "
        "ranks name by name, so loss_fn must return the same metric names on every rank"
    )
