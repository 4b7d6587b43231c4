"""The training loop: ``run`` (epochs, totals, resume, checkpoint schedule, preemption,
metrics reduction and progress)."""

from accelfn.loop.epochs import run

__all__ = ["run"]
