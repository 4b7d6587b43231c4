"""``replicate``: data parallel, gradients all-reduced across processes (DDP's options)."""

from __future__ import annotations

from typing import ClassVar

import attrs

from accelfn.errors import boolean, finite_positive
from accelfn.step import Phase, TransformBase


@attrs.frozen
class Replicate(TransformBase):
    """Data parallel: the model is replicated and gradients are all-reduced (averaged).

    On CPU and CUDA this is ``torch.nn.parallel.DistributedDataParallel``, whose options
    these are; on XLA the gradients are reduced with torch_xla's all-reduce. Under
    ``accumulate(n)`` only the last micro-batch of a window synchronizes.

    Attributes:
        bucket_cap_mb: DDP gradient bucket size in mebibytes.
        find_unused_parameters: let DDP tolerate parameters without a gradient.
        static_graph: tell DDP the graph is the same every step.
        gradient_as_bucket_view: gradients alias DDP's buckets (saves memory).
    """

    phase: ClassVar[Phase] = Phase.MODEL
    kind: ClassVar[str] = "replicate"
    verb: ClassVar[str] = "replicate"

    bucket_cap_mb: float = attrs.field(default=25.0, validator=finite_positive)
    find_unused_parameters: bool = attrs.field(default=False, validator=boolean)
    static_graph: bool = attrs.field(default=False, validator=boolean)
    gradient_as_bucket_view: bool = attrs.field(default=False, validator=boolean)


def replicate(
    *,
    bucket_cap_mb: float = 25.0,
    find_unused_parameters: bool = False,
    static_graph: bool = False,
    gradient_as_bucket_view: bool = False,
) -> Replicate:
    """Data parallel over all processes; see :class:`Replicate` for the options (DDP's).

    Raises:
        ValueError: ``bucket_cap_mb`` not > 0.
        TypeError: a flag that is not a bool.
    """
    return Replicate(bucket_cap_mb, find_unused_parameters, static_graph, gradient_as_bucket_view)
