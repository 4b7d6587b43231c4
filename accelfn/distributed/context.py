"""The process context: this process's place in the world and the collectives on it.

The one type that describes a process among the ranks. Every backend is one (``Backend``
adds the hardware); code below the backends that runs collectives (checkpoints) takes one,
and without a backend ``ProcessContext.default()`` stands for the default process group of
``torch.distributed`` (or a world of one process).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from accelfn.distributed import ops

F = TypeVar("F", bound=Callable[..., Any])


class ProcessContext:
    """Rank queries, collectives and main-process helpers, working unchanged on a world of one.

    Args:
        rank, local_rank: this process's global rank and its rank on its node.
        world_size, local_world_size: processes in all, and on this node.
    """

    def __init__(self, *, rank: int = 0, local_rank: int = 0, world_size: int = 1, local_world_size: int = 1):
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.local_world_size = local_world_size

    @classmethod
    def default(cls) -> ProcessContext:
        """The default process group of ``torch.distributed`` (a world of one without one);
        its node is taken to be the whole world."""
        world_size = ops.world_size()
        return cls(rank=ops.rank(), local_rank=ops.rank(), world_size=world_size, local_world_size=world_size)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"

    @property
    def collective_device(self) -> torch.device:
        """The device tensors must be on for this context's collectives (gloo: the CPU; NCCL:
        this process's GPU)."""
        return ops.default_device()

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        """True on local rank 0 (one process per node)."""
        return self.local_rank == 0

    def barrier(self) -> None:
        """Waits until every rank reaches this call."""
        ops.barrier()

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0 in rank order (sizes may differ)."""
        return ops.gather(tensor.to(self.collective_device))

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order."""
        return ops.gather_object(obj)

    def reduce(self, tensor: torch.Tensor, op: ops.ReduceOp = "mean") -> torch.Tensor:
        """``tensor`` reduced over ranks with ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``."""
        return ops.reduce(tensor.to(self.collective_device), op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``tensor`` on every rank."""
        return ops.broadcast(tensor.to(self.collective_device), src)

    def pad_across_processes(self, tensor: torch.Tensor, *, dim: int = 0, pad_index: float = 0,
                             pad_first: bool = False) -> torch.Tensor:
        """``tensor`` padded along ``dim`` to the largest size over ranks."""
        return ops.pad_across_processes(tensor.to(self.collective_device), dim=dim,
                                                pad_index=pad_index, pad_first=pad_first)

    def split_between_processes(self, inputs: Any) -> Any:
        """This rank's contiguous part of a sequence, tensor or dict of them."""
        return ops.split_between_processes(inputs, rank_=self.rank, world_size_=self.world_size)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            builtins.print(*args, **kwargs)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Runs the block on the main process first, then on the others (downloads, caches)."""
        if not self.is_main_process:
            self.barrier()
        yield
        if self.is_main_process:
            self.barrier()

    def on_main_process(self, fn: F) -> F:
        """Decorator: ``fn`` runs on the main process only (returns None elsewhere)."""
        return self._only_if(fn, self.is_main_process)

    def on_local_main_process(self, fn: F) -> F:
        """Decorator: ``fn`` runs on each node's local main process only."""
        return self._only_if(fn, self.is_local_main_process)

    @staticmethod
    def _only_if(fn: F, condition: bool) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs) if condition else None

        return wrapper  # type: ignore[return-value]  # functools.wraps keeps fn's signature
