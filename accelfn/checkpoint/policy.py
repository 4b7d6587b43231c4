"""``Checkpoints``: where and how often ``run`` saves, and how many it keeps (a frozen record).

The record is configuration only: the clock of a schedule and the last step saved belong to
the run that uses it (``accelfn.loop``), so one ``Checkpoints`` serves any number of runs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import attrs

from accelfn.checkpoint import _atomic
from accelfn.checkpoint._context import ProcessContext, default_context
from accelfn.checkpoint.io import Collected, save_checkpoint, write_collected
from accelfn.errors import boolean, check_directory, count_at_least_one, finite_positive, to_path
from accelfn.state import TrainState

_STEP_DIR = re.compile(r"^step_(\d{8,})$")


def _directory(value: Any) -> Path:
    return to_path("Checkpoints", "directory", value)


def _writable(instance: Any, attribute: Any, value: Path) -> None:
    check_directory(value, f"Checkpoints({str(value)!r})")


@attrs.frozen(repr=False)
class Checkpoints:
    """Where and how often ``run`` saves: ``directory/step_00000100``, keeping the last ``keep``.

    After an optimizer update, ``run`` saves when ``state.step`` is a multiple of
    ``every_steps`` or a new period of ``every_seconds`` began (in a multi-process world the
    ranks agree on the clock, one update late, without blocking); and on SIGTERM/SIGINT,
    mid-window if need be. A checkpoint is named by ``state.step``; once a new one is
    complete, the oldest beyond ``keep`` are deleted. ``run(resume="auto")`` resumes from
    ``latest()``. The record is frozen: ``run`` keeps its schedule's clock itself.

    With ``asynchronous=True``, ``run`` is blocked per checkpoint only while the state is
    copied to host memory (buffers allocated at the first checkpoint and reused, pinned on
    CUDA) and, in a multi-process world, each rank's own part is gathered; the files are
    written, fsynced, renamed into place and old checkpoints deleted in a background thread
    while training goes on (``accelfn.checkpoint.background``). A checkpoint waits for the
    previous one, so at most one host copy of the state exists. A failed background write
    is raised by ``run`` after the next optimizer update (on every rank), or when ``run``
    ends; ``run`` waits for the checkpoint in flight when it ends, on SIGTERM/SIGINT (then
    writes its last checkpoint synchronously) and when an error ends it, and so does the
    interpreter at exit. A process killed outright leaves the previous checkpoint intact.
    It is off by default: it holds a second copy of the state in host memory for the whole
    run, and on a CPU-only machine the background write competes with training for the
    same cores; switch it on where checkpoints are large and host memory is ample (on GPUs,
    especially).

    Args:
        directory: the directory holding the checkpoints (created when needed).
        every_steps: save every this many optimizer updates, or None.
        every_seconds: save at most once per this many seconds of training, or None.
        keep: how many checkpoints to keep (the newest by step), or None for all.
        asynchronous: write ``run``'s checkpoints in the background (``save`` itself is
            always synchronous; so are the checkpoints of a sharded state, which every rank
            writes through ``torch.distributed.checkpoint``).

    Raises:
        TypeError: a directory that is not a path, counts of the wrong type, or an
            ``asynchronous`` that is not a bool.
        ValueError: ``every_steps`` or ``keep`` below 1, ``every_seconds`` not > 0;
            ``directory`` (or the nearest of its parents that exists) is a file: checked
            here and again when ``run`` starts, not at the first save.
        PermissionError: ``directory`` cannot be written by this process.

    Example:
        >>> import tempfile, accelfn as af
        >>> checkpoints = af.Checkpoints(tempfile.mkdtemp(), every_steps=500, keep=3)
        >>> checkpoints.path_for(1500).name
        'step_00001500'
    """

    directory: Path = attrs.field(converter=_directory, validator=_writable)
    every_steps: int | None = attrs.field(
        default=None, kw_only=True, validator=attrs.validators.optional(count_at_least_one))
    every_seconds: float | None = attrs.field(
        default=None, kw_only=True, validator=attrs.validators.optional(finite_positive))
    keep: int | None = attrs.field(
        default=None, kw_only=True, validator=attrs.validators.optional(count_at_least_one))
    asynchronous: bool = attrs.field(default=False, kw_only=True, validator=boolean)

    def __repr__(self) -> str:
        return (f"Checkpoints({str(self.directory)!r}, every_steps={self.every_steps}, "
                f"every_seconds={self.every_seconds}, keep={self.keep}, asynchronous={self.asynchronous})")

    def path_for(self, step: int) -> Path:
        """The directory of the checkpoint at optimizer step ``step``."""
        return self.directory / f"step_{step:08d}"

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints, ascending (unfinished writes are ignored)."""
        try:
            names = {e.name for e in os.scandir(self.directory) if _STEP_DIR.match(e.name)}
        except FileNotFoundError:
            return []
        names |= {name for name, _, _ in _atomic.leftovers(self.directory) if _STEP_DIR.match(name)}
        return sorted(int(n.removeprefix("step_")) for n in names
                      if _atomic.resolve(self.directory / n) is not None)

    def latest(self) -> Path | None:
        """The checkpoint with the highest step, or None if there is none yet."""
        steps = self.steps()
        return self.path_for(steps[-1]) if steps else None

    def save(self, state: TrainState, backend: ProcessContext | None = None, *, transforms: Any = None) -> Path:
        """Saves ``state`` as ``path_for(state.step)`` (a collective), then applies ``keep``.

        Args:
            state: the state to save.
            backend: the process context, as for ``af.save``.
            transforms: the program's transforms as plain data, recorded in the manifest
                so that a resume with other transforms warns (``run`` passes them).

        Raises:
            CheckpointError, OSError: as ``af.save``.
        """
        path = self.path_for(state.step)
        backend = default_context(backend)
        if backend.is_main_process:
            self._recover()
        save_checkpoint(state, path, backend, transforms)
        if backend.is_main_process:
            self._retain(state.step)
        return path

    def write(self, path: Path, collected: Collected) -> None:
        """Rank 0's half of ``save`` (``run`` calls it in a background thread): finishes or
        removes leftovers of interrupted writes, writes ``collected`` as ``path``
        atomically, then applies ``keep``.

        Raises:
            CheckpointError, OSError: as ``af.save``.
        """
        self._recover()
        write_collected(path, collected)
        self._retain(int(path.name.removeprefix("step_")))

    def _recover(self) -> None:
        for name in {n for n, _, _ in _atomic.leftovers(self.directory) if _STEP_DIR.match(n)}:
            _atomic.recover(self.directory / name)

    def _retain(self, step: int) -> None:
        if self.keep is not None:
            for old in self.steps()[:-self.keep]:
                if old != step:
                    _atomic.remove(self.path_for(old))
