"""Where ``run`` starts: its checkpoint arguments checked, the checkpoint it resumes from, and
where in that checkpoint's epoch it continues."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accelfn.backends.base import Backend
from accelfn.checkpoint import Checkpoints, Opened, find_checkpoint, open_checkpoint
from accelfn.data.blocks import epoch_length
from accelfn.errors import CheckpointError, check_directory
from accelfn.state import TrainState
from accelfn.step import Step
from accelfn.transforms import Invariant

if TYPE_CHECKING:
    from accelfn.checkpoint.checkpoints import Schedule


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
    try:
        find_checkpoint(Path(resume))
    except CheckpointError as e:
        instead = ("resume='auto'" if checkpoints is not None
                   else "checkpoints=af.Checkpoints(directory) and resume='auto'")
        raise CheckpointError(f"run(resume={str(resume)!r}): {e} (to resume from the "
                              f"latest checkpoint of a checkpoint directory, if any, pass {instead})") from None


def resume_state(state: TrainState, schedule: Schedule | None, resume: Any, backend: Backend, *, program: Step,
                 data: Iterable[Any]) -> TrainState:
    """The state ``run`` starts from: ``state``, or the checkpoint ``resume`` asks for.

    ``resume="auto"`` takes the latest checkpoint of ``schedule`` (rank 0's view, shared
    with every rank) and starts fresh when there is none; it keeps ``state`` when ``state``
    is already at or past that checkpoint's step (``run`` called again in the same process).
    The checkpoint is opened (verified and checked against ``state``), the micro-batch its
    epoch continues at is chosen from its counters (``resume_position``), then it is put in
    place. Warns when the checkpoint was written by a program with other transforms.

    Raises:
        CheckpointError: as ``load``; for ``resume="auto"``, the message also names the
            previous complete checkpoint to resume from instead if that one loads, or
            says that it does not load either.
        ValueError: as ``resume_position``.
    """
    if resume is None:
        return state
    if resume == "auto":
        assert schedule is not None, "check_run_arguments refuses resume='auto' without checkpoints"
        path = schedule.latest_agreed()
        if path is not None and (schedule.policy.step_of(path) or 0) <= state.step:
            # the live state is where that checkpoint is, or past it (run called again in the
            # same process, once per epoch say): rewinding would train those steps twice
            return state
    else:
        path = Path(resume)
    if path is None:
        return state
    try:
        opened = open_checkpoint(path, into=state, backend=backend)
    except CheckpointError as e:
        if schedule is None or resume != "auto":
            raise
        raise CheckpointError(f"{e}\n{_fallback(schedule.policy, path, state, backend)}") from None
    state = opened.put(epoch_micro_step=resume_position(opened, backend, data, program))
    if schedule is not None:
        schedule.last_step = state.step
    differs = opened.other_program(program)
    if differs is not None and backend.is_main_process:
        warnings.warn(f"{differs}, so the resumed run differs from an uninterrupted one", stacklevel=4)
    backend.print(f"accelfn: resumed from {path} at step {state.step} (epoch {state.epoch}, "
                  f"micro-batch {state.epoch_micro_step} of it)", file=sys.stderr)
    return state


def resume_position(opened: Opened, backend: Backend, data: Iterable[Any], program: Step) -> int:
    """The micro-batch of its epoch a run resumed from ``opened`` continues at.

    In the world size that wrote the checkpoint, its own position. In another, each
    process's position is scaled to keep the epoch's consumed samples (approximate: the rest
    of the epoch is batched otherwise, which a RuntimeWarning says). Under ``invariant()``
    the load has put it in this world's micro-batches already: the same global micro-batch.

    Raises:
        ValueError: the position is beyond this process's epoch (other data or batch size).
    """
    epoch, position = opened.counters["epoch"], opened.counters["epoch_micro_step"]
    # data shards, not processes: the ranks of a tensor-parallel group read one shard together
    world_size = opened.data_world_size
    if not position:
        return 0  # an epoch boundary: the same in any world size
    data_rank, data_world = backend.mesh(program).data_coordinates(backend.rank)
    total = epoch_length(data, program, rank=data_rank, world_size=data_world)
    if world_size != data_world and program.find(Invariant) is not None:
        return position  # the checkpoint's counters are in this world's micro-batches already (load regroups them)
    if world_size != data_world:
        start = position * world_size // data_world
        start = start if total is None else min(start, total)
        if backend.is_main_process:  # the job's warning: once, not per rank
            warnings.warn(
                f"the checkpoint was written by {_processes(world_size)} at micro-batch {position} of epoch {epoch} "
                f"(of each), and this run has {_processes(data_world)}: an exact resume needs the same world "
                f"size. Continuing at micro-batch {start}, which keeps the number of samples the epoch has consumed "
                "(rounded down to whole micro-batches) if the per-process batch size is the same; the rest of the "
                "epoch is batched in another order, so the run differs from an uninterrupted one",
                RuntimeWarning,
                stacklevel=5,
            )
        return start
    if total is not None and position > total:
        raise ValueError(
            f"cannot resume at micro-batch {position} of epoch {epoch}: the data has {total} "
            f"micro-batch{'es' if total != 1 else ''} per epoch on this process. The batch size or the dataset "
            f"probably differs from the run that wrote the checkpoint (on {_processes(world_size)}, as this run); "
            "resume with the same data and batch size, or start a fresh run (without resume=...)"
        )
    return position


def _processes(n: int) -> str:
    return f"{n} process{'es' if n > 1 else ''}"


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
        open_checkpoint(previous, into=into, backend=backend)
    except CheckpointError as e:
        reason = str(e).removeprefix(f"{previous}: ").split("\n")[0].rstrip(":")
        return (f"{head} The previous checkpoint, {previous}, does not load either ({reason}), so resuming from "
                "it would not help: if the state is not built like the one that wrote them (model, optimizer, "
                "scheduler, extra), build it the same way; to train this state from scratch, start a fresh run "
                f"in another checkpoint directory than {checkpoints.directory}")
    return (f"{head} If it is damaged, resume from the previous one with run(resume={str(previous)!r}, ...) "
            f"or move {failed} aside so that resume='auto' takes it")
