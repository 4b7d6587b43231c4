"""Placement: moving a batch's tensors to the backend's device."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch

from accelfn.data._tree import map_tensors


def place_on(device: torch.device) -> Callable[[Any], Any]:
    """A function moving every tensor of a batch to ``device`` (asynchronously when pinned)."""
    non_blocking = device.type == "cuda"
    # checking is cheaper than .to(), which would return the tensor itself (is_cpu most)
    here: Callable[[torch.Tensor], bool] = (
        operator.attrgetter("is_cpu") if device.type == "cpu" else (lambda t: t.device == device))

    def move(t: torch.Tensor) -> torch.Tensor:
        return t if here(t) else t.to(device, non_blocking=non_blocking)

    def place(batch: Any) -> Any:
        if type(batch) is tuple:  # the common case: a tuple of tensors already there, kept as is
            for t in batch:
                if type(t) is not torch.Tensor or not here(t):
                    break
            else:
                return batch
        return map_tensors(move, batch)

    return place
