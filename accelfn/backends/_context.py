"""The process context every backend is: its place in the world and the collectives on it.

``Backend`` inherits these; they use only the rank numbers, ``collective_device`` (the
device a backend's collectives take tensors on) and the iterable ``batches`` returned last
(for ``gather_for_metrics``).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from accelfn import collectives
from accelfn.data.batches import EpochBatches
from accelfn.data.tree import map_tensors

F = TypeVar("F", bound=Callable[..., Any])


class ProcessContext:
    """Rank queries, collectives and main-process helpers, working unchanged on a world of one."""

    rank: int
    local_rank: int
    world_size: int
    _active: EpochBatches | None

    @property
    def collective_device(self) -> torch.device:
        """The device tensors must be on for this backend's collectives."""
        raise NotImplementedError

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
        collectives.barrier()

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0 in rank order (sizes may differ)."""
        return collectives.gather(tensor.to(self.collective_device))

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order."""
        return collectives.gather_object(obj)

    def gather_for_metrics(self, tree: Any) -> Any:
        """``gather`` for evaluation: drops the samples ``shard_data`` added to even out the
        epoch's last batch, so metrics count every sample exactly once.

        The result is in rank order (rank 0's batch, then rank 1's, ...), as Accelerate's is:
        with ``shard_data`` each rank reads every world-size-th sample, so that is not the
        dataset's order. ``af.evaluate`` returns outputs in dataset order.

        Args:
            tree: a tensor (leading dimension: samples) or a tuple/list/dict of them,
                computed from the batch most recently read from the iterable the last
                ``backend.batches(...)`` or ``backend.eval_batches(...)`` call returned (the
                contract: that iterable's position says whether this is the epoch's last batch
                and which ranks padded it).
        """
        active = self._active
        drop = active.padding_ranks if active is not None and active.is_last else frozenset()

        def one(t: torch.Tensor) -> torch.Tensor:
            gathered = self.gather(t)
            if not drop or t.ndim == 0:
                return gathered
            per_rank = t.shape[0]
            keep = [gathered[r * per_rank:(r + 1) * per_rank - (1 if r in drop else 0)]
                    for r in range(self.world_size)]
            return torch.cat(keep)

        return map_tensors(one, tree)

    def reduce(self, tensor: torch.Tensor, op: collectives.ReduceOp = "mean") -> torch.Tensor:
        """``tensor`` reduced over ranks with ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``."""
        return collectives.reduce(tensor.to(self.collective_device), op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``tensor`` on every rank."""
        return collectives.broadcast(tensor.to(self.collective_device), src)

    def pad_across_processes(self, tensor: torch.Tensor, *, dim: int = 0, pad_index: float = 0,
                             pad_first: bool = False) -> torch.Tensor:
        """``tensor`` padded along ``dim`` to the largest size over ranks."""
        return collectives.pad_across_processes(tensor.to(self.collective_device), dim=dim,
                                                pad_index=pad_index, pad_first=pad_first)

    def split_between_processes(self, inputs: Any) -> Any:
        """This rank's contiguous part of a sequence, tensor or dict of them."""
        return collectives.split_between_processes(inputs, rank_=self.rank, world_size_=self.world_size)

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
