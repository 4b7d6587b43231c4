"""The numerics of a step, written once as functions that read like their equations.

Accumulation window (DESIGN.md §7.3). Micro-batch ``i`` of a window contributes a summed
loss ``S_i`` over ``C_i`` items (a mean loss ``l_i`` over ``b_i`` samples is ``S_i = l_i b_i``,
``C_i = b_i``; an ``af.Loss`` gives them directly). The window's gradient is the gradient
of the mean over all its items, on all ``W`` ranks::

    g = grad( sum_{r,i} S_ri ) / sum_{r,i} C_ri

To keep gradients at their usual magnitude (fp16 has little range), each backward uses
``S_i / R`` with a reference ``R`` fixed at the window's first micro-batch, ``R = n * C_0``
(so a full window of equal micro-batches backpropagates exactly ``l_i / n``, as a
hand-written loop does; under ``replicate`` an ``af.Loss``, whose counts differ by rank,
uses ``R = 1``). After the all-reduce averaged over ``W`` ranks, the gradient is
multiplied by ``correction = R * W / sum_{r,i} C_ri``, which is 1 for full, even windows.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch


def window_reference(num_micro_batches: int, first_count: float | torch.Tensor) -> float | torch.Tensor:
    """``R = n * max(C_0, 1)``: the backward divisor fixed at a window's first micro-batch.

    Any positive ``R`` gives the same gradient (the correction divides it out); ``C_0`` keeps
    magnitudes usual, and the floor of 1 keeps an empty first micro-batch from dividing by 0.
    """
    if isinstance(first_count, torch.Tensor):
        return num_micro_batches * first_count.clamp_min(1)
    return num_micro_batches * max(first_count, 1)


def window_correction(
    reference: float | torch.Tensor, world_size: int, global_count: float | torch.Tensor
) -> float | torch.Tensor:
    """``R * W / sum(C)``: turns the accumulated ``sum(S_i / R)`` into the window mean.

    A window without items (``sum(C) = 0``, an all-padding batch, say) has a zero gradient:
    its correction is 0, whatever its totals. Any positive count, also one below 1
    (fractional weights), divides exactly.
    """
    if isinstance(global_count, torch.Tensor):
        positive = global_count > 0
        return torch.where(positive, reference * world_size / torch.where(positive, global_count, 1), 0.0)
    return reference * world_size / global_count if global_count > 0 else 0.0


def window_mean(
    local_sum: torch.Tensor | float, world_size: int, global_count: float | torch.Tensor
) -> torch.Tensor | float:
    """``W * sum_i S_i / sum_{r,i} C_ri``: this rank's share of the window's mean loss.

    Averaged over the ``W`` ranks (as ``run`` reduces its metrics), the shares give
    ``sum_{r,i} S_ri / sum_{r,i} C_ri``, the loss of the update as one big batch would
    have it, whatever the counts on each rank. A window without items logs 0.
    """
    if isinstance(global_count, torch.Tensor):
        positive = global_count > 0
        return torch.where(positive, local_sum * world_size / torch.where(positive, global_count, 1), 0.0)
    return local_sum * (world_size / global_count) if global_count > 0 else local_sum * 0.0


def unscale_and_check(grads: Sequence[torch.Tensor], inv_scale: float | torch.Tensor) -> torch.Tensor:
    """Multiplies ``grads`` in place by ``inv_scale``; returns a 1-element tensor, > 0 iff any
    gradient element is inf or NaN.

    One fused kernel per device (``torch._amp_foreach_non_finite_check_and_unscale_``, the
    kernel ``torch.amp.GradScaler.unscale_`` uses). Reading the result costs a host sync.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        by_device[g.device].append(g)
    found: list[torch.Tensor] = []
    for device, group in by_device.items():
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        inv = torch.as_tensor(inv_scale, dtype=torch.float32, device=device).reshape(1)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv)
        found.append(found_inf)
    if not found:
        return torch.zeros(1)
    return found[0] if len(found) == 1 else torch.stack([f.cpu() for f in found]).sum(0)


def scale_(grads: Sequence[torch.Tensor], factor: float | torch.Tensor) -> None:
    """Multiplies ``grads`` in place by ``factor`` (one fused kernel per device and dtype)."""
    if grads:
        torch._foreach_mul_(list(grads), factor)
