"""Backends interpret Steps: ``CPU``, ``CUDA``, ``XLA`` and ``auto()``."""

from __future__ import annotations

from typing import Any

from accelfn.backends._interpreter import StepFn
from accelfn.backends.auto import auto
from accelfn.backends.base import Backend
from accelfn.backends.cpu import CPU
from accelfn.backends.cuda import CUDA
from accelfn.distributed.env import LaunchEnv

__all__ = ["CPU", "CUDA", "XLA", "Backend", "LaunchEnv", "StepFn", "auto"]


def __getattr__(name: str) -> Any:
    if name == "XLA":  # torch_xla is imported only when XLA is asked for
        from accelfn.backends.xla import XLA

        return XLA
    raise AttributeError(f"module 'accelfn.backends' has no attribute {name!r}")
