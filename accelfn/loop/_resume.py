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
    transforms_record,
)
from accelfn.errors import CheckpointError
from accelfn.loop._schedule import Schedule
from accelfn.state import TrainState
from accelfn.step import Step


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
    if not is_checkpoint(Path(resume)):
        raise CheckpointError(f"run(resume={str(resume)!r}): {not_found(Path(resume))} (to resume from the "
                              "latest checkpoint of checkpoints=..., if any, pass resume='auto')")


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
            previous complete checkpoint to resume from instead.
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
        raise CheckpointError(f"{e}\n{_fallback(schedule.policy, path)}") from None
    if schedule is not None:
        schedule.last_step = state.step
    now = transforms_record(program)
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
