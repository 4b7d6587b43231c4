"""The CUDA backend: one GPU per process, DDP over an NCCL process group."""

from __future__ import annotations

from typing import ClassVar

import torch

from accelfn.backends._placement import check_placement
from accelfn.backends.base import Backend
from accelfn.distributed import ddp, process_group
from accelfn.distributed.env import LaunchEnv
from accelfn.transforms import Policy, Replicate


class CUDA(Backend):
    """Runs on GPU ``LOCAL_RANK``; with ``WORLD_SIZE > 1`` joins an NCCL group.

    Args:
        env: the launch environment; by default read from the process environment.
        place_model: move the model to this backend's device in ``prepare`` (False: leave
            it where it is, e.g. split over devices by hand).
        place_batches: move each batch to the device as it is read (False: leave batches
            as the DataLoader made them).

    Raises:
        TypeError: a placement option that is not a bool.
        RuntimeError: no CUDA device is visible, or fewer than ``LOCAL_RANK + 1``.
        LaunchError: an inconsistent launch environment.
    """

    name: ClassVar[str] = "cuda"
    supported_precisions: ClassVar[tuple[str, ...]] = ("fp32", "bf16", "fp16", "bf16-true", "fp8")

    def __init__(self, env: LaunchEnv | None = None, *, place_model: bool = True, place_batches: bool = True):
        check_placement("CUDA", place_model=place_model, place_batches=place_batches)  # before any state changes
        env = LaunchEnv.from_env() if env is None else env
        if not torch.cuda.is_available():
            raise RuntimeError(
                "the CUDA backend needs a CUDA GPU, and torch sees none "
                f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); use "
                "af.backends.CPU() or af.backends.auto()"
            )
        count = torch.cuda.device_count()
        if env.local_rank >= count:
            raise RuntimeError(
                f"LOCAL_RANK={env.local_rank} but only {count} GPU(s) are visible; launch at "
                f"most {count} processes per node"
            )
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
        super().__init__(env, device, place_model=place_model, place_batches=place_batches)
        process_group.init_process_group(env, "nccl", device)

    def check_precision(self, policy: Policy) -> None:
        super().check_precision(policy)
        if policy.compute_dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise NotImplementedError(
                f"with_precision({policy.name!r}) needs bfloat16, which "
                f"{torch.cuda.get_device_name(self.device)} does not support; use 'fp16'"
            )

    def wrap_model(self, model: torch.nn.Module, replicate: Replicate) -> torch.nn.Module:
        # a model left where the user put it (maybe over several GPUs) is wrapped where it is
        device_ids = [self.device.index] if self.place_model else None
        return ddp.wrap_ddp(model, replicate, self.world_size, device_ids=device_ids)

    def peak_memory_bytes(self) -> int | None:
        """The CUDA caching allocator's peak of allocated memory on this device since the
        process started (``torch.cuda.max_memory_allocated``), in bytes."""
        return int(torch.cuda.max_memory_allocated(self.device))
