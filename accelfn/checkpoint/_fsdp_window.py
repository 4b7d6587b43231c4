"""The gradients FSDP2 holds unsharded in an open accumulation window, read and put back.

Between micro-batches that skip the reduce-scatter (``set_requires_gradient_sync(False)``,
what ``accumulate`` does under sharding so that only the window's last micro-batch
communicates), FSDP2 keeps each rank's gradients unsharded and unreduced inside its own
records (``FSDPParam.unsharded_accumulated_grad``, or the unsharded parameter's ``.grad``),
out of reach of the sharded parameters' ``.grad``. A checkpoint saved mid-window keeps them
per rank, as it keeps DDP's local gradients; on loading they go back into
``unsharded_accumulated_grad``, which FSDP2 adds the next micro-batch's gradient to and
reduce-scatters at the end of the window, exactly as without the interruption.

These are FSDP2 internals (``torch.distributed.fsdp._fully_shard``), read through
``getattr`` so that a torch without them only loses this feature, with a clear error.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from accelfn.checkpoint.snapshots import clean_name
from accelfn.errors import CheckpointError

__all__ = ["hidden_gradients", "put_hidden_gradients"]


def _fsdp_params(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """``(parameter name, FSDP2's record of it)`` for each parameter FSDP2 manages."""
    names = {id(p): clean_name(n) for n, p in model.named_parameters()}
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        group = getattr(get_state(), "_fsdp_param_group", None) if callable(get_state) else None
        for fsdp_param in getattr(group, "fsdp_params", ()):
            name = names.get(id(getattr(fsdp_param, "sharded_param", None)))
            if name is not None:
                yield name, fsdp_param


def hidden_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's unsharded, unreduced window gradients FSDP2 holds, by parameter name
    (full shape; empty outside a window that skipped the reduce-scatter)."""
    found = {}
    for name, fsdp_param in _fsdp_params(model):
        grad = getattr(fsdp_param, "unsharded_accumulated_grad", None)
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if grad is None and unsharded is not None:
            grad = unsharded.grad
        if grad is not None:
            found[name] = grad.detach()
    return found


def put_hidden_gradients(model: torch.nn.Module, grads: Mapping[str, torch.Tensor]) -> None:
    """Makes ``grads`` (by parameter name, full shape) the window gradients FSDP2 holds for
    this rank, to be added to and reduce-scattered at the end of the window.

    Raises:
        CheckpointError: a gradient for a parameter FSDP2 does not manage here (the state
            is sharded otherwise than the one saved, or this torch's FSDP2 keeps no such record).
    """
    if not grads:
        return
    records = dict(_fsdp_params(model))
    missing = sorted(set(grads) - set(records))
    if missing or not all(hasattr(r, "unsharded_accumulated_grad") for r in records.values()):
        raise CheckpointError(
            f"the checkpoint holds the unsharded gradients of an open accumulation window for {missing or sorted(grads)}, "
            "which this model's FSDP2 does not manage; resume it with the model sharded as it was saved")
    for name, grad in grads.items():
        record = records[name]
        dtype = getattr(record, "reduce_dtype", None) or grad.dtype
        record.unsharded_accumulated_grad = grad.to(device=getattr(record, "device", grad.device), dtype=dtype)
