"""``replicate``: data parallel, gradients all-reduced across processes (DDP's options, its
communication hook), and the record of a PowerSGD hook's state that the TrainState carries."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import attrs
import torch

from accelfn.errors import boolean, finite_positive, wrong_type
from accelfn.step import Phase, TransformBase

#: a PowerSGD option's value: PowerSGDState takes numbers and flags
CommOption = tuple[str, "bool | int | float"]


def _check_hook(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and not callable(value):
        raise wrong_type("replicate", "comm_hook", "None or a DDP communication hook, a callable "
                         "hook(state, bucket) -> Future such as torch.distributed.algorithms.ddp_comm_hooks."
                         "default_hooks.bf16_compress_hook", value)


def _comm_state(value: object) -> tuple[CommOption, ...]:
    """``replicate(comm_state=...)``, a mapping of option names to numbers and flags, as a
    sorted tuple of pairs (hashable, as a transform is)."""
    if isinstance(value, tuple):
        return value
    if not isinstance(value, Mapping):
        raise wrong_type("replicate", "comm_state", "a mapping of PowerSGDState options, e.g. "
                         "{'matrix_approximation_rank': 2, 'start_powerSGD_iter': 10}", value)
    for key, option in value.items():
        if not isinstance(key, str) or not isinstance(option, (bool, int, float)):
            raise wrong_type("replicate", "comm_state", "a mapping of option names (str) to numbers or bools",
                             dict(value))
    return tuple(sorted(value.items()))


@attrs.frozen(eq=False)
class PowerSGDMemory:
    """What a PowerSGD communication hook keeps between updates on one rank, as the
    TrainState carries it (``transforms_state["comm_hook"]``), so that a checkpoint resumes
    it bitwise: torch's ``PowerSGDState`` without its options and process group.

    Attributes:
        iter: synchronized backward passes so far (PowerSGD compresses from
            ``start_powerSGD_iter`` on).
        error: per gradient bucket (by index), the error feedback: what compression lost.
        p: per bucket, the P matrices of the low-rank approximation (one flat tensor).
        q: per bucket, the Q matrices, kept for warm start.
        rng_keys: the hook's numpy RandomState (MT19937) keys, 624 values as int64 (it draws
            the Q matrices' initial values).
        rng_pos, rng_has_gauss, rng_gauss: the rest of that RandomState's state.
        numel_before, numel_after, next_stats_report: its compression statistics.
        layouts: per bucket, the parameters (their indices in ``model.parameters()``) in the
            order the bucket held them when the memory was last written: a new DDP wrapper
            (a resumed run) first orders its buckets otherwise, and the memory is laid out
            again to match (so the resume is bitwise).
    """

    iter: int
    error: Mapping[int, torch.Tensor]
    p: Mapping[int, torch.Tensor]
    q: Mapping[int, torch.Tensor]
    rng_keys: torch.Tensor
    rng_pos: int
    rng_has_gauss: int
    rng_gauss: float
    numel_before: int
    numel_after: int
    next_stats_report: int
    layouts: Mapping[int, tuple[int, ...]]


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
        comm_hook: None, or a DDP communication hook (``DistributedDataParallel.register_comm_hook``)
            that reduces each gradient bucket instead of DDP's all-reduce: torch's
            ``default_hooks.fp16_compress_hook`` and ``bf16_compress_hook`` (the bucket
            all-reduced in 16 bits: each gradient within the documented bound of the
            uncompressed one, docs/10), ``powerSGD_hook.powerSGD_hook`` and
            ``batched_powerSGD_hook`` (low-rank compression from ``start_powerSGD_iter`` on,
            its state in ``transforms_state["comm_hook"]``, checkpointed), or your own
            ``hook(None, bucket) -> Future`` (its state, if any, is yours to keep).
        comm_state: the options of PowerSGD's ``PowerSGDState`` (``matrix_approximation_rank``,
            ``start_powerSGD_iter``, ``min_compression_rate``, ``use_error_feedback``,
            ``warm_start``, ``orthogonalization_epsilon``, ``random_seed``, ...), as a
            sorted tuple of pairs; only with a PowerSGD hook.

    References:
        Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression
        for Distributed Optimization", NeurIPS 2019. PyTorch, "DDP Communication Hooks"
        (torch.distributed.algorithms.ddp_comm_hooks).
    """

    phase: ClassVar[Phase] = Phase.MODEL
    kind: ClassVar[str] = "replicate"
    verb: ClassVar[str] = "replicate"
    couples_ranks: ClassVar[bool] = True

    bucket_cap_mb: float = attrs.field(default=25.0, validator=finite_positive)
    find_unused_parameters: bool = attrs.field(default=False, validator=boolean)
    static_graph: bool = attrs.field(default=False, validator=boolean)
    gradient_as_bucket_view: bool = attrs.field(default=False, validator=boolean)
    comm_hook: Callable[..., Any] | None = attrs.field(default=None, validator=_check_hook)
    comm_state: tuple[CommOption, ...] = attrs.field(default=(), converter=_comm_state)

    def __attrs_post_init__(self) -> None:
        if self.comm_state and self.comm_hook is None:
            raise ValueError(f"replicate(comm_state={dict(self.comm_state)!r}) configures a PowerSGD hook; give "
                             "comm_hook=torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook too")


def replicate(
    *,
    bucket_cap_mb: float = 25.0,
    find_unused_parameters: bool = False,
    static_graph: bool = False,
    gradient_as_bucket_view: bool = False,
    comm_hook: Callable[..., Any] | None = None,
    comm_state: Mapping[str, bool | int | float] | None = None,
) -> Replicate:
    """Data parallel over all processes; see :class:`Replicate` for the options (DDP's).

    Example:
        >>> import accelfn as af
        >>> from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
        >>> af.replicate(comm_hook=powersgd.powerSGD_hook, comm_state={"start_powerSGD_iter": 10}).comm_state
        (('start_powerSGD_iter', 10),)

    Raises:
        ValueError: ``bucket_cap_mb`` not > 0; ``comm_state`` without ``comm_hook``.
        TypeError: a flag that is not a bool; a ``comm_hook`` that is not callable; a
            ``comm_state`` that is not a mapping of names to numbers and bools.
    """
    return Replicate(bucket_cap_mb, find_unused_parameters, static_graph, gradient_as_bucket_view, comm_hook,
                     {} if comm_state is None else comm_state)
