"""The training loop: ``run`` (epochs, totals, resume, checkpoint schedule, preemption,
metrics reduction and progress), and ``find_batch_size`` (retries after running out of memory)."""

from accelfn.loop.batch_size import find_batch_size
from accelfn.loop.epochs import run
from accelfn.loop.hooks import Hook, Stop
from accelfn.loop.planning import Collective, EpochCounts, Memory, Plan, Problem, plan
from accelfn.loop.profile import Profile
from accelfn.loop.updates import UpdateCount, count_updates

__all__ = ["Hook", "Profile", "Stop", "UpdateCount", "count_updates", "find_batch_size", "run",
           "Collective", "EpochCounts", "Memory", "Plan", "Problem", "plan"]
