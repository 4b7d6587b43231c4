"""``Checkpoints``: where and how often ``run`` saves, step names both ways, retention, and
each run's schedule of saves, written in the background or not.

``Checkpoints`` is frozen configuration: one serves any number of runs. What changes while a
run trains (the clock of ``every_seconds``, the step saved last, the save in flight in the
background) lives in the run's ``Schedule`` (``Checkpoints.schedule``).

Background saves follow orbax's ``AsyncCheckpointer`` and torchtitan's asynchronous mode:

* **In the training thread**: wait for the previous save (so at most one host copy is in
  flight, and saves complete in order), copy every tensor of the state into host buffers
  (``HostBuffers``: allocated at the first save and reused after, pinned on CUDA so the
  device-to-host copies run asynchronously, then synchronized), and in a multi-process world
  gather every rank's own part to rank 0 (``save_load.collect``). The gather is a
  collective, so it stays here: the background thread runs no collective, and none of its
  work can interleave with training's distributed.
* **In the background thread** (rank 0 only): the files are written and hashed, fsynced,
  the manifest written last, the directory renamed into place and old checkpoints deleted,
  exactly as a synchronous save does, so a crash at any instant leaves the previous
  checkpoint or the new one, and ``latest()`` never sees a partial one. The thread runs at
  a lower scheduling priority (Linux), so that where it competes with training for CPU
  cores, training wins.
* **Errors are never lost**: a failed write is kept and raised in the training thread after
  the next optimizer update (the ranks agree on it one update late, without blocking, and
  all raise at the same update), by the next save, or when ``run`` ends, naming the
  checkpoint and the cause.
* **Exit**: ``run`` waits for the save in flight when it ends, before a preemption's final
  checkpoint, and when an error ends it; the thread is not a daemon, so the interpreter also
  waits for it at exit. A process killed outright abandons the save; the atomic write leaves
  the previous checkpoint intact.

A sharded state's checkpoints (``shard_params``), and a pipelined state's (``pipeline``), are
always written synchronously: every rank writes its own shards (or stages) through
``torch.distributed.checkpoint``, whose save plans with distributed.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from accelfn import distributed
from accelfn.checkpoint import _atomic
from accelfn.checkpoint.save_load import Collected, collect, write, writes_sharded
from accelfn.distributed import Agreement, ProcessContext
from accelfn.errors import CheckpointError, boolean, check_directory, count_at_least_one, finite_positive, to_path
from accelfn.state import TrainState, require_state

if TYPE_CHECKING:
    from accelfn.step import Step

_STEP_DIR = re.compile(r"^step_(\d{8,})$")
#: how much lower the writing threads' scheduling priority is than training's (Linux nice)
BACKGROUND_NICENESS = 10


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
    while training goes on (this module's docstring has the design). A checkpoint waits for
    the previous one, so at most one host copy of the state exists. A failed background
    write is raised by ``run`` after the next optimizer update (on every rank), or when
    ``run`` ends; ``run`` waits for the checkpoint in flight when it ends, on SIGTERM/SIGINT
    (then writes its last checkpoint synchronously) and when an error ends it, and so does
    the interpreter at exit. A process killed outright leaves the previous checkpoint intact.
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

    @staticmethod
    def step_of(path: Path) -> int | None:
        """The optimizer step a checkpoint directory's name gives (``step_00000100``: 100),
        or None for a name ``path_for`` does not make."""
        return int(path.name.removeprefix("step_")) if _STEP_DIR.match(path.name) else None

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints, ascending (unfinished writes are ignored)."""
        try:
            names = {e.name for e in os.scandir(self.directory)}
        except FileNotFoundError:
            return []
        names |= {name for name, _, _ in _atomic.leftovers(self.directory)}
        found = {step for name in names if (step := self.step_of(Path(name))) is not None}
        return sorted(step for step in found if _atomic.resolve(self.path_for(step)) is not None)

    def latest(self) -> Path | None:
        """The checkpoint with the highest step, or None if there is none yet."""
        steps = self.steps()
        return self.path_for(steps[-1]) if steps else None

    def save(self, state: TrainState, backend: ProcessContext | None = None, *, program: Step | None = None) -> Path:
        """Saves ``state`` as ``path_for(state.step)`` (a collective), then applies ``keep``.

        Args:
            state: the state to save.
            backend: the process context, as for ``af.save``.
            program: the program whose transforms the manifest records, so that a resume
                with other transforms warns (``run`` passes its own).

        Raises:
            TypeError: ``state`` is not a TrainState (before anything is written).
            CheckpointError, OSError: as ``af.save``.
        """
        require_state("Checkpoints.save(state)", state)
        path = self.path_for(state.step)
        main = backend.is_main_process if backend is not None else distributed.rank() == 0
        with _atomic.writing(self.directory) if main else contextlib.nullcontext():
            if main:
                self._recover()
            write(state, path, backend, program=program, earlier=self.latest() if main else None)
            if main:
                self._retain(state.step)
        return path

    def schedule(self, backend: ProcessContext, *, program: Step | None, timeout_s: float) -> Schedule:
        """This policy's saves during one run (``run`` makes one per call).

        Args:
            backend: the run's process context (its ranks agree on the clock).
            program: the program, whose transforms each manifest records.
            timeout_s: how long a rank waits for the others' agreement (seconds).

        Raises:
            CheckpointError: another process is writing in ``directory`` (rank 0 holds the
                directory's write lock from here until the schedule's ``close``).
        """
        return Schedule(self, backend, program=program, timeout_s=timeout_s)

    def _write(self, path: Path, collected: Collected) -> None:
        """Rank 0's writing of ``path`` (in a background thread): finishes or removes
        leftovers of interrupted writes, writes (frozen model tensors linked to the latest
        checkpoint's where they are the same), then applies ``keep``."""
        with _atomic.writing(self.directory):
            self._recover()
            collected.write(path, earlier=self.latest())
            step = self.step_of(path)
            assert step is not None, "path_for made the path"
            self._retain(step)

    def _recover(self) -> None:
        for name in {n for n, _, _ in _atomic.leftovers(self.directory) if _STEP_DIR.match(n)}:
            _atomic.recover(self.directory / name)

    def _retain(self, step: int) -> None:
        if self.keep is not None:
            for old in self.steps()[:-self.keep]:
                if old != step:
                    _atomic.remove(self.path_for(old))


