"""The global gradient norm, and clipping to it, over gradients that live on several meshes.

Under ``shard_params`` every gradient is a DTensor shard; under ``tensor_parallel`` some are
DTensors (the split layers) and some plain tensors (the layers the plan leaves whole, equal
on every rank of a tensor-parallel group); under both, DTensors live on the 2-D
``(data, tensor)`` mesh and on its 1-D ``data`` sub-mesh at once. ``torch.nn.utils.
clip_grad_norm_`` refuses such a mix ("mixed torch.Tensor and DTensor"; DTensors on several
meshes cannot be stacked), so the norm is taken here from the local shards, and each
gradient's ``|g|^p`` is summed only over the mesh dimensions along which its pieces differ:

    total^p = sum_plain |g|^p  +  sum_{layout} all_reduce_sum(sum_{g of layout} |local(g)|^p,
                                                              over each split dimension of layout)

A *layout* is a mesh together with the dimensions a gradient is split along (``Shard``, or the
``_StridedShard`` FSDP2 uses over a tensor-parallel split, which is no ``Shard`` to torch). A
``Replicate`` dimension holds the same values on each of its ranks, so summing along it would
count them several times: it is not reduced. A ``Partial`` gradient (a sum still to be taken)
is first turned into ``Replicate`` (``DTensor.redistribute``). For the inf-norm, every sum is
a maximum. The coefficient ``min(1, max_norm / (total + 1e-6))`` then scales every local
shard in place, as ``clip_grad_norm_`` does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from accelfn.distributed import is_dtensor


def local_gradients(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each parameter's gradient on this rank: a DTensor's local shard (in-place ops on it change the gradient).

    Taken without autograd (``DTensor.to_local`` then returns the shard itself, where with
    gradients enabled it runs an autograd function per parameter, about 14 µs each on CPU).
    """
    with torch.no_grad():
        return [g.to_local() if is_dtensor(g) else g for g in (p.grad for p in params) if g is not None]


def _by_device_and_dtype(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by (device, dtype), in order of first appearance: the lists a
    foreach kernel takes (one device and dtype each)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def _local_norm(groups: Sequence[list[torch.Tensor]], norm_type: float, device: torch.device) -> torch.Tensor:
    """The p-norm of this rank's tensors taken together, a float32 scalar on ``device``: one
    ``torch._foreach_norm`` per device and dtype, then the norm of those norms (as
    ``torch.nn.utils.get_total_norm``). Empty tensors (a rank's shard of a parameter with
    fewer rows than ranks) add nothing to any p-norm, so they are left out: the inf-norm of
    an empty tensor has no identity and would raise on that rank alone. A rank without any
    element has norm 0, which every rank's sum or max then leaves unchanged."""
    norms = []
    for group in groups:
        nonempty = [t for t in group if t.numel()] if math.isinf(norm_type) else group
        if nonempty:
            norms.append(torch.stack(torch._foreach_norm(nonempty, norm_type)).float().to(device))
    if not norms:
        return torch.zeros((), device=device)
    return torch.linalg.vector_norm(norms[0] if len(norms) == 1 else torch.cat(norms), norm_type)


def local_norm(tensors: Sequence[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """The p-norm of this rank's ``tensors`` taken together, a float32 scalar on ``device``
    (one foreach norm per device and dtype, as in :func:`global_norm`); a rank's share, for
    the caller to reduce over its own group (a pipeline's stages)."""
    return _local_norm(_by_device_and_dtype(tensors), norm_type, device)


def _unpartial(param: torch.Tensor) -> None:
    """Turns a ``Partial`` gradient of ``param`` into ``Replicate`` (the pending sum taken)."""
    grad: Any = param.grad
    if is_dtensor(grad) and any(p.is_partial() for p in grad.placements):
        from torch.distributed.tensor import Replicate  # imported: a DTensor exists

        param.grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])


def _layouts(params: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], dict[Any, list[torch.Tensor]]]:
    """This rank's gradients split into plain ones and, per layout (the process groups of the
    dimensions of a DTensor's mesh that are not ``Replicate``, in mesh order: ``Shard``, and FSDP2's
    ``_StridedShard`` of a 2-D layout, which torch does not count as ``Shard``), the local shards of
    DTensor ones.
    Every rank holds the same parameters, so every rank finds the same layouts in the same order."""
    plain: list[torch.Tensor] = []
    layouts: dict[Any, list[torch.Tensor]] = {}
    for param in params:
        _unpartial(param)
        grad: Any = param.grad
        if grad is None:
            continue
        if not is_dtensor(grad):
            plain.append(grad)
            continue
        mesh = grad.device_mesh
        groups = tuple(mesh.get_group(dim) for dim, p in enumerate(grad.placements) if not p.is_replicate())
        with torch.no_grad():
            layouts.setdefault(groups, []).append(grad.to_local())
    return plain, layouts


def global_norm(params: Sequence[torch.Tensor], norm_type: float, collective_device: torch.device) -> torch.Tensor:
    """The p-norm of all gradients of ``params`` together, as if every parameter were one
    whole tensor on one process (see the module docstring for the reduction).

    Args:
        params: the parameters; each gradient a plain tensor, a DTensor on any mesh, or None.
        norm_type: the p of the p-norm (> 0), or ``math.inf``.
        collective_device: where the collectives' tensors must be (gloo: CPU; NCCL: the GPU).

    Returns:
        A float32 scalar tensor, the same on every rank, on the device of the first gradient
        (``collective_device`` without any).
    """
    plain, layouts = _layouts(params)
    first = next((g for g in plain), None)
    if first is None:
        first = next((gs[0] for gs in layouts.values()), None)
    device = first.device if first is not None else collective_device
    inf = math.isinf(norm_type)
    with torch.no_grad():
        parts = [_local_norm(_by_device_and_dtype(plain), norm_type, device)]
        for groups, grads in layouts.items():
            local = _local_norm(_by_device_and_dtype(grads), norm_type, device)
            value = (local if inf else local ** norm_type).to(collective_device)
            for group in groups:
                dist.all_reduce(value, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
            parts.append(value.to(device) if inf else value.to(device) ** (1.0 / norm_type))
        return torch.linalg.vector_norm(torch.stack(parts), norm_type)


def clip_grad_norm(params: Sequence[torch.Tensor], max_norm: float, norm_type: float,
                   collective_device: torch.device) -> torch.Tensor:
    """``clip_grad_norm_`` over gradients that may be DTensor shards on several meshes and
    plain tensors together: the exact global norm (:func:`global_norm`), then every local
    shard scaled by ``min(1, max_norm / (total + 1e-6))`` (``torch._foreach_mul_``).

    The collectives run on ``collective_device``, so shards offloaded to CPU memory under
    NCCL are reduced too. A rank whose shards are empty (a parameter with fewer rows than
    ranks) takes part with norm 0, also for the inf-norm.

    Args:
        params: the parameters, each with a gradient or None.
        max_norm: the largest allowed total norm.
        norm_type: p of the p-norm, or ``math.inf``.
        collective_device: the process group's device.

    Returns:
        The total norm before clipping, a float32 scalar tensor equal on every rank: the
        unsharded model's gradient norm.

    References:
        Pascanu, Mikolov, Bengio, "On the difficulty of training recurrent neural
        networks", ICML 2013.
    """
    total = global_norm(params, norm_type, collective_device)
    grads = local_gradients(params)
    if not grads:
        return total
    with torch.no_grad():
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for group in _by_device_and_dtype(grads):
            torch._foreach_mul_(group, coefficient.to(group[0].device, group[0].dtype))
    return total
