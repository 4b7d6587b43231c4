"""What a second ``run`` on the same tracker object means: the same run continued, or a restart.

A tracker object is one run of its library (one MLflow run, one W&B run, one Comet
experiment, one TensorBoard directory, one JSONL file). ``run`` calls ``start(step)`` with
the step it starts from; the tracker compares it with what the previous ``run`` through it
reached:

- **continued**: the first ``run``, or one that starts at or after the highest step the
  previous one logged (phases: ``max_steps=1000`` then ``max_steps=2000``; a loop calling
  ``run(epochs=e + 1)`` once per epoch; a resume in the same process). Its points follow
  the earlier ones in the same run.
- **restarted**: one that starts before the highest step the previous one logged, or, when
  that one logged nothing, at or before the step it started from (``find_batch_size``
  retrying from a fresh state after an out-of-memory error; a rerun from an earlier
  snapshot). The points the abandoned attempt logged after the new start are never shown
  beside the new ones, and nothing of it makes the new run fail: MLflow, W&B and Comet begin
  a new run (the old one stays, finished, as it was); TensorBoard hides them behind its
  restart marker; JSONL removes the lines it wrote for them.
"""

from __future__ import annotations

import attrs


@attrs.define
class Runs:
    """The steps one tracker object was given across ``run`` calls.

    Attributes:
        started: the step the latest ``run`` started from, or None before the first.
        last: the highest step logged since then (by ``run`` or by the user), or None.
    """

    started: int | None = None
    last: int | None = None

    def start(self, step: int) -> bool:
        """Records a ``run`` starting at ``step``; returns True if it restarts (module docstring)."""
        if self.started is None:
            restart = False
        elif self.last is not None:
            restart = step < self.last
        else:
            restart = step <= self.started
        self.started, self.last = step, None
        return restart

    def logged(self, step: int) -> None:
        """Records a point at ``step``."""
        self.last = step if self.last is None else max(self.last, step)
