"""Trackers: where ``run`` writes metrics, one point per optimizer update at ``x = state.step``.

``run`` calls trackers on the main process only, with values already reduced over ranks,
so a multi-process run writes one JSONL file, and TensorBoard files from one process only.
"""

from __future__ import annotations

import os
import time
from array import array
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

import orjson

from accelfn.errors import check_directory, check_file, to_path
from accelfn.tracking._config import flatten
from accelfn.tracking._runs import Runs


@runtime_checkable
class Tracker(Protocol):
    """Receives metrics: ``log(metrics, step)``; ``close()`` flushes (it may log again later).

    A tracker may also have ``start(step)``: ``run`` calls it once before its first point
    with the step it starts from (``state.step``, after a resume the checkpoint's), so a
    tracker can hide what an interrupted run logged after that step (``TensorBoard`` does),
    and tell a second ``run`` through it that continues the same run from one that restarts
    from an earlier step (accelfn's trackers do, see ``accelfn.tracking._runs``); and
    and ``flush()``: ``run`` calls it after each checkpoint it writes, so the points up to a
    checkpoint are on disk when the process is killed after it; and ``saved(path, step)``:
    ``run`` calls it once each checkpoint it writes is complete on disk, before ``flush()``,
    with the checkpoint's directory and step (with ``Checkpoints(asynchronous=True)``, after
    the first update at which the ranks agree its background write has ended, or when the
    run ends; so possibly a few updates after ``step``). ``run`` calls a
    tracker on the main process only, unless it has ``every_rank = True``: then on every
    process, at the same points with the same values (``af.RayTrain``, whose reports are
    collectives); such a tracker may set ``save_requested = True`` in ``log``, and ``run``
    then writes a checkpoint after that update (``af.RayTrain`` on a preemption notice).
    """

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class ConfigTracker(Tracker, Protocol):
    """A tracker that also takes the run configuration: ``log_config(config)``, called by
    ``run`` once, on the main process, before the first ``log``. ``config`` is a nested
    mapping of plain values (numbers, strings, bools, None, lists), the user's
    ``run(config=...)`` with accelfn's own under ``"accelfn"``."""

    def log_config(self, config: Mapping[str, Any]) -> None: ...


