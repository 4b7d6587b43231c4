"""What ``prepare`` checks of ``shard_params`` across ranks and across runs of one state."""

from __future__ import annotations

from typing import Protocol

import torch

from accelfn.collectives import ReduceOp
from accelfn.transforms import ShardParams


class RankedWorld(Protocol):
    """The backend's rank, world and all-reduce (``Backend`` has them)."""

    rank: int
    world_size: int
    local_world_size: int

    def reduce(self, tensor: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor: ...


def check_group_size(backend: RankedWorld, shard: ShardParams) -> None:
    """Raises on every rank unless all ranks split the world into groups of one size.

    ``shard_size="node"`` takes each node's ``LOCAL_WORLD_SIZE``: nodes running other
    numbers of processes would build different meshes and wait for each other forever.
    One all-reduce of two numbers finds it out, before anything changes.

    Raises:
        ValueError: the world is not a multiple of the group size, or the ranks' group
            sizes differ.
    """
    try:
        degree, error = shard.shard_degree(backend.world_size, backend.local_world_size), None
    except ValueError as e:
        degree, error = 0, e
    if backend.world_size > 1:
        highest, lowest = backend.reduce(torch.tensor([degree, -degree]), "max").tolist()
        if highest != -lowest:
            sizes = (f"from {-lowest} to {highest} ranks" if lowest else
                     f"{highest} on some ranks, on others a size that does not divide the world of {backend.world_size}")
            raise ValueError(
                f"shard_params(shard_size={shard.shard_size!r}): the ranks do not agree on the size of a "
                f"group ({sizes}; this rank, {backend.rank}, has LOCAL_WORLD_SIZE="
                f"{backend.local_world_size}): start the same number of processes on every node, or give "
                "shard_size as a number that divides the world size"
            )
    if error is not None:
        raise error


#: the attribute of a model sharded by ``prepare`` that holds the ShardParams it was sharded with
_SHARDED_WITH = "_accelfn_sharded_with"


def check_same_layout(model: torch.nn.Module, now: ShardParams) -> None:
    """Raises if ``now`` asks for another layout than the one ``model`` was sharded with
    (nothing for a model sharded by hand): units, resharding, offload and group size are
    fixed when a model is sharded. ``reduce_every_micro_batch`` may change.

    Raises:
        ValueError: naming the options that differ.
    """
    before = getattr(model, _SHARDED_WITH, None)
    if before is None or before is now:
        return
    names = ("units", "reshard_after_forward", "offload", "shard_size")
    differ = [name for name in names if getattr(before, name) != getattr(now, name)]
    if differ:
        shown = ", ".join(f"{name}={getattr(before, name)!r} before, {getattr(now, name)!r} now" for name in differ)
        raise ValueError(
            f"this state's model is sharded already, and shard_params() asks for another layout ({shown}); "
            "a model is sharded once: give the step the shard_params(...) it was prepared with, or build the "
            "state again (a new model and optimizer) to shard it otherwise"
        )


def remember_layout(model: torch.nn.Module, shard: ShardParams) -> None:
    """Records on ``model`` the ShardParams ``prepare`` sharded it with (see :func:`check_same_layout`)."""
    setattr(model, _SHARDED_WITH, shard)
