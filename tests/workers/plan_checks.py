"""Worker for tests/loop/test_plan*.py: the 2-process checks of ``af.plan``, as pooled scenarios.

``counts()``: for every case of ``planning.TWO_PROCESSES``, this rank's planned counts and what
``run`` did (samples read, updates per epoch, scheduler steps).
"""

from __future__ import annotations

from typing import Any

import accelfn as af
from tests.helpers import planning


def counts() -> dict[str, Any]:
    backend = af.backends.auto()
    return {case.id: planning.planned_and_run(case, backend) for case in planning.TWO_PROCESSES}


def memory() -> dict[str, Any]:
    """``planning.MEMORY_TWO``: this rank's planned and real persistent bytes per case."""
    backend = af.backends.auto()
    return {"-".join(case): planning.planned_and_measured(*case, backend) for case in planning.MEMORY_TWO}
