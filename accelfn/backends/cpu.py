"""The CPU backend: one process, or many over a gloo process group."""

from __future__ import annotations

from typing import ClassVar

import torch

from accelfn.backends.base import Backend
from accelfn.distributed import ddp, process_group
from accelfn.distributed.env import LaunchEnv
from accelfn.transforms import Replicate


class CPU(Backend):
    """Runs on the CPU; with ``WORLD_SIZE > 1`` (``accelfn launch``) joins a gloo group.

    Args:
        env: the launch environment; by default read from the process environment.
        place_model: move the model to this backend's device in ``prepare`` (False: leave
            it where it is, e.g. split over devices by hand).
        place_batches: move each batch to the device as it is read (False: leave batches
            as the DataLoader made them).

    Raises:
        TypeError: a placement option that is not a bool.
        LaunchError: an inconsistent launch environment.

    Example:
        >>> import accelfn as af
        >>> af.backends.CPU().world_size
        1
    """

    name: ClassVar[str] = "cpu"
    # torch autocasts to bfloat16 and float16 on CPU (fp16 since torch 2.3)
    supported_precisions: ClassVar[tuple[str, ...]] = ("fp32", "bf16", "fp16", "bf16-true", "fp8")

    def __init__(self, env: LaunchEnv | None = None, *, place_model: bool = True, place_batches: bool = True):
        env = LaunchEnv.from_env() if env is None else env
        super().__init__(env, torch.device("cpu"), place_model=place_model, place_batches=place_batches)
        process_group.init_process_group(env, "gloo")

    def wrap_model(self, model: torch.nn.Module, replicate: Replicate) -> torch.nn.Module:
        return ddp.wrap_ddp(model, replicate, self.world_size)
