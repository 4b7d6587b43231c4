"""``accumulate``: n micro-batches per optimizer update, and the window it keeps open."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import attrs
import torch

from accelfn.errors import count_at_least_one
from accelfn.step import Phase, TransformBase


@attrs.frozen
class Accumulate(TransformBase):
    """Accumulate gradients over ``num_micro_batches`` micro-batches per optimizer update.

    The window's gradient is the mean over its samples (or over the counted items of an
    ``af.Loss``), so ``accumulate(n)`` at micro-batch ``b`` equals one batch of ``n * b``.
    A partial window at the end of an epoch is flushed and normalized by its true size.
    """

    phase: ClassVar[Phase] = Phase.BACKWARD
    kind: ClassVar[str] = "accumulate"
    verb: ClassVar[str] = "accumulate"

    num_micro_batches: int = attrs.field(validator=count_at_least_one)


@attrs.frozen(eq=False)
class Window:
    """An accumulation window in progress: ``transforms_state["window"]`` between micro-batches.

    Attributes:
        reference: ``R``, the backward divisor fixed at the window's first micro-batch.
        count: items (samples, or an ``af.Loss``'s counts) seen so far on this rank.
        num_samples: samples seen so far on this rank.
        loss_sum: the detached sum of the summed losses ``S_i`` in units of ``unit``, for
            the logged loss (``loss_sum * unit / count`` is the window's mean).
        unit: the weight one unit of ``loss_sum`` stands for: the first micro-batch's
            sample count for a mean loss (so equal micro-batches add without multiplying),
            1 for an ``af.Loss``.
        metric_sums: the detached, count-weighted sums of the user's metrics.
    """

    reference: float | torch.Tensor
    count: float | torch.Tensor
    num_samples: int
    loss_sum: torch.Tensor
    unit: float = 1.0
    metric_sums: Mapping[str, torch.Tensor | float] = attrs.field(factory=dict)


def accumulate(num_micro_batches: int) -> Accumulate:
    """Accumulate gradients over ``num_micro_batches`` micro-batches per optimizer update.

    Args:
        num_micro_batches: micro-batches per update, >= 1.

    Raises:
        TypeError: not an int.
        ValueError: less than 1.

    Example:
        >>> import accelfn as af
        >>> af.accumulate(4)
        Accumulate(num_micro_batches=4)
    """
    return Accumulate(num_micro_batches)
