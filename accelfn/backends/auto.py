"""``auto()``: the backend the launch environment asks for, or the best one present."""

from __future__ import annotations

import torch

from accelfn.backends._placement import check_placement
from accelfn.backends.base import Backend
from accelfn.backends.cpu import CPU
from accelfn.backends.cuda import CUDA
from accelfn.backends.env import LaunchEnv


def auto(env: LaunchEnv | None = None, *, place_model: bool = True, place_batches: bool = True) -> Backend:
    """The backend for this process.

    ``accelfn launch --backend cpu|cuda|xla`` (``ACCELFN_BACKEND``) decides when given;
    otherwise CUDA when torch sees a GPU, else CPU. XLA is chosen only when requested.

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
    name = env.backend or ("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda":
        return CUDA(env, place_model=place_model, place_batches=place_batches)
    if name == "xla":
        from accelfn.backends.xla import XLA  # imports torch_xla: only when asked for

        return XLA(env, place_model=place_model, place_batches=place_batches)
    return CPU(env, place_model=place_model, place_batches=place_batches)