class HostBuffers:
    """Host copies of a state's tensors, reused from one checkpoint to the next.

    Called once per tensor, in the same order at every checkpoint (the snapshot's
    traversal); a tensor whose shape or dtype changed gets a new buffer. Buffers for CUDA
    tensors are pinned and filled asynchronously; ``synchronize`` waits for the copies.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._next = 0
        self._devices: set[torch.device] = set()

    def begin(self) -> None:
        """Starts a new checkpoint's copies (buffers are reused in call order)."""
        self._next = 0
        self._devices = set()

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        i, self._next = self._next, self._next + 1
        pin = t.is_cuda and torch.cuda.is_available()
        if i < len(self._buffers):
            buffer = self._buffers[i]
            if buffer.shape != t.shape or buffer.dtype != t.dtype:
                buffer = self._buffers[i] = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
        else:
            buffer = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            self._buffers.append(buffer)
        buffer.copy_(t.detach(), non_blocking=pin)
        if pin:
            self._devices.add(t.device)
        return buffer

    def synchronize(self) -> None:
        """Waits until every copy since ``begin`` is complete."""
        for device in self._devices:
            torch.cuda.synchronize(device)

    @property
    def num_bytes(self) -> int:
        """The host memory the buffers hold."""
        return sum(b.numel() * b.element_size() for b in self._buffers)


