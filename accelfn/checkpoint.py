"""Checkpoints (being built): the hooks ``run`` calls."""

from __future__ import annotations

import contextlib
from typing import Any

NO_PREEMPTION = contextlib.nullcontext()


def check_run_arguments(checkpoints: Any, resume: Any) -> None:
    if checkpoints is not None or resume is not None:
        raise NotImplementedError("checkpoints are not built yet")


def resume_state(state: Any, checkpoints: Any, resume: Any, backend: Any) -> Any:
    return state


class Preemption:
    def __init__(self, backend: Any) -> None:
        raise NotImplementedError
