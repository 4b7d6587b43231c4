"""Whole gradients of a model sharded by FSDP2, for ``invariant()`` under ``shard_params()``.

FSDP2 reduce-scatters each unit's gradients inside its post-backward hook, with the
process group's reduce-scatter (an order of additions neither fixed nor exposed, which
also differs with the world size). Under ``invariant()`` that reduction is switched off
(``set_requires_gradient_sync(False)``, FSDP2's own way to accumulate without
communication): after a micro-batch's backward, every FSDP2 parameter keeps its whole
(unsharded) gradient, which :func:`take_unsharded_grads` takes, as a replicated model's
``.grad``. The canonical tree sums them (``backends._invariant``); :func:`local_piece` then
makes each parameter's gradient this rank's piece of the sum, a view of it, as a DTensor
laid out as the parameter (``Shard(0)``: ``torch.chunk`` of dim 0, empty pieces for ranks
past the rows, as FSDP2 and DTensor cut it).

torch's private ``FSDPState._fsdp_param_groups`` / ``FSDPParam`` are read (checked to have
what is used; a missing piece raises RuntimeError naming it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from accelfn.backends._fsdp import fsdp2


def _fsdp_params(model: torch.nn.Module) -> dict[int, Any]:
    """Each FSDP2 parameter record of ``model``, by ``id`` of its sharded parameter."""
    fsdp = fsdp2()
    found: dict[int, Any] = {}
    for module in model.modules():
        if not isinstance(module, fsdp.FSDPModule):
            continue
        state = module._get_fsdp_state()  # noqa: SLF001  # torch's own
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            single = getattr(state, "_fsdp_param_group", None)
            groups = [single] if single is not None else []
        for group in groups:
            for record in group.fsdp_params:
                found[id(record.sharded_param)] = record
    return found


def take_unsharded_grads(model: torch.nn.Module, params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """The whole gradient of each of ``params`` (sharded parameters of ``model``) from the
    backward just run without gradient sync, in their order (None: no gradient); FSDP2's
    copy is dropped, so the next backward starts from none.

    Raises:
        RuntimeError: a parameter FSDP2 does not hold, or a torch whose FSDP2 lacks what is read.
    """
    records = _fsdp_params(model)
    out: list[torch.Tensor | None] = []
    for param in params:
        record = records.get(id(param))
        if record is None or not hasattr(record, "unsharded_accumulated_grad"):
            raise RuntimeError("invariant() with shard_params(): an optimizer parameter is not one FSDP2 shards "
                               "(or this torch's FSDP2 keeps no unsharded gradient); please report it")
        grad = record.unsharded_accumulated_grad  # set under a reduce dtype other than the parameter's
        unsharded = getattr(record, "_unsharded_param", None)
        if grad is None and unsharded is not None:
            grad = unsharded.grad
        record.unsharded_accumulated_grad = None
        if unsharded is not None:
            unsharded.grad = None
        out.append(grad)
    return out


def local_piece(whole: torch.Tensor, param: Any) -> torch.Tensor:
    """This rank's piece of ``whole`` (a whole gradient of ``param``'s global shape) as a
    DTensor laid out as ``param``, its local tensor a view of ``whole`` (in-place changes to
    ``whole`` change it).

    Raises:
        RuntimeError: ``param``'s layout is not ``Shard``/``Replicate`` pieces of this shape.
    """
    from torch.distributed.tensor import DTensor  # imported: param is a DTensor

    mesh, local = param.device_mesh, whole
    for dim, placement in enumerate(param.placements):
        if placement.is_replicate():
            continue
        if not placement.is_shard():
            raise RuntimeError(f"invariant() with shard_params(): a parameter laid out as {placement}")
        size, axis = mesh.size(dim), placement.dim
        pieces = list(torch.chunk(local, size, dim=axis))
        pieces += [local.narrow(axis, local.shape[axis], 0)] * (size - len(pieces))
        local = pieces[mesh.get_local_rank(dim)]
    with torch.no_grad():
        shard_shape = param.to_local().shape
    if local.shape != shard_shape:
        raise RuntimeError(f"invariant() with shard_params(): this rank's piece has shape {tuple(local.shape)}, "
                           f"its shard {tuple(shard_shape)}")
    return DTensor.from_local(local, mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())