class _Background:
    """One run's background write on rank 0 (at most one in flight), its error kept until raised."""

    def __init__(self) -> None:
        self.buffers = HostBuffers()
        self.path: Path | None = None  # the save in flight, on every rank
        self.step = -1  # its state's step
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, path: Path, step: int, write_files: Callable[[], None] | None) -> None:
        """Records the save of ``path`` as in flight and, on rank 0 (``write_files`` given),
        runs it in a new thread; the previous save must have been waited for."""
        assert self.path is None, "a background save is still in flight"
        self.path, self.step, self._error = path, step, None
        if write_files is not None:
            self._thread = threading.Thread(target=self._run, args=(write_files,), name=f"accelfn-save-{path.name}",
                                            daemon=False)
            self._thread.start()

    def _run(self, write_files: Callable[[], None]) -> None:
        # Linux schedules threads by their own nice value (inherited by the threads this one
        # starts): the write yields the CPU to training where both compete for it
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICENESS)
        try:
            write_files()
        except BaseException as e:  # kept, and raised in the training thread
            self._error = e

    def in_flight(self) -> bool:
        """True while a background write is running (on rank 0)."""
        return self._thread is not None and self._thread.is_alive()

    def finished(self) -> bool:
        """True when this rank writes the save in flight and its thread has ended (well or not)."""
        return self._thread is not None and not self._thread.is_alive()

    def wait(self, backend: ProcessContext, *, agree: bool = True) -> tuple[int, Path] | None:
        """Waits for the save in flight and raises its error, on every rank; returns the step
        and path of the checkpoint it completed (None when none was in flight, or, without
        ``agree``, when it failed).

        Args:
            backend: the process context.
            agree: tell every rank the outcome (a collective: call it on every rank); with
                False (an error is already ending the run), only this rank's save is waited
                for and a failure is printed instead of raised.

        Raises:
            CheckpointError: the background write failed (on rank 0 with its cause chained;
                on the other ranks, naming rank 0 and the step).
        """
        thread, path, step, error = self._thread, self.path, self.step, self._error
        if thread is not None:
            thread.join()
            error = self._error
        self._thread, self._error, self.path = None, None, None
        failure: CheckpointError | None = None
        if error is not None:
            failure = CheckpointError(f"writing the checkpoint {path} in the background failed: "
                                      f"{type(error).__name__}: {error}")
            failure.__cause__ = error
        done = None if path is None else (step, path)
        if not agree:
            if failure is not None:
                print(f"accelfn: {failure}", file=sys.stderr, flush=True)
                return None
            return done
        distributed.outcome_of_rank_0(failure, lambda: CheckpointError(
            f"rank 0 failed to write the checkpoint of step {step} in the background; its error says why"),
            device=backend.collective_device)
        return done


