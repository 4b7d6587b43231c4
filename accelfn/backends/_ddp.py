"""What the CPU (gloo) and CUDA (NCCL) backends share: the process group and DDP."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from accelfn.backends._exit import leave_at_exit
from accelfn.backends.env import LaunchEnv
from accelfn.errors import LaunchError
from accelfn.transforms import Replicate


def init_process_group(env: LaunchEnv, backend: str, device: torch.device | None = None) -> None:
    """Joins the default process group of ``env``'s world (nothing for one process).

    The group has a finite timeout (``env.timeout_s``), so a rank that never arrives makes
    the others fail with an error instead of waiting forever.

    Raises:
        LaunchError: a group already exists with another world size or rank, or the other
            ranks did not all arrive at ``MASTER_ADDR:MASTER_PORT`` within ``env.timeout_s``.
    """
    if env.world_size == 1:
        return
    if dist.is_initialized():
        if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
            raise LaunchError(
                f"a process group already exists with world size {dist.get_world_size()} and "
                f"rank {dist.get_rank()}, but the launch environment says {env.world_size} and {env.rank}"
            )
        leave_at_exit()  # a group the script made: accelfn's collectives still run on its workers
        return
    try:
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(seconds=env.timeout_s),
            device_id=device if device is not None and device.type == "cuda" else None,
        )
    except dist.DistError as e:
        raise LaunchError(
            f"rank {env.rank} of WORLD_SIZE={env.world_size} could not form the {backend} process "
            f"group at {env.master_addr}:{env.master_port} within {env.timeout_s:g} s ({e}); start "
            "all ranks together with `accelfn launch`, and check that MASTER_ADDR is reachable "
            "from every node"
        ) from e
    leave_at_exit()


def wrap_ddp(model: torch.nn.Module, replicate: Replicate, world_size: int,
             device_ids: list[int] | None = None) -> torch.nn.Module:
    """``model`` in ``DistributedDataParallel`` with ``replicate``'s options (one process: as is).

    DDP broadcasts rank 0's parameters and buffers at construction, so replicas start equal.
    """
    if world_size == 1:
        return model
    return DistributedDataParallel(
        model,
        device_ids=device_ids,
        bucket_cap_mb=replicate.bucket_cap_mb,
        find_unused_parameters=replicate.find_unused_parameters,
        static_graph=replicate.static_graph,
        gradient_as_bucket_view=replicate.gradient_as_bucket_view,
    )
