"""``run``: epochs of a prepared program, with totals, logging, checkpoints and resume."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from accelfn import distributed
from accelfn.backends.base import Backend
from accelfn.checkpoint import Checkpoints
from accelfn.distributed.env import with_launch_defaults
from accelfn.errors import check_int
from accelfn.loop._preemption import Preemption
from accelfn.loop._progress import Progress, check_config, run_config
from accelfn.loop._resume import check_run_arguments, resume_state
from accelfn.loop.hooks import Hook, Hooks, check_hooks
from accelfn.loop.planning.report import check_before_run, resolve_budget, show_plan
from accelfn.loop.profile import Profile, profiling
from accelfn.loop.updates import count_updates
from accelfn.state import Stopped, TrainState, require_state
from accelfn.step import Step
from accelfn.tracking import Tracker

if TYPE_CHECKING:
    from accelfn.checkpoint.checkpoints import Schedule


def _check_count(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    check_int("run", name, value, minimum=1)


def _validate(step: Any, state: Any, data: Any, backend: Any, epochs: Any, max_steps: Any,
              trackers: Any, log_every: Any) -> None:
    if not isinstance(step, Step):
        raise TypeError(f"run() takes a Step first (af.train_step(loss_fn)), got {type(step).__name__}")
    require_state("af.run(step, state, ...)", state)
    if not isinstance(backend, Backend):
        raise TypeError(f"run(backend=...) must be a backend such as af.backends.auto(), got {backend!r}")
    if not isinstance(data, Iterable):
        raise TypeError(f"run() needs iterable data (a DataLoader), got {type(data).__name__}")
    if epochs is None and max_steps is None:
        raise ValueError("run(epochs=None) trains until max_steps, so it needs max_steps=<total optimizer "
                         "updates>; pass both, or an int for epochs")
    _check_count("epochs", epochs, allow_none=True)
    _check_count("max_steps", max_steps, allow_none=True)
    _check_count("log_every", log_every)
    if isinstance(trackers, Tracker) or not isinstance(trackers, Iterable):
        raise TypeError(f"run(trackers=...) takes a list of trackers, e.g. trackers=[af.JSONL(...)], got {trackers!r}")
    for tracker in trackers:
        if not isinstance(tracker, Tracker):
            raise TypeError(f"run(trackers=...) takes objects with log(metrics, step) and close(), got {tracker!r}")


def run(
    step: Step,
    state: TrainState,
    data: Iterable[Any],
    *,
    backend: Backend,
    epochs: int | None = 1,
    max_steps: int | None = None,
    checkpoints: Checkpoints | None = None,
    resume: str | os.PathLike[str] | None = None,
    trackers: Sequence[Tracker] = (),
    progress: bool = True,
    log_every: int = 1,
    config: Mapping[str, Any] | None = None,
    hooks: Sequence[Hook] = (),
    profile: Profile | None = None,
    continue_after_stop: bool = False,
    plan: bool = True,
) -> TrainState:
    """Trains ``state`` with ``step`` over ``data`` until ``epochs`` or ``max_steps`` (totals).

    ``epochs`` and ``max_steps`` count from the start of training, not from this call: a run
    resumed at step 7 of an ``epochs=3`` job stops exactly where the uninterrupted job stops.
    Each epoch's last micro-batch flushes the accumulation window.

    Args:
        step: the program (``af.train_step`` with transforms).
        state: the state to train (its model and optimizer are updated in place).
        data: a DataLoader or iterable of batches; ``shard_data`` shards it over ranks.
        backend: the backend that interprets the program, e.g. ``af.backends.auto()``.
        epochs: total epochs of the job, or None to train until ``max_steps`` alone
            (then required). Training stops at whichever of the two limits comes first.
        max_steps: total optimizer updates of the job, or None for no limit.
        checkpoints: an ``af.Checkpoints`` policy saving during training (and on SIGTERM/
            SIGINT), or None.
        resume: ``"auto"`` (the latest checkpoint of ``checkpoints``, if any) or the path of
            a checkpoint to resume from, or None to start from ``state`` as it is. A
            checkpoint written in the middle of an epoch by another number of processes
            resumes at ``epoch_micro_step * its_world_size // world_size``, which keeps the
            samples the epoch consumed but not their batching (a RuntimeWarning says so).
        trackers: where metrics go (``af.TensorBoard``, ``af.JSONL``); main process only.
        progress: show a progress bar on the main process.
        log_every: reduce metrics to Python floats, show and log them every this many
            optimizer updates (in between, the hot loop never waits for the device).
            Without trackers, nothing is reduced for the log (the bar alone reads the
            metrics at most every 0.5 s on one process).
        config: the run's hyperparameters (a mapping, nested or not), handed once to every
            tracker that takes a configuration (``log_config``: TensorBoard hparams, MLflow
            params, W&B config) with what accelfn knows under ``"accelfn"``: the
            transforms and their options, world size, backend, precision, per-process
            batch size, accelfn and torch versions. None: nothing is sent (``config={}``
            sends accelfn's part alone).
        hooks: ``af.Hook`` functions called every N updates and/or at each epoch's end; what
            they return is logged at the current step, and ``af.Stop`` ends the run.
        profile: an ``af.Profile`` recording a ``torch.profiler`` trace of a window of updates.
        continue_after_stop: train on from a state a hook's ``af.Stop`` ended
            (``state.stopped``, also when it comes from the checkpoint ``resume`` loads):
            the stop is cleared first. False: such a run trains nothing and returns the
            state as it is, so a rerun of a job that stopped early (a requeue, a restart
            after a crash in code after training) ends where the job ended.
        plan: check the program's plan (``af.plan`` without its trace: counts, persistent
            bytes, the catalogue of misconfigurations) before preparing the state, raising
            ``af.PlanError`` for its errors and warning of its warnings; False skips it. Under
            ``accelfn plan`` the plan is printed instead and the process exits (status 1 if
            it has errors) without training.

    A hook's ``af.Stop`` is part of the state: ``state.stopped`` records the update and the
    reason, every checkpoint from then on holds it, and when a checkpoint schedule is given
    the stopping update is saved (if it was not due anyway), so a rerun with
    ``resume="auto"`` resumes there and stops at once.

    The model trains in the modes its submodules are in: a submodule the user put in eval
    mode (a frozen backbone keeping its BatchNorm statistics) stays there. Only a model
    whose root module is in eval mode, as ``model.eval()`` leaves it, is put in train mode
    first, since a training loop trains.

    Returns:
        TrainState: the state after the last update.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: ``epochs``, ``max_steps`` or ``log_every`` below 1; a ``config`` key
            ``"accelfn"`` (accelfn's own); ``epochs=None``
            without ``max_steps``; ``resume="auto"`` without ``checkpoints``; a checkpoint
            whose position in its epoch is beyond the data's micro-batches per epoch; a
            checkpoint directory that is a file; on every rank, metrics whose names differ
            across ranks; ``checkpoint_activations("budget")`` that no choice of blocks meets,
            or over data without a first batch to trace.
        NonFiniteError: too many consecutive updates skipped for non-finite gradients.
        RuntimeError: (``distributed.ArrivalError``) a collective: some rank did not call
            ``run`` within the collective timeout, or called another collective API (each
            rank's call named, at once).
        PlanError: the plan has errors (each named with its fix), before anything is prepared.
        CheckpointError: ``resume`` names no complete checkpoint, or one that does not fit
            or is corrupted (with ``"auto"``, the message names the previous checkpoint if
            that one loads, or says that it does not); or a checkpoint written in the
            background (``Checkpoints(asynchronous=True)``) failed, raised after the next
            optimizer update or when ``run`` ends, naming the checkpoint and the cause.

    Warns:
        RuntimeWarning: ``epochs`` ran out before ``max_steps``; a mid-epoch resume on
            another number of processes.
        SystemExit: status 128 + signal number after SIGTERM or SIGINT when ``checkpoints``
            is given: the current micro-batch finishes and a checkpoint is written first.

    Example:
        >>> import torch, torch.nn.functional as F, accelfn as af
        >>> model = torch.nn.Linear(4, 1)
        >>> state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(4)]
        >>> step = af.train_step(lambda m, b: F.mse_loss(m(b[0]), b[1]))
        >>> state = af.run(step, state, data, backend=af.backends.CPU(), epochs=2, progress=False)
        >>> state.step
        8
    """
    _validate(step, state, data, backend, epochs, max_steps, trackers, log_every)
    if not isinstance(plan, bool):
        raise TypeError(f"run(plan=...) takes True or False, got {plan!r}")
    if backend.env.plan_world_size is not None:  # `accelfn plan`: print the plan, train nothing
        show_plan(step, state, data, backend, epochs, max_steps)
    if plan:
        check_before_run(with_launch_defaults(step, backend.env, warn=False), state, data, backend, epochs, max_steps)
    if backend.world_size > 1:  # a rank busy alone before run (data preparation) may take the whole timeout
        distributed.arrive("af.run", backend.env.timeout_s)
    with backend.user_code("af.run"):
        return _run(step, state, data, backend, epochs, max_steps, checkpoints, resume, tuple(trackers), progress,
                    log_every, config, hooks, profile, continue_after_stop)


def _run(step: Step, state: TrainState, data: Iterable[Any], backend: Backend, epochs: int | None,
         max_steps: int | None, checkpoints: Checkpoints | None, resume: str | os.PathLike[str] | None,
         trackers: tuple[Tracker, ...], progress: bool, log_every: int, config: Mapping[str, Any] | None,
         hooks: Sequence[Hook], profile: Profile | None, continue_after_stop: bool) -> TrainState:
    hooks = check_hooks(hooks)
    check_config(config)
    if profile is not None and not isinstance(profile, Profile):
        raise TypeError(f"run(profile=...) takes af.Profile(dir, wait=..., warmup=..., active=...), got {profile!r}")
    check_run_arguments(checkpoints, resume)
    if not isinstance(continue_after_stop, bool):
        raise TypeError(f"run(continue_after_stop=...) takes True or False, got {continue_after_stop!r}")
    step = resolve_budget(step, state, data, backend)  # checkpoint_activations("budget"): its blocks chosen
    state, step_fn = backend.prepare(step, state)
    step = step_fn.step  # the program as run: with what `accelfn launch` added (--accumulate, ...)
    if not state.model.training:  # left in eval mode as a whole, by the user's own evaluation
        state.model.train()
    schedule = (checkpoints.schedule(backend, program=step, timeout_s=backend.env.timeout_s)
                if checkpoints is not None else None)
    try:
        state = resume_state(state, schedule, resume, backend, program=step, data=data)
    except BaseException:
        if schedule is not None:  # gives back the checkpoint directory's write lock
            schedule.close(ok=False)
        raise
    if continue_after_stop and state.stopped is not None:
        state = state.replace(stopped=None)
    bar = Progress(backend, trackers, show=progress, log_every=log_every,
                   total=_total_steps(step, data, backend, state, epochs, max_steps), initial=state.step,
                   copies=backend.world_size // backend.mesh(step).data_size)
    preemption = Preemption(backend) if schedule is not None else None
    ended = False
    try:
        if config is not None:
            bar.log_config(run_config(config, step_fn.step, backend, data))
        with preemption or contextlib.nullcontext(), profiling(profile, backend) as profiler:
            state = _epochs(step, state, step_fn, data, backend, epochs, max_steps, schedule, bar, preemption,
                            Hooks(hooks, backend, state.step), profiler)
            if preemption is not None and preemption.requested():  # agreed during the last micro-batch
                preemption.stop(state, schedule)
        distributed.sync_buffers(state.model, backend.collective_device)  # the model run returns: one model
        ended = True
    finally:
        try:
            if schedule is not None:  # waits for a checkpoint written in the background
                schedule.close(ok=ended)
                if ended:  # ... and hands it to the trackers (a collective for af.RayTrain)
                    _hand_out(schedule, bar)
        finally:
            bar.close()
    return state


def _hand_out(schedule: Schedule, bar: Progress) -> None:
    """Hands each checkpoint complete on disk since the last call to the trackers (a
    background one at the update the ranks agreed it ended, on every rank together)."""
    for step, path in schedule.completed():
        bar.saved(step, path)


def _total_steps(step: Step, data: Iterable[Any], backend: Backend, state: TrainState, epochs: int | None,
                 max_steps: int | None) -> int | None:
    """The step the run ends at (for the bar), when the data's length is known or
    ``max_steps`` gives it: ``count_updates`` from ``state``'s position."""
    try:
        return count_updates(step, data, backend=backend, epochs=epochs, max_steps=max_steps, state=state).total
    except ValueError:  # data of unknown length without max_steps
        return None


def _epochs(step: Step, state: TrainState, step_fn: Any, data: Iterable[Any], backend: Backend, epochs: int | None,
            max_steps: int | None, schedule: Schedule | None, bar: Progress,
            preemption: Preemption | None, hooks: Hooks, profiler: Any = None) -> TrainState:
    if max_steps is not None and state.step >= max_steps:
        return state
    if state.stopped is not None:
        backend.print(f"accelfn: nothing to train: this run stopped at step {state.stopped.step} "
                      f"({state.stopped.reason}); pass run(..., continue_after_stop=True) to train on",
                      file=sys.stderr)
        return state
    step_once = step_fn.__call__  # a bound method is called without the slower instance-call path
    after_update = hooks.after_update if hooks else None
    profiler_step = profiler.step if profiler is not None else None
    while epochs is None or state.epoch < epochs:
        epoch, consumed = state.epoch, state.micro_step
        batches = backend.batches(data, step, epoch, start=state.epoch_micro_step, data_state=state.data_state)
        # a stream's readers: their state after the micro-batches consumed goes into checkpoints
        state = state.replace(data_state=batches.readers)
        with contextlib.closing(iter(batches)) as reading:  # left early (max_steps, a stop, an error): its
            # DataLoader workers end now, not when collected
            for batch, last in reading:
                state, metrics = step_once(state, batch, flush=last)
                if last:  # the epoch ends with its last micro-batch, so a checkpoint saved now starts the next
                    state = state.replace(epoch=epoch + 1, epoch_micro_step=0, data_state=None)
                if metrics:
                    bar.update(state.step, metrics)
                    if profiler_step is not None:
                        profiler_step()
                    if after_update is not None:  # before a checkpoint of this step, which then holds their changes
                        bar.log(state.step, after_update(state, last))
                        if hooks.stop_reason is not None:  # part of the state, and of its checkpoints
                            state = state.replace(stopped=Stopped(state.step, hooks.stop_reason))
                if preemption is not None and preemption.requested():
                    preemption.stop(state, schedule)
                if not metrics:
                    continue
                if schedule is not None:
                    saved = schedule.maybe_save(state)
                    if saved is None and bar.save_requested() and schedule.last_step != state.step:
                        schedule.save(state)  # a tracker's request (af.RayTrain: Ray's preemption notice)
                    _hand_out(schedule, bar)  # the points up to a checkpoint survive a kill after it
                if max_steps is not None and state.step >= max_steps:
                    break
                if state.stopped is not None:
                    if schedule is not None and schedule.last_step != state.step:  # a rerun resumes here
                        schedule.save(state)
                    if schedule is not None:
                        _hand_out(schedule, bar)
                    backend.print(f"accelfn: stopped at step {state.step}: {hooks.stop_reason}", file=sys.stderr)
                    return state
        if max_steps is not None and state.step >= max_steps:
            return state
        if state.epoch == epoch:  # nothing (left) to read in this epoch
            if state.micro_step == consumed:
                _warn_empty_epoch(state, epochs)
                if epochs is None:
                    return state
            state = state.replace(epoch=epoch + 1, epoch_micro_step=0, data_state=None)
    if max_steps is not None and backend.is_main_process:  # the job's warning: once, not per rank
        warnings.warn(
            f"run stopped after epochs={epochs} at step {state.step}, before max_steps={max_steps}; "
            "pass epochs=None to train until max_steps (or more epochs)",
            RuntimeWarning,
            stacklevel=4,  # the caller of run
        )
    return state


def _warn_empty_epoch(state: TrainState, epochs: int | None) -> None:
    if state.epoch_micro_step:
        return  # resumed at the very end of an epoch: nothing left to read is expected
    warnings.warn(
        f"epoch {state.epoch} read no batches: the data is empty, or a one-shot iterator (a "
        "generator) that an earlier epoch exhausted; pass a DataLoader or a list to train "
        f"{'more than one epoch' if epochs is None or epochs > 1 else 'on it'}",
        RuntimeWarning,
        stacklevel=5,  # the caller of run
    )