class Schedule:
    """One run's checkpoints of a ``Checkpoints`` policy: when they are due, written now or
    in the background, and the step saved last.

    With ``policy.asynchronous``, a due checkpoint is copied to host memory and written in
    the background; after every optimizer update the ranks agree (one update late, without
    blocking) whether the background write has ended, and then all take its outcome
    together: its error, raised on every rank, or the complete checkpoint, handed out by
    ``completed`` on every rank at the same update. ``close`` waits for the save in flight.

    Args:
        policy: where and how often to save.
        backend: the run's process context (its ranks agree on the ``every_seconds`` clock).
        program: the program whose transforms each manifest records.
        timeout_s: how long a rank waits for the others' agreement (seconds).
    """

    def __init__(self, policy: Checkpoints, backend: ProcessContext, *, program: Step | None, timeout_s: float):
        self.policy = policy
        self.last_step: int | None = None
        self._backend = backend
        self._program = program
        self._timeout_s = timeout_s
        self._start = time.monotonic()
        self._clock: Agreement | None = None
        self._saved_period = 0
        self._background = _Background() if policy.asynchronous else None
        self._finished: Agreement | None = None  # whether (and which) background write has ended, agreed
        if self._background is not None and backend.world_size > 1:
            self._finished = Agreement(backend.world_size, timeout_s)
        self._completed: list[tuple[int, Path]] = []  # complete on disk, not yet handed out by `completed`
        self._lock: Path | None = None  # the directory's write lock, rank 0's for the whole run
        failure = None
        if backend.is_main_process:
            try:
                self._lock = _atomic.acquire(policy.directory)
            except CheckpointError as e:
                failure = e
        distributed.outcome_of_rank_0(failure, lambda: CheckpointError(
            f"rank 0 cannot write in {policy.directory}: another process is writing there; rank 0's error says which"),
            device=backend.collective_device)

    def save(self, state: TrainState) -> Path:
        """Saves ``state`` now and waits for it (a collective), then applies ``keep``; a
        background save in flight is waited for first.

        Raises:
            CheckpointError, OSError: as ``af.save``, or a background save's failure.
        """
        self._wait_background()
        path = self.policy.save(state, self._backend, program=self._program)
        self.last_step = state.step
        self._completed.append((state.step, path))
        return path

    def completed(self) -> list[tuple[int, Path]]:
        """The checkpoints complete on disk since the last call, as (step, path), oldest
        first: a synchronous
        save at once, a background one at the first update (agreed by all ranks) after its
        write ended. The same on every rank, when called at the same point on every rank."""
        done, self._completed = self._completed, []
        return done

    def _wait_background(self, *, agree: bool = True) -> None:
        """Waits for the background save in flight (a collective with ``agree``) and records
        its checkpoint as complete."""
        if self._background is not None:
            done = self._background.wait(self._backend, agree=agree)
            if done is not None:
                self._completed.append(done)

    def _save_in_background(self, state: TrainState) -> Path:
        background = self._background
        assert background is not None
        self._wait_background()
        path = self.policy.path_for(state.step)
        main = self._backend.is_main_process
        buffers = background.buffers if main else None
        if buffers is not None:
            buffers.begin()
        collected = collect(state, self._backend, self._program, to_host=buffers, path=path)
        if buffers is not None:
            buffers.synchronize()
        background.start(path, state.step, None if collected is None else lambda: self.policy._write(path, collected))
        self.last_step = state.step
        return path

    def maybe_save(self, state: TrainState) -> Path | None:
        """Saves ``state`` if a checkpoint is due after this optimizer update (call it after
        every update, on every rank); returns the path saved (written in the background
        when ``policy.asynchronous``), or None.

        Raises:
            CheckpointError, OSError: as ``af.save``; a background save that failed.
        """
        policy = self.policy
        self._check_background()
        due = policy.every_steps is not None and state.step % policy.every_steps == 0
        period = 0
        if policy.every_seconds is not None:
            if self._clock is None:
                self._clock = Agreement(self._backend.world_size, self._timeout_s)
            period = self._clock.propose(int((time.monotonic() - self._start) // policy.every_seconds))
            due = due or period > self._saved_period
        if not due or state.step == self.last_step:
            return None
        self._saved_period = max(self._saved_period, period)
        if self._background is None or writes_sharded(state):  # every rank writes its own shards (or stages)
            return self.save(state)
        return self._save_in_background(state)

    def in_flight(self) -> bool:
        """True while a background write is running on this rank."""
        return self._background is not None and self._background.in_flight()

    def _check_background(self) -> None:
        """Takes the outcome of a background save whose write has ended, on every rank at the
        same update: raises its error, or records its checkpoint as complete.

        Rank 0 (the writer) proposes the step of the save whose thread has ended, plus one
        (0: none); the ranks act on the agreed value, one update late, only while that save
        is still the one in flight (a later save started meanwhile is not waited for).
        """
        background = self._background
        if background is None:
            return
        in_flight = background.path is not None
        proposal = background.step + 1 if in_flight and background.finished() else 0
        agreed = self._finished.propose(proposal) if self._finished is not None else proposal
        if agreed and in_flight and background.step + 1 == agreed:
            self._wait_background()

    def close(self, *, ok: bool) -> None:
        """Ends the schedule: waits for the save in flight and raises its error (with
        ``ok``, on every rank together), or, when an error already ends the run, waits for
        this rank's save and prints a failure instead. The checkpoint it completes is then
        handed out by ``completed``.

        Raises:
            CheckpointError: the background save in flight failed (only with ``ok``).
        """
        try:
            self._wait_background(agree=ok)
        finally:
            if self._finished is not None:
                self._finished.close(wait=ok)
            if self._lock is not None:
                _atomic.release(self._lock)
                self._lock = None

    def latest_agreed(self) -> Path | None:
        """The latest complete checkpoint as rank 0 sees it, on every rank (a collective)."""
        latest = self.policy.latest()
        if self._backend.world_size == 1:
            return latest
        step = -1 if latest is None else self.policy.step_of(latest)
        step = int(self._backend.broadcast(torch.tensor([step], dtype=torch.int64)).item())
        return None if step < 0 else self.policy.path_for(step)
