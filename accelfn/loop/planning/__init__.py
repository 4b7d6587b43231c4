"""``af.plan``: what a run will do, hold and break on, known before it starts (``report``:
the record, the function and run's check; ``_counts``, ``_memory``, ``_comms``,
``_problems``: how each part is computed; ``_table``: ``str(plan)``)."""

from accelfn.loop.planning.report import Collective, EpochCounts, Memory, Plan, Problem, plan

__all__ = ["Collective", "EpochCounts", "Memory", "Plan", "Problem", "plan"]
