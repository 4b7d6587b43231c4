"""A run's checkpoint schedule: the clock and the last step saved, for one ``Checkpoints``.

``af.Checkpoints`` is frozen configuration; what changes while a run trains (when the
schedule started, which ``every_seconds`` period was saved last, the step saved last) lives
here, one object per ``run`` call.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from accelfn.backends.base import Backend
from accelfn.checkpoint import Checkpoints
from accelfn.loop._agreement import Agreement
from accelfn.state import TrainState


class Schedule:
    """Saves ``policy``'s checkpoints during one run.

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

    def save(self, state: TrainState) -> Path:
        """Saves ``state`` now (a collective), then applies ``keep``."""
        path = self.policy.save(state, self._backend, transforms=self._transforms)
        self.last_step = state.step
        return path

    def maybe_save(self, state: TrainState) -> Path | None:
        """Saves ``state`` if a checkpoint is due after this optimizer update (call it after
        every update, on every rank); returns the path written, or None."""
        policy = self.policy
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
        return self.save(state)

    def latest_agreed(self) -> Path | None:
        """The latest complete checkpoint as rank 0 sees it, on every rank (a collective)."""
        latest = self.policy.latest()
        if self._backend.world_size == 1:
            return latest
        step = -1 if latest is None else int(latest.name.removeprefix("step_"))
        step = int(self._backend.broadcast(torch.tensor([step], dtype=torch.int64)).item())
        return None if step < 0 else self.policy.path_for(step)
