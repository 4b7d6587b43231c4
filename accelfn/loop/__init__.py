"""The training loop: ``run`` (epochs, totals, resume, checkpoint schedule, preemption,
metrics reduction and progress), and ``find_batch_size`` (retries after running out of memory)."""

from accelfn.loop.batch_size import find_batch_size
from accelfn.loop.epochs import run

__all__ = ["find_batch_size", "run"]
