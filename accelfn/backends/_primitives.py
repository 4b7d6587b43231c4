"""What the phase interpreter asks of a backend: the hardware primitives, as a protocol.

``Backend`` has all of it; the interpreter depends on this protocol rather than on
``Backend`` itself, so the two modules do not import each other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Literal, Protocol

import torch

from accelfn.transforms.precision import Policy


class Primitives(Protocol):
    """What the interpreter asks of a backend (``Backend`` has all of it): the hardware
    primitives each backend file overrides, and nothing else."""

    world_size: int
    rank: int
    #: XLA's graph cut after each micro-batch (``torch_xla.sync``), None elsewhere
    graph_cut: Callable[[], None] | None

    def autocast(self, policy: Policy) -> contextlib.AbstractContextManager[Any]: ...

    def no_sync(self, wrapped: torch.nn.Module) -> Callable[[], contextlib.AbstractContextManager[Any]]: ...

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None: ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def reduce(self, tensor: torch.Tensor, op: Literal["sum", "mean", "max", "min"] = "mean") -> torch.Tensor: ...