class TensorBoard:
    """Writes scalars to TensorBoard event files (``tensorboardX.SummaryWriter``).

    The writer is created at the first ``log``, so processes that never log (ranks other
    than 0) create no file. Each writer (the first ``log``, and the first after a
    ``close()``) writes a file of its own, never one already there: tensorboardX names
    files by the second, so a second writer within the same second would otherwise
    truncate the first's file. ``run`` calls ``start(state.step)`` before it trains: the
    next file then begins with TensorBoard's restart marker (``purge_step``), which hides
    the points an earlier, interrupted run logged after that step, so a resumed run shows
    each step once. Nothing is deleted from the files. So is a second ``run`` through the
    same tracker: one that continues (phases, a ``run`` per epoch) adds its points after the
    earlier ones; one that restarts from an earlier step (``find_batch_size``'s retry)
    hides the abandoned attempt's points after that step.

    Args:
        logdir: the directory of the event file (created if missing).

    Raises:
        ValueError: ``logdir`` (or the nearest of its parents that exists) is a file.
        PermissionError: ``logdir`` cannot be written by this process.

    Example:
        >>> import accelfn as af
        >>> tracker = af.TensorBoard("runs/tb")
    """

    def __init__(self, logdir: str | os.PathLike[str]):
        self.logdir = to_path("TensorBoard", "logdir", logdir)
        check_directory(self.logdir, f"TensorBoard(logdir={str(logdir)!r})")
        self._writer: Any = None
        self._purge_step: int | None = None

    def __repr__(self) -> str:
        return f"TensorBoard({str(self.logdir)!r})"

    def start(self, step: int) -> None:
        """Called by ``run`` before its first point, with the step it starts from: points
        an earlier run logged at steps after ``step`` are hidden from TensorBoard (the
        restart marker of the next file, ``purge_step = step + 1``)."""
        self.close()
        self._purge_step = step + 1

    @property
    def writer(self) -> Any:
        """The ``tensorboardX.SummaryWriter`` of the current event file (opened if none is):
        for what ``run`` does not log (``tracker.writer.add_histogram(...)``). Use it on the
        main process only, as ``run`` does: on another process it opens a file of its own."""
        if self._writer is None:
            from tensorboardX import SummaryWriter

            # a name no other writer has (nanoseconds, then the process): files sort in the
            # order they were written, which is the order TensorBoard reads them in
            self._writer = SummaryWriter(logdir=str(self.logdir), purge_step=self._purge_step,
                                         filename_suffix=f".{time.time_ns()}.{os.getpid()}")
            self._purge_step = None
        return self._writer

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Adds each metric as a scalar at global step ``step``."""
        writer = self.writer
        for name, value in metrics.items():
            writer.add_scalar(name, value, global_step=step)

    def flush(self) -> None:
        """Writes every point logged so far to disk: closes the event file (tensorboardX's
        own ``flush`` leaves the points still queued for its writer thread); the next
        ``log`` opens a new one."""
        self.close()

    def close(self) -> None:
        """Flushes and closes the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Writes the configuration as TensorBoard hparams (nested keys joined by dots) to an
        event file of its own (``*.hparams``) in ``logdir``: the same run as the scalars, so
        the HParams dashboard shows it beside ``loss``."""
        from tensorboardX.summary import hparams
        from tensorboardX.writer import FileWriter

        self.logdir.mkdir(parents=True, exist_ok=True)
        writer = FileWriter(str(self.logdir), filename_suffix=".hparams")
        for summary in hparams(flatten(config), {"loss": None}):
            writer.add_summary(summary)
        writer.close()


class JSONL:
    """Appends one JSON object per log call to a file: ``{"step": ..., "loss": ..., ...}``.

    A second ``run`` through the same tracker that continues (it starts at or after the
    last step logged: phases, a ``run`` per epoch) appends after the earlier lines. One that
    restarts from an earlier step (``find_batch_size``'s retry after an out-of-memory error,
    a rerun from an earlier snapshot) first removes the lines this tracker object wrote for
    steps after the one it starts from, so each step is in the file once, the new run's;
    lines it did not write (an earlier process's, another writer's) are never touched (the
    file is then only appended to).

    Args:
        path: the file (its directory is created if missing); lines are appended.

    Raises:
        ValueError: ``path`` is a directory, or the nearest of its parents that exists is a file.
        PermissionError: ``path`` cannot be written by this process.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = to_path("JSONL", "path", path)
        check_file(self.path, f"JSONL(path={str(path)!r})")
        self._file: IO[bytes] | None = None
        self._runs = Runs()
        # the step and the offset of each line this object wrote (8 bytes each: long runs log millions)
        self._steps, self._offsets = array("q"), array("q")
        self._end: int | None = None  # the file's size after this object's last line

    def start(self, step: int) -> None:
        """Called by ``run`` before its first point: a restart from ``step`` removes the lines
        this object wrote for later steps (class docstring)."""
        if self._runs.start(step):
            self._cut(step)

    def _cut(self, step: int) -> None:
        index = next((i for i, logged in enumerate(self._steps) if logged > step), None)
        if index is None:
            return
        first = self._offsets[index]
        self.close()
        if not self.path.exists() or self.path.stat().st_size != self._end:
            return  # another writer appended since: its lines stay, and so do ours
        os.truncate(self.path, first)
        del self._steps[index:], self._offsets[index:]
        self._end = first

    def __repr__(self) -> str:
        return f"JSONL({str(self.path)!r})"

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Appends ``{"step": step, **metrics}`` as one line."""
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "ab")  # noqa: SIM115 - closed in close()
            if _ends_mid_line(self.path):  # a run killed while writing: its partial line stays on its own
                self._file.write(b"\n")
        offset = self._file.tell()
        self._file.write(orjson.dumps({"step": step, **metrics}) + b"\n")
        self._steps.append(step)
        self._offsets.append(offset)
        self._end = self._file.tell()
        self._runs.logged(step)

    def flush(self) -> None:
        """Hands the lines appended so far to the operating system."""
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        """Flushes and closes the file."""
        if self._file is not None:
            self._file.close()
            self._file = None


def _ends_mid_line(path: Path) -> bool:
    """True if the file at ``path`` is not empty and its last byte is not a newline."""
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"
