"""Walking batches: nested tuples, lists, named tuples and dicts of tensors."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """Applies ``fn`` to every tensor in ``tree``, keeping the container types."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, tuple):
        mapped = [map_tensors(fn, x) for x in tree]
        if type(tree) is not tuple and hasattr(tree, "_fields"):  # a named tuple
            return type(tree)(*mapped)
        return tuple(mapped)
    if isinstance(tree, list):
        return [map_tensors(fn, x) for x in tree]
    if isinstance(tree, Mapping):
        return type(tree)({k: map_tensors(fn, v) for k, v in tree.items()})  # type: ignore[call-arg]  # a Mapping subclass built from a dict, as dict and OrderedDict are
    return tree


def first_tensor(tree: Any) -> torch.Tensor | None:
    """The first tensor of ``tree`` in depth-first order, or None."""
    if isinstance(tree, torch.Tensor):
        return tree
    if isinstance(tree, (tuple, list)):
        items: Any = tree
    elif isinstance(tree, Mapping):
        items = tree.values()
    else:
        return None
    for x in items:
        found = first_tensor(x)
        if found is not None:
            return found
    return None


def num_samples(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor (1 if it has none)."""
    if type(batch) is tuple and batch and type(batch[0]) is torch.Tensor and batch[0].ndim:  # the common case
        return batch[0].shape[0]
    t = first_tensor(batch)
    return int(t.shape[0]) if t is not None and t.ndim > 0 else 1
