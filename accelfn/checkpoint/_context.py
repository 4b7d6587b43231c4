"""The process context a checkpoint is written and read in: a backend, or the default group.

``save`` and ``load`` are collectives in a multi-process world. They need only a few of a
backend's methods (its rank, world size, gather, broadcast, barrier), written down here as
a protocol so that the checkpoint package does not depend on the backends: any backend
satisfies it, and without one the default process group of ``torch.distributed`` (or a
world of one process) serves.
"""

from __future__ import annotations

from typing import Protocol

import torch

from accelfn import collectives


class ProcessContext(Protocol):
    """What a checkpoint needs of the processes it is written by (``af.backends.Backend`` has it)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_main_process(self) -> bool: ...

    def gather(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor: ...

    def barrier(self) -> None: ...


class DefaultGroup:
    """The default process group (a world of one without one), exchanging tensors on the
    device its backend expects (``collectives.default_device``)."""

    def __init__(self) -> None:
        self.device = collectives.default_device()

    @property
    def rank(self) -> int:
        return collectives.rank()

    @property
    def world_size(self) -> int:
        return collectives.world_size()

    @property
    def is_main_process(self) -> bool:
        return collectives.rank() == 0

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return collectives.gather(tensor.to(self.device))

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return collectives.broadcast(tensor.to(self.device), src)

    def barrier(self) -> None:
        collectives.barrier()


def default_context(backend: ProcessContext | None) -> ProcessContext:
    """``backend``, or the default process group when it is None."""
    return backend if backend is not None else DefaultGroup()
