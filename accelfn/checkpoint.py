"""Checkpoints: a Snapshot on disk. ``save``, ``load``, ``Checkpoints`` and ``run``'s hooks.

A checkpoint is a directory: ``manifest.json`` (orjson via cattrs: format and library
versions, counters, per-rank RNG and transform states, optimizer/scheduler skeletons, the
program's transforms, sha256 of every tensor file), ``manifest.sha256`` (the manifest's own)
and ``.safetensors`` tensor files. It is written atomically (``accelfn._atomic``), loaded
without unpickling anything, verified against its checksums, and checked value by value
against the state it is loaded into before anything in that state changes.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import orjson
import torch

from accelfn import _atomic, _manifest, _restore, _serialize, _snapshot
from accelfn import collectives
from accelfn._agreement import Agreement
from accelfn._errors import CheckpointError
from accelfn._preemption import Preemption
from accelfn.state import TrainState

if TYPE_CHECKING:
    from accelfn.backends.base import Backend
    from accelfn.step import Step

__all__ = ["NO_PREEMPTION", "Checkpoints", "Preemption", "check_run_arguments", "load", "resume_state", "save"]

#: ``run``'s say in where a resumed epoch continues: called with the checkpoint's epoch,
#: its ``epoch_micro_step`` and the world size that wrote it, once the checkpoint is
#: verified and before it is loaded; returns the micro-batch to continue at, or raises
ResumePosition = Callable[[int, int, int], int]
#: what ``run`` enters instead of a Preemption when it has no checkpoints to write
NO_PREEMPTION = contextlib.nullcontext()
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


def _path(value: Any, fn: str) -> Path:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{fn}() takes a path (str or os.PathLike), got {type(value).__name__}")
    return Path(value)


def _context(backend: Backend | None) -> Backend | None:
    """The backend to coordinate ranks with: the given one, or in a multi-process world
    the one the launch environment describes; None in a world of one process."""
    if backend is not None or collectives.world_size() == 1:
        return backend
    from accelfn.backends.auto import auto

    return auto()


def _transforms(program: Step | None) -> Any:
    if program is None:
        return None
    records = [{"type": type(t).__name__, **_manifest.unstructure(t)} for t in program.transforms]
    return orjson.loads(_manifest.dumps(records))  # as it reads back from a manifest


def save(state: TrainState, path: str | os.PathLike[str], *, backend: Backend | None = None) -> Path:
    """Writes ``state`` as a checkpoint directory at ``path``, atomically.

    A collective in a multi-process world: call it on every rank. Every rank's RNG and
    transform states (and, mid-accumulation-window, its gradients) are gathered to rank 0,
    which writes; the others wait for it. An existing checkpoint at ``path`` is replaced
    only once the new one is complete, so a crash at any instant leaves the old or the new.

    Args:
        state: the state to save (nothing in it changes).
        path: the checkpoint directory to write.
        backend: the process context; by default none in one process, or the launch
            environment's (``af.backends.auto()``) in many.

    Returns:
        Path: ``path``.

    Raises:
        TypeError: ``state`` is not a TrainState, or ``path`` not a path.
        CheckpointError: ``path`` exists and is neither a checkpoint nor an empty directory
            (nothing is ever deleted that accelfn did not write), or rank 0 failed to write.
        ValueError: the optimizer updates a tensor that is not a parameter of the model.
        OSError: the file system refused (full disk, permissions); ``path`` is untouched.

    Example:
        >>> import tempfile, torch, accelfn as af
        >>> model = torch.nn.Linear(2, 1)
        >>> state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> path = af.save(state, tempfile.mkdtemp() + "/ckpt")
        >>> af.load(path, into=state).step
        0
    """
    return _save(state, _path(path, "save"), backend, transforms=None)


def _save(state: TrainState, path: Path, backend: Backend | None, transforms: Any) -> Path:
    if not isinstance(state, TrainState):
        raise TypeError(f"save() takes a TrainState first, got {type(state).__name__}")
    backend = _context(backend)
    snap = _snapshot.capture(state, copy=False)
    part = _serialize.rank_part(snap)
    world_size = backend.world_size if backend is not None else 1
    parts = [part] if world_size == 1 else _serialize.gather_parts(backend, part)  # type: ignore[arg-type]
    failure: BaseException | None = None
    if backend is None or backend.is_main_process:
        try:
            _atomic.write_directory(path, lambda d: _serialize.write(d, snap, parts, transforms))
        except BaseException as e:  # re-raised below, after telling the other ranks
            failure = e
    if world_size > 1:
        written = backend.broadcast(torch.tensor([int(failure is None)], dtype=torch.int64))  # type: ignore[union-attr]
        # A gloo worker thread may drop its reference to ``written`` just after the call
        # returned; were the script to exit at that instant, freeing the tensor would need
        # the GIL during interpreter shutdown and abort the process (std::terminate). A
        # barrier (no Python tensor in it) while ``written`` is held lets that happen first.
        backend.barrier()  # type: ignore[union-attr]
        if failure is None and not int(written.item()):
            raise CheckpointError(f"rank 0 failed to write the checkpoint {path}; its error says why")
    if failure is not None:
        raise failure
    return path


def _not_found(path: Path) -> str:
    if path.is_dir():
        return (f"{path} is not a complete accelfn checkpoint (it has no manifest.json): "
                "a save that was interrupted, or not a checkpoint")
    return f"no checkpoint at {path}"


def load(path: str | os.PathLike[str], *, into: TrainState, backend: Backend | None = None) -> TrainState:
    """Restores the checkpoint at ``path`` into ``into`` (in place) and returns the state.

    Nothing is unpickled: tensors come from ``.safetensors`` files, everything else from
    JSON. Every file's sha256 is verified (the manifest's against ``manifest.sha256``), the
    manifest's values are checked (counters are ints >= 0, RNG states fit their generators),
    and the checkpoint is checked against ``into`` (every missing, unexpected or mismatched
    key, shape and dtype, and every value of another kind than the one it replaces, such as
    a str learning rate, is reported) before anything in ``into`` changes. Tensors are read
    to the CPU, then copied to the state's device. Each rank restores its own RNG and
    transform states (rank 0's when the checkpoint was written by fewer processes).

    Args:
        path: a checkpoint directory written by ``af.save`` or ``af.Checkpoints``.
        into: a state built like the saved one (same model architecture, optimizer type
            and parameter groups, scheduler type, ``extra`` names).
        backend: the process context (as for ``save``).

    Returns:
        TrainState: ``into`` with the checkpoint's tensors, counters and transform states.

    Raises:
        TypeError: ``into`` is not a TrainState, or ``path`` not a path.
        CheckpointError: no complete checkpoint at ``path``; a missing, truncated or
            corrupted file (named); an invalid value in the manifest (the field named); a
            newer format; a mismatch with ``into``; or a checkpoint saved
            mid-accumulation-window loaded by another number of processes.
    """
    state, _ = _load(_path(path, "load"), into, backend)
    return state


def _load(path: Path, into: TrainState, backend: Backend | None,
          position: ResumePosition | None = None) -> tuple[TrainState, _manifest.Manifest]:
    if not isinstance(into, TrainState):
        raise TypeError(f"load(into=...) takes a TrainState, got {type(into).__name__}")
    backend = _context(backend)
    rank, world_size = (backend.rank, backend.world_size) if backend is not None else (0, 1)
    directory = _atomic.resolve(path)
    if directory is None:
        raise CheckpointError(_not_found(path))
    manifest = _manifest.read(directory)
    snap = _serialize.read(directory, manifest, rank=rank, world_size=world_size)
    try:
        names = _serialize.field_names(_serialize.section(manifest, rank))
        _restore.verify(into, snap, source=_manifest.MANIFEST, names=names)
    except CheckpointError as e:
        raise CheckpointError(f"{directory}: {e}") from None
    if position is not None:
        counters = snap.counters
        start = position(counters["epoch"], counters["epoch_micro_step"], manifest.world_size)
        snap = attrs.evolve(snap, counters={**counters, "epoch_micro_step": start})
    return _restore.put(into, snap, copy=False), manifest


def _positive(name: str, value: Any, kind: type | tuple[type, ...]) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"Checkpoints({name}=...) must be {'an int' if kind is int else 'a number'}, got {value!r}")
    if not (value >= 1 if kind is int else math.isfinite(value) and value > 0):
        raise ValueError(f"Checkpoints({name}={value!r}): must be {'>= 1' if kind is int else 'a finite number > 0'}")


class Checkpoints:
    """Where and how often ``run`` saves: ``directory/step_00000100``, keeping the last ``keep``.

    After an optimizer update, ``run`` saves when ``state.step`` is a multiple of
    ``every_steps`` or a new period of ``every_seconds`` began (in a multi-process world the
    ranks agree on the clock, one update late, without blocking); and on SIGTERM/SIGINT,
    mid-window if need be. A checkpoint is named by ``state.step``; once a new one is
    complete, the oldest beyond ``keep`` are deleted. ``run(resume="auto")`` resumes from
    ``latest()``.

    Args:
        directory: the directory holding the checkpoints (created when needed).
        every_steps: save every this many optimizer updates, or None.
        every_seconds: save at most once per this many seconds of training, or None.
        keep: how many checkpoints to keep (the newest by step), or None for all.

    Raises:
        TypeError: a directory that is not a path, or counts of the wrong type.
        ValueError: ``every_steps`` or ``keep`` below 1, ``every_seconds`` not > 0.

    Example:
        >>> import tempfile, accelfn as af
        >>> checkpoints = af.Checkpoints(tempfile.mkdtemp(), every_steps=500, keep=3)
        >>> checkpoints.path_for(1500).name
        'step_00001500'
    """

    def __init__(self, directory: str | os.PathLike[str], *, every_steps: int | None = None,
                 every_seconds: float | None = None, keep: int | None = None):
        self.directory = _path(directory, "Checkpoints")
        _positive("every_steps", every_steps, int)
        _positive("every_seconds", every_seconds, (int, float))
        _positive("keep", keep, int)
        self.every_steps, self.every_seconds, self.keep = every_steps, every_seconds, keep
        self._transforms: Any = None
        self._last_step: int | None = None
        self._clock: Agreement | None = None
        self._start: float | None = None
        self._saved_period = 0

    def __repr__(self) -> str:
        return (f"Checkpoints({str(self.directory)!r}, every_steps={self.every_steps}, "
                f"every_seconds={self.every_seconds}, keep={self.keep})")

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
        return sorted(int(_STEP_DIR.match(n)[1]) for n in names  # type: ignore[index]
                      if _atomic.resolve(self.directory / n) is not None)

    def latest(self) -> Path | None:
        """The checkpoint with the highest step, or None if there is none yet."""
        steps = self.steps()
        return self.path_for(steps[-1]) if steps else None

    def save(self, state: TrainState, backend: Backend | None = None) -> Path:
        """Saves ``state`` as ``path_for(state.step)`` (a collective), then applies ``keep``.

        Raises:
            CheckpointError, OSError: as ``af.save``.
        """
        path = self.path_for(state.step)
        backend = _context(backend)
        main = backend is None or backend.is_main_process
        if main:
            for name in {n for n, _, _ in _atomic.leftovers(self.directory) if _STEP_DIR.match(n)}:
                _atomic.recover(self.directory / name)
        _save(state, path, backend, self._transforms)
        if main and self.keep is not None:
            for step in self.steps()[:-self.keep]:
                if step != state.step:
                    _atomic.remove(self.path_for(step))
        self._last_step = state.step
        return path

    def maybe_save(self, state: TrainState, backend: Backend) -> Path | None:
        """Saves ``state`` if a checkpoint is due after this optimizer update (call it after
        every update, on every rank); returns the path written, or None."""
        due = self.every_steps is not None and state.step % self.every_steps == 0
        period = 0
        if self.every_seconds is not None:
            now = time.monotonic()
            if self._start is None:
                self._start = now
            if self._clock is None:
                self._clock = Agreement(backend.world_size, backend.env.timeout_s)
            period = self._clock.propose(int((now - self._start) // self.every_seconds))
            due = due or period > self._saved_period
        if not due or state.step == self._last_step:
            return None
        self._saved_period = max(self._saved_period, period)
        return self.save(state, backend)

    def _begin(self, program: Step | None) -> None:
        self._transforms = _transforms(program)
        self._last_step, self._start, self._saved_period = None, time.monotonic(), 0

    def _latest_agreed(self, backend: Backend) -> Path | None:
        latest = self.latest()
        if backend.world_size == 1:
            return latest
        step = -1 if latest is None else int(latest.name.removeprefix("step_"))
        step = int(backend.broadcast(torch.tensor([step], dtype=torch.int64)).item())
        return None if step < 0 else self.path_for(step)


def check_run_arguments(checkpoints: Any, resume: Any) -> None:
    """Validates ``run``'s ``checkpoints`` and ``resume`` before anything happens.

    Raises:
        TypeError: ``checkpoints`` not a Checkpoints, ``resume`` neither a path nor "auto".
        ValueError: ``resume="auto"`` without ``checkpoints``.
        CheckpointError: ``resume`` names a path with no complete checkpoint.
    """
    if checkpoints is not None and not isinstance(checkpoints, Checkpoints):
        raise TypeError(f"run(checkpoints=...) takes af.Checkpoints(directory, ...), got {checkpoints!r}")
    if resume is None:
        return
    if isinstance(resume, str) and resume == "auto":
        if checkpoints is None:
            raise ValueError(
                "run(resume='auto') resumes from the latest checkpoint of run(checkpoints=...); "
                "pass checkpoints=af.Checkpoints(directory), or resume=<path of a checkpoint>"
            )
        return
    if not isinstance(resume, (str, os.PathLike)):
        raise TypeError(f"run(resume=...) takes 'auto' or the path of a checkpoint, got {resume!r}")
    if _atomic.resolve(Path(resume)) is None:
        raise CheckpointError(f"run(resume={str(resume)!r}): {_not_found(Path(resume))} (to resume from the "
                              "latest checkpoint of checkpoints=..., if any, pass resume='auto')")


def resume_state(state: TrainState, checkpoints: Checkpoints | None, resume: Any, backend: Backend,
                 *, program: Step | None = None, position: ResumePosition | None = None) -> TrainState:
    """The state ``run`` starts from: ``state``, or the checkpoint ``resume`` asks for.

    ``resume="auto"`` takes the latest checkpoint of ``checkpoints`` (rank 0's view, shared
    with every rank) and starts fresh when there is none. Warns when the checkpoint was
    written by a program with other transforms. ``position`` (see ``ResumePosition``) sets
    the micro-batch the resumed epoch continues at, or refuses it, before ``state`` changes.

    Raises:
        CheckpointError: as ``load``; for ``resume="auto"``, the message also names the
            previous complete checkpoint to resume from instead.
        ValueError: as ``position``.
    """
    if checkpoints is not None:
        checkpoints._begin(program)
    if resume is None:
        return state
    path = checkpoints._latest_agreed(backend) if resume == "auto" else Path(resume)  # type: ignore[union-attr]
    if path is None:
        return state
    try:
        state, manifest = _load(path, state, backend, position)
    except CheckpointError as e:
        if resume != "auto":
            raise
        raise CheckpointError(f"{e}\n{_fallback(checkpoints, path)}") from None  # type: ignore[arg-type]
    if checkpoints is not None:
        checkpoints._last_step = state.step
    now = _transforms(program)
    if manifest.transforms is not None and now is not None and manifest.transforms != now:
        warnings.warn(f"{path} was written by a program with the transforms {manifest.transforms}; this "
                      f"program has {now}, so the resumed run differs from an uninterrupted one",
                      stacklevel=3)
    backend.print(f"accelfn: resumed from {path} at step {state.step} (epoch {state.epoch}, "
                  f"micro-batch {state.epoch_micro_step} of it)", file=sys.stderr)
    return state


def _fallback(checkpoints: Checkpoints, failed: Path) -> str:
    """What to do when the latest checkpoint of ``checkpoints`` (``failed``) does not load."""
    earlier = [step for step in checkpoints.steps() if checkpoints.path_for(step) != failed]
    previous = (f"resume from the previous one with run(resume={str(checkpoints.path_for(earlier[-1]))!r}, ...) "
                f"or move {failed} aside so that resume='auto' takes it" if earlier
                else "start a fresh run (there is no earlier checkpoint)")
    return (f"run(resume='auto'): the latest checkpoint, {failed}, failed to load; it is not skipped, since "
            f"that could hide a bug. If it is damaged, {previous}")
