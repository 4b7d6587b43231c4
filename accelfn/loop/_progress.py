"""What a run reports: metrics reduced over ranks and turned into floats only at log points,
and only when something reads them (a tracker, or the progress bar); the process's memory;
and the run configuration handed to trackers (the user's hyperparameters and what accelfn
knows)."""

from __future__ import annotations

import os
import sys
import time
import types
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import attrs
import torch
from tqdm.auto import tqdm

from accelfn import distributed
from accelfn._version import __version__
from accelfn.backends.base import Backend
from accelfn.step import Step
from accelfn.tracking import ConfigTracker, Tracker
from accelfn.transforms import WithPrecision

try:
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]

#: the bar alone (one process, no tracker) reads the metrics at most this often
BAR_INTERVAL_S = 0.5
#: the memory (RSS, device peak) logged at a log point is at most this old
MEMORY_INTERVAL_S = 1.0
_COUNTS = ("num_samples", "num_items")  # summed over updates and ranks, not logged themselves
_MIB = 2.0**20


class Progress:
    """The progress bar (main process only) and the trackers of one ``run`` (main process
    only, except those with ``every_rank = True``, called on every process).

    Every update counts its samples (and an ``af.Loss``'s items) and ticks the bar. Every
    ``log_every``-th update, if a tracker or the bar reads them, the metrics are reduced
    across ranks (metrics averaged, counts summed, memory the maximum), read to the host,
    shown on the bar and written to the trackers at ``x = state.step``, with the rates since
    the previous log point. With the bar alone on one process they are read at most every
    ``BAR_INTERVAL_S``; with neither, never.
    """

    def __init__(self, backend: Backend, trackers: Sequence[Tracker], *, show: bool, log_every: int,
                 total: int | None, initial: int, copies: int = 1):
        self._backend = backend
        self._copies = copies  # ranks reading each sample (a tensor-parallel group's): counted once
        # a tracker with `every_rank = True` (af.RayTrain) is called on every process, with the same values
        self._trackers = (trackers if backend.is_main_process
                          else tuple(t for t in trackers if getattr(t, "every_rank", False) is True))
        self._log_every = log_every
        # the same on every rank (trackers and show are arguments of run), as the reduction is a collective
        self._read = bool(trackers) or show
        self._by_clock = not trackers and backend.world_size == 1
        self._host = backend.device.type == "cpu"  # float() per metric costs less than a stack there
        self._device_memory = backend.peak_memory_bytes() is not None
        self._memory_read_at = -float("inf")
        self._memory_bytes: list[float] = []
        self._updates = 0
        self._window_updates = 0
        self._samples = 0
        self._items: Any = None
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
        self._window_updates += 1
        self._samples += metrics["num_samples"]
        items = metrics.get("num_items")
        if items is not None:
            self._items = items if self._items is None else self._items + items
        skipped = metrics.get("skipped")  # a host int (0 or 1), present with fp16 or skip_nonfinite
        if skipped is not None:
            self._skipped += skipped
        if self._shown:
            self._bar.update(1)
        if not self._read or self._updates % self._log_every:
            return
        now = time.perf_counter()
        if self._by_clock and now - self._since < BAR_INTERVAL_S:
            return
        if skipped is not None:  # logged as the count over the logging window
            metrics = {**metrics, "skipped": self._skipped}
            self._skipped = 0
        values = self._reduce(metrics, max(now - self._since, 1e-9))
        self._window_updates, self._samples, self._items, self._since = 0, 0, None, now
        self.last = values
        if self._shown:
            rates = {"samples_s": f"{values['samples_per_s']:.4g}"}
            if "items_per_s" in values:
                rates["items_s"] = f"{values['items_per_s']:.4g}"
            self._bar.set_postfix(step=step, loss=f"{values['loss']:.4g}", **rates, refresh=False)
        for tracker in self._trackers:
            tracker.log(values, step)

    def _reduce(self, metrics: Mapping[str, Any], elapsed_s: float) -> dict[str, float]:
        """The metrics as floats averaged over ranks, the rates of the counts summed over ranks
        and the memory's maximum over ranks: at most three collectives (the first agrees on
        the metric names) and one device read.

        Raises:
            ValueError: on every rank, when the ranks' metric names differ (``loss_fn``
                returned other metrics on some rank); the message lists each rank's.
        """
        backend = self._backend
        memory = self._memory()
        if backend.world_size == 1 and self._host:
            values = {k: v.item() if isinstance(v, torch.Tensor) else float(v)
                      for k, v in metrics.items() if k not in _COUNTS}
            samples, items = float(self._samples), (None if self._items is None else float(self._items))
        else:
            names = [k for k in metrics if k not in _COUNTS]
            if backend.world_size > 1:  # reduced in sorted order: the same on every rank
                names = sorted(names)
                _check_same_names(backend, names)
            counts = [float(self._samples)] + ([] if self._items is None else [self._items])
            device = backend.collective_device
            # float64 from the start: a Python float (the lr) through float32 would log 0.10000000149
            stacked = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(())
                                   for v in [metrics[k] for k in names] + counts])
            if backend.world_size > 1:
                stacked = backend.reduce(stacked, "sum")
                memory = backend.reduce(torch.tensor(memory, dtype=torch.float64), "max").tolist()
            reduced = stacked.tolist()
            mean = dict(zip(names, reduced))
            # in the order loss_fn gave them
            values = {k: mean[k] / backend.world_size for k in metrics if k not in _COUNTS}
            samples = reduced[len(names)] / self._copies
            items = reduced[len(names) + 1] / self._copies if self._items is not None else None
        values["updates_per_s"] = self._window_updates / elapsed_s
        values["samples_per_s"] = samples / elapsed_s
        if items is not None:
            values["items_per_s"] = items / elapsed_s
        values["rss_mib"] = memory[0] / _MIB
        if len(memory) > 1:
            values["peak_device_mib"] = memory[1] / _MIB
        return values

    def _memory(self) -> list[float]:  # the caller must not change the list
        """[RSS, device peak] in bytes, read at most every MEMORY_INTERVAL_S (reading the RSS
        costs tens of microseconds on a busy machine; memory moves slowly)."""
        now = time.monotonic()
        if now - self._memory_read_at >= MEMORY_INTERVAL_S:
            self._memory_read_at = now
            self._memory_bytes = [float(rss_bytes())]
            if self._device_memory:
                self._memory_bytes.append(float(self._backend.peak_memory_bytes()))  # type: ignore[arg-type]
        return self._memory_bytes

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Writes ``values`` (a hook's, already the same on every rank) to the trackers at ``step``."""
        if values:
            for tracker in self._trackers:
                tracker.log(values, step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Hands the run configuration to every tracker that takes one (main process only)."""
        for tracker in self._trackers:
            if isinstance(tracker, ConfigTracker):
                tracker.log_config(config)

    def saved(self, step: int, path: Path) -> None:
        """Hands the checkpoint just written at ``step`` (complete on disk) to the trackers that
        take one (an optional ``saved(path, step)``), then flushes them."""
        for tracker in self._trackers:
            saved = getattr(tracker, "saved", None)
            if callable(saved):
                saved(path, step)
        self.flush()

    def save_requested(self) -> bool:
        """True when a tracker called on every rank asks for a checkpoint now (its
        ``save_requested`` attribute, the same on every rank: af.RayTrain on a preemption notice)."""
        return any(getattr(t, "every_rank", False) is True and getattr(t, "save_requested", False) is True
                   for t in self._trackers)

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
    if distributed.all_same([fingerprint, len(names)], device=backend.collective_device):
        return
    each = "; ".join(f"rank {r}: {', '.join(n)}" for r, n in enumerate(backend.gather_object(names)))
    raise ValueError(
        f"loss_fn returned other metrics on some ranks ({each}); metrics are averaged over the "
        "ranks name by name, so loss_fn must return the same metric names on every rank"
    )


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_statm: tuple[int, IO[bytes]] | None = None  # (pid, open /proc/self/statm of that process)


def rss_bytes() -> int:
    """This process's resident set size in bytes: the current one on Linux (the second field of
    ``/proc/self/statm``, kept open: a few microseconds a read), elsewhere the peak so far
    (``getrusage``, which on Linux can take a hundred microseconds); 0 where neither exists."""
    global _statm
    if sys.platform.startswith("linux"):
        if _statm is None or _statm[0] != os.getpid():  # opened by this process, not a parent
            _statm = (os.getpid(), open("/proc/self/statm", "rb"))  # noqa: SIM115 - kept open on purpose
        handle = _statm[1]
        handle.seek(0)
        return int(handle.read().split()[1]) * _PAGE_BYTES
    if resource is None:
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def check_config(config: Any) -> None:
    """Raises TypeError/ValueError for a ``run(config=...)`` that is not a mapping or uses ``"accelfn"``."""
    if config is None:
        return
    if not isinstance(config, Mapping):
        raise TypeError(f"run(config=...) takes a mapping of hyperparameters, e.g. config={{'lr': 3e-4}}, "
                        f"got {type(config).__name__}")
    if "accelfn" in config:
        raise ValueError("run(config=...) has a key 'accelfn', which is where run puts what it knows (transforms, "
                         "world size, ...); rename that key")


def _options(record: Any) -> Any:
    """A record's fields as plain values (nested records as mappings, dtypes as strings)."""
    if attrs.has(type(record)):
        return {f.name: _options(getattr(record, f.name)) for f in attrs.fields(type(record))}
    if record is None or isinstance(record, (bool, int, float, str)):
        return record
    if isinstance(record, types.FunctionType):  # replicate's comm_hook
        return f"{record.__module__}.{record.__qualname__}"
    return str(record)


def run_config(config: Mapping[str, Any] | None, step: Step, backend: Backend, data: Iterable[Any]) -> dict[str, Any]:
    """``config`` plus ``"accelfn"``: versions, backend, world size, precision, per-process
    batch size (the DataLoader's, else None) and each transform's options by its verb."""
    precision = step.find(WithPrecision)
    return {
        **(config or {}),
        "accelfn": {
            "version": __version__,
            "torch_version": torch.__version__,
            "backend": backend.name,
            "world_size": backend.world_size,
            "precision": precision.policy.name if precision is not None else "fp32",
            "batch_size": getattr(data, "batch_size", None),
            "transforms": {t.verb: _options(t) for t in step.transforms},
        },
    }
