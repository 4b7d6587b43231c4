"""A run's checkpoint schedule: the clock and the last step saved, for one ``Checkpoints``.

``af.Checkpoints`` is frozen configuration; what changes while a run trains (when the
schedule started, which ``every_seconds`` period was saved last, the step saved last, the
save in flight in the background) lives here, one object per ``run`` call.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from accelfn.backends.base import Backend
from accelfn.checkpoint import Checkpoints
from accelfn.checkpoint.background import BackgroundSaves
from accelfn.checkpoint.io import collect, is_sharded
from accelfn.loop._agreement import Agreement
from accelfn.state import TrainState


class Schedule:
    """Saves ``policy``'s checkpoints during one run.

    With ``policy.asynchronous``, a due checkpoint is copied to host memory and written in
    the background (``accelfn.checkpoint.background``); after every optimizer update the
    ranks agree (one update late, without blocking) whether a background write failed, and
    all raise its error together. ``close`` waits for the save in flight.

    Args:
        policy: where and how often to save.
        backend: the run's backend (its ranks agree on the ``every_seconds`` clock).
        transforms: the program's transforms as plain data, recorded in each manifest.
    """

    def __init__(self, policy: Checkpoints, backend: Backend, transforms: Any):
        self.policy = policy
        self.last_step: int | None = None
        self._backend = backend
        self._transforms = transforms
        self._start = time.monotonic()
        self._clock: Agreement | None = None
        self._saved_period = 0
        self._background = BackgroundSaves(backend) if policy.asynchronous else None
        self._failure: Agreement | None = None
        if self._background is not None and backend.world_size > 1:
            self._failure = Agreement(backend.world_size, backend.env.timeout_s)

    def save(self, state: TrainState) -> Path:
        """Saves ``state`` now and waits for it (a collective), then applies ``keep``; a
        background save in flight is waited for first.

        Raises:
            CheckpointError, OSError: as ``af.save``, or a background save's failure.
        """
        if self._background is not None:
            self._background.wait()
        path = self.policy.save(state, self._backend, transforms=self._transforms)
        self.last_step = state.step
        return path

    def _save_in_background(self, state: TrainState) -> Path:
        background = self._background
        assert background is not None
        background.wait()
        path = self.policy.path_for(state.step)
        main = self._backend.is_main_process
        buffers = background.buffers if main else None
        if buffers is not None:
            buffers.begin()
        collected = collect(state, self._backend, self._transforms, to_host=buffers, path=path)
        if buffers is not None:
            buffers.synchronize()
        if collected is not None:
            background.start(path, lambda: self.policy.write(path, collected))
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
                self._clock = Agreement(self._backend.world_size, self._backend.env.timeout_s)
            period = self._clock.propose(int((time.monotonic() - self._start) // policy.every_seconds))
            due = due or period > self._saved_period
        if not due or state.step == self.last_step:
            return None
        self._saved_period = max(self._saved_period, period)
        if self._background is None or is_sharded(state):  # every rank writes a sharded state's own shards
            return self.save(state)
        return self._save_in_background(state)

    def _check_background(self) -> None:
        """Raises a finished background save's error, on every rank at the same update."""
        background = self._background
        if background is None:
            return
        failed = background.failed()
        if self._failure is not None:
            failed = bool(self._failure.propose(int(failed)))
        if failed:
            background.wait()

    def close(self, *, ok: bool) -> None:
        """Ends the schedule: waits for the save in flight and raises its error (with
        ``ok``, on every rank together), or, when an error already ends the run, waits for
        this rank's save and prints a failure instead.

        Raises:
            CheckpointError: the background save in flight failed (only with ``ok``).
        """
        try:
            if self._background is not None:
                self._background.wait(agree=ok)
        finally:
            if self._failure is not None:
                self._failure.close(wait=ok)

    def latest_agreed(self) -> Path | None:
        """The latest complete checkpoint as rank 0 sees it, on every rank (a collective)."""
        latest = self.policy.latest()
        if self._backend.world_size == 1:
            return latest
        step = -1 if latest is None else int(latest.name.removeprefix("step_"))
        step = int(self._backend.broadcast(torch.tensor([step], dtype=torch.int64)).item())
        return None if step < 0 else self.policy.path_for(step)
