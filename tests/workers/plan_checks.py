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
