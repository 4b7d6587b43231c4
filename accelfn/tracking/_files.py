"""Trackers: where ``run`` writes metrics, one point per optimizer update at ``x = state.step``.

``run`` calls trackers on the main process only, with values already reduced over ranks,
so a multi-process run writes one TensorBoard event file and one JSONL file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

import orjson

from accelfn.tracking._config import flatten


@runtime_checkable
class Tracker(Protocol):
    """Receives metrics: ``log(metrics, step)``; ``close()`` flushes (it may log again later)."""

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
    """Writes scalars to a TensorBoard event file (``tensorboardX.SummaryWriter``).

    The writer is created at the first ``log``, so processes that never log (ranks other
    than 0) create no file.

    Args:
        logdir: the directory of the event file (created if missing).

    Raises:
        ValueError: ``logdir`` exists and is not a directory.

    Example:
        >>> import accelfn as af
        >>> tracker = af.TensorBoard("runs/tb")
    """

    def __init__(self, logdir: str | os.PathLike[str]):
        self.logdir = Path(logdir)
        if self.logdir.exists() and not self.logdir.is_dir():
            raise ValueError(f"TensorBoard(logdir={str(logdir)!r}) is a file; give a directory for the event files")
        self._writer: Any = None

    def __repr__(self) -> str:
        return f"TensorBoard({str(self.logdir)!r})"

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Adds each metric as a scalar at global step ``step``."""
        if self._writer is None:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(logdir=str(self.logdir))
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, global_step=step)

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

    Args:
        path: the file (its directory is created if missing); lines are appended.

    Raises:
        ValueError: ``path`` is a directory.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if self.path.is_dir():
            raise ValueError(f"JSONL(path={str(path)!r}) is a directory; give a file path, "
                             f"e.g. {str(path)!r} + '/metrics.jsonl'")
        self._file: IO[bytes] | None = None

    def __repr__(self) -> str:
        return f"JSONL({str(self.path)!r})"

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Appends ``{"step": step, **metrics}`` as one line."""
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "ab")  # noqa: SIM115 - closed in close()
        self._file.write(orjson.dumps({"step": step, **metrics}) + b"\n")

    def close(self) -> None:
        """Flushes and closes the file."""
        if self._file is not None:
            self._file.close()
            self._file = None
