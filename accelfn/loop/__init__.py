"""The training loop: ``run`` (epochs, totals, resume, checkpoint schedule, preemption,
metrics reduction and progress)."""

from accelfn.loop.hooks import Hook, Stop
from accelfn.loop.profile import Profile
from accelfn.loop.run import run
from accelfn.loop.updates import UpdateCount, count_updates

__all__ = ["Hook", "Profile", "Stop", "UpdateCount", "count_updates", "run"]
