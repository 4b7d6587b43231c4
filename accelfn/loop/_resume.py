"""Where ``run`` starts: its checkpoint arguments checked, and the state it resumes from."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

from accelfn.backends.base import Backend
from accelfn.checkpoint import Checkpoints
from accelfn.checkpoint.io import (
    ResumePosition,
    is_checkpoint,
    load_with_manifest,
    not_found,
    read_fitting,
    transforms_record,
)
from accelfn.errors import CheckpointError, check_directory
from accelfn.loop._schedule import Schedule
from accelfn.state import TrainState
from accelfn.step import Step


def check_run_arguments(checkpoints: Any, resume: Any) -> None:
    """Validates ``run``'s ``checkpoints`` and ``resume`` before anything happens.

    Raises:
        TypeError: ``checkpoints`` not a Checkpoints, ``resume`` neither a path nor "auto".
        ValueError: ``resume="auto"`` without ``checkpoints``; a checkpoint directory that
            is a file (it may have become one since ``Checkpoints(...)`` checked it).
        PermissionError: a checkpoint directory this process cannot write.
        CheckpointError: ``resume`` names a path with no complete checkpoint.
    """
    if checkpoints is not None and not isinstance(checkpoints, Checkpoints):
        raise TypeError(f"run(checkpoints=...) takes af.Checkpoints(directory, ...), got {checkpoints!r}")
    if checkpoints is not None:
        check_directory(checkpoints.directory, f"run(checkpoints={checkpoints!r})")
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
    if not is_checkpoint(Path(resume)):
        instead = ("resume='auto'" if checkpoints is not None
                   else "checkpoints=af.Checkpoints(directory) and resume='auto'")
        raise CheckpointError(f"run(resume={str(resume)!r}): {not_found(Path(resume))} (to resume from the "
                              f"latest checkpoint of a checkpoint directory, if any, pass {instead})")


def resume_state(state: TrainState, schedule: Schedule | None, resume: Any, backend: Backend,
                 *, program: Step | None = None, position: ResumePosition | None = None) -> TrainState:
    """The state ``run`` starts from: ``state``, or the checkpoint ``resume`` asks for.

    ``resume="auto"`` takes the latest checkpoint of ``schedule`` (rank 0's view, shared
    with every rank) and starts fresh when there is none; it keeps ``state`` when ``state``
    is already at or past that checkpoint's step (``run`` called again in the same process). Warns when the checkpoint was
    written by a program with other transforms. ``position`` (see ``ResumePosition``) sets
    the micro-batch the resumed epoch continues at, or refuses it, before ``state`` changes.

    Raises:
        CheckpointError: as ``load``; for ``resume="auto"``, the message also names the
            previous complete checkpoint to resume from instead if that one loads, or
            says that it does not load either.
        ValueError: as ``position``.
    """
    if resume is None:
        return state
    if resume == "auto":
        assert schedule is not None, "check_run_arguments refuses resume='auto' without checkpoints"
        path = schedule.latest_agreed()
        if path is not None and int(path.name.removeprefix("step_")) <= state.step:
            # the live state is where that checkpoint is, or past it (run called again in the
            # same process, once per epoch say): rewinding would train those steps twice
            return state
    else:
        path = Path(resume)
    if path is None:
        return state
    try:
        state, manifest = load_with_manifest(path, state, backend, position)
    except CheckpointError as e:
        if schedule is None or resume != "auto":
            raise
        raise CheckpointError(f"{e}\n{_fallback(schedule.policy, path, state, backend)}") from None
    if schedule is not None:
        schedule.last_step = state.step
    now = transforms_record(program)
    if manifest.transforms is not None and now is not None and manifest.transforms != now and backend.is_main_process:
        warnings.warn(f"{path} was written by a program with the transforms {manifest.transforms}; this "
                      f"program has {now}, so the resumed run differs from an uninterrupted one",
                      stacklevel=3)
    backend.print(f"accelfn: resumed from {path} at step {state.step} (epoch {state.epoch}, "
                  f"micro-batch {state.epoch_micro_step} of it)", file=sys.stderr)
    return state


def _fallback(checkpoints: Checkpoints, failed: Path, into: TrainState, backend: Backend) -> str:
    """What to do when the latest checkpoint of ``checkpoints`` (``failed``) does not load
    into ``into``: resume from the previous one only if that one does load; otherwise (the
    same mismatch, as when the state is built unlike the one that wrote them) say so."""
    earlier = [step for step in checkpoints.steps() if checkpoints.path_for(step) != failed]
    head = (f"run(resume='auto'): the latest checkpoint, {failed}, failed to load; it is not skipped, since "
            "that could hide a bug.")
    if not earlier:
        return (f"{head} There is no earlier checkpoint: if the state is not built like the one that wrote it "
                "(model, optimizer, scheduler, extra), build it the same way; if the checkpoint is damaged, or to "
                f"train this state from scratch, start a fresh run in another checkpoint directory than "
                f"{checkpoints.directory}")
    previous = checkpoints.path_for(earlier[-1])
    try:
        read_fitting(previous, into, backend)
    except CheckpointError as e:
        reason = str(e).removeprefix(f"{previous}: ").split("\n")[0].rstrip(":")
        return (f"{head} The previous checkpoint, {previous}, does not load either ({reason}), so resuming from "
                "it would not help: if the state is not built like the one that wrote them (model, optimizer, "
                "scheduler, extra), build it the same way; to train this state from scratch, start a fresh run "
                f"in another checkpoint directory than {checkpoints.directory}")
    return (f"{head} If it is damaged, resume from the previous one with run(resume={str(previous)!r}, ...) "
            f"or move {failed} aside so that resume='auto' takes it")
