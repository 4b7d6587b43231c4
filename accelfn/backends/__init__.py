"""Backends interpret Steps: ``CPU``, ``CUDA``, ``XLA``, and ``auto()``, the backend the launch
environment asks for or the best one present."""

from __future__ import annotations

import importlib.util
import os
import warnings
from typing import Any

import torch

from accelfn.backends._interpreter import StepFn
from accelfn.backends._placement import check_placement
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


def auto(env: LaunchEnv | None = None, *, place_model: bool = True, place_batches: bool = True) -> Backend:
    """The backend for this process.

    ``accelfn launch --backend cpu|cuda|xla`` (``ACCELFN_BACKEND``) decides when given;
    otherwise XLA when ``PJRT_DEVICE`` is set (torch_xla's own choice of device: ``TPU``,
    ``CUDA``, ``CPU``) and torch_xla is installed, else CUDA when torch sees a GPU, else CPU.
    ``PJRT_DEVICE`` without torch_xla warns and goes on without XLA.

    Args:
        env: the launch environment; by default read from the process environment.
        place_model, place_batches: whether the backend moves the model and the batches
            to its device (see ``CPU``); False leaves them where the user put them.

    Returns:
        Backend: a ready backend (its process group joined when the world is larger than 1).

    Raises:
        TypeError: a placement option that is not a bool.
        LaunchError: an inconsistent launch environment.
        ImportError: XLA requested but torch_xla is not installed.

    Example:
        >>> import accelfn as af
        >>> backend = af.backends.auto()
        >>> backend.world_size >= 1
        True
    """
    check_placement("auto", place_model=place_model, place_batches=place_batches)
    env = LaunchEnv.from_env() if env is None else env
    name = env.backend or _discovered()
    if name == "cuda":
        return CUDA(env, place_model=place_model, place_batches=place_batches)
    if name == "xla":
        from accelfn.backends.xla import XLA  # imports torch_xla: only when asked for

        return XLA(env, place_model=place_model, place_batches=place_batches)
    return CPU(env, place_model=place_model, place_batches=place_batches)


def _discovered() -> str:
    """The backend this machine offers: XLA where ``PJRT_DEVICE`` asks for it, else CUDA or CPU."""
    fallback = "cuda" if torch.cuda.is_available() else "cpu"
    device = os.environ.get("PJRT_DEVICE")
    if not device:
        return fallback
    if importlib.util.find_spec("torch_xla") is not None:
        return "xla"
    version = torch.__version__.split("+")[0]
    warnings.warn(f"PJRT_DEVICE={device} asks for torch_xla, which is not installed: auto() uses {fallback}; "
                  f"install it (pip install 'torch_xla=={version}') or unset PJRT_DEVICE", RuntimeWarning,
                  stacklevel=3)
    return fallback
