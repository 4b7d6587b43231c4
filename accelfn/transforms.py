"""Transforms: small frozen values that are also functions ``Step -> Step``.

Each transform acts at a fixed phase of the step, so the order in which they are composed
never changes the meaning of the program; ``Step.transforms`` lists them in phase order::

    data      shard_data      each process reads its own shard of every epoch
    model     replicate       data parallel: one gradient all-reduce per update
    forward   with_precision  autocast / low-precision parameters, loss scaling
    backward  accumulate      n micro-batches per optimizer update
    gradient  clip, clip_value  after unscaling and after the all-reduce
    update    skip_nonfinite  skip updates whose gradients are not finite

Transforms never import ``torch.distributed``, ``torch_xla`` or ``accelfn.backends``: the
backend interprets them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, Union

import attrs
import toolz

from accelfn._errors import TransformError
from accelfn._precision import DynamicScaling, LossScale, Policy, SkipCount, parse_policy
from accelfn._transform_base import (
    Phase,
    boolean,
    count_at_least_one,
    finite_positive,
    non_negative_int,
    TransformBase,
)

if TYPE_CHECKING:
    from accelfn.state import TrainState
    from accelfn.step import Step


@attrs.frozen
class ShardData(TransformBase):
    """Each process reads its own shard of every epoch (``torch.utils.data.DistributedSampler``).

    Attributes:
        seed: base of the shuffle; epoch ``e`` uses ``seed + e`` on every rank.
        drop_last: drop the tail that does not divide evenly by the world size instead of
            padding it by wrapping around.
        even_batches: pad (by wrapping) so every rank runs the same number of batches.
            ``False`` keeps each sample exactly once, so ranks may differ by one batch; it
            cannot be combined with ``replicate()``, whose all-reduce would wait forever.
    """

    phase: ClassVar[Phase] = Phase.DATA
    kind: ClassVar[str] = "shard_data"
    verb: ClassVar[str] = "shard_data"

    seed: int = attrs.field(default=0, validator=non_negative_int)
    drop_last: bool = attrs.field(default=False, validator=boolean)
    even_batches: bool = attrs.field(default=True, validator=boolean)

    def conflicts_with(self, other: Transform) -> str | None:
        if isinstance(other, Replicate) and not self.even_batches and not self.drop_last:
            return (
                "shard_data(even_batches=False) lets ranks run different numbers of batches, "
                "so replicate()'s gradient all-reduce would hang; keep even_batches=True "
                "(pad by wrapping) or use drop_last=True"
            )
        return None


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

    bucket_cap_mb: float = attrs.field(default=25.0)
    find_unused_parameters: bool = attrs.field(default=False, validator=boolean)
    static_graph: bool = attrs.field(default=False, validator=boolean)
    gradient_as_bucket_view: bool = attrs.field(default=False, validator=boolean)

    @bucket_cap_mb.validator
    def _check_bucket(self, attribute: attrs.Attribute, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"replicate(bucket_cap_mb=...) must be a number > 0, got {value!r}")


@attrs.frozen
class WithPrecision(TransformBase):
    """Mixed or low precision: autocast, low-precision parameters, dynamic loss scaling.

    Attributes:
        policy: the parsed policy (see :func:`with_precision`).
    """

    phase: ClassVar[Phase] = Phase.FORWARD
    kind: ClassVar[str] = "with_precision"
    verb: ClassVar[str] = "with_precision"

    policy: Policy

    def init(self, state: TrainState) -> TrainState:
        scaling = self.policy.scaling
        if scaling is None or "loss_scale" in state.transforms_state:
            return state
        return state.with_transform_state(
            loss_scale=LossScale(scaling.init_scale), skips=state.transforms_state.get("skips", SkipCount())
        )

    def conflicts_with(self, other: Transform) -> str | None:
        if isinstance(other, SkipNonfinite) and self.policy.scaling is not None:
            return (
                "with_precision('fp16') already skips updates with non-finite gradients; "
                "remove skip_nonfinite()"
            )
        return None


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


@attrs.frozen
class Clip(TransformBase):
    """Clip the global gradient norm over all parameter groups to ``max_norm``.

    ``torch.nn.utils.clip_grad_norm_`` on unscaled, all-reduced gradients, once per update;
    the norm before clipping is reported as the ``grad_norm`` metric.

    References:
        Pascanu, Mikolov, Bengio, "On the difficulty of training recurrent neural
        networks", ICML 2013.
    """

    phase: ClassVar[Phase] = Phase.GRADIENT
    kind: ClassVar[str] = "clip"
    verb: ClassVar[str] = "clip"

    max_norm: float = attrs.field(converter=float, validator=finite_positive)
    norm_type: float = attrs.field(default=2.0, converter=float)

    @norm_type.validator
    def _check_norm_type(self, attribute: attrs.Attribute, value: float) -> None:
        if not value > 0:
            raise ValueError(f"clip(norm_type={value!r}): must be a number > 0, or math.inf for the max-norm")


@attrs.frozen
class ClipValue(TransformBase):
    """Clamp every gradient element to ``[-max_value, max_value]`` (``clip_grad_value_``)."""

    phase: ClassVar[Phase] = Phase.GRADIENT
    kind: ClassVar[str] = "clip"
    verb: ClassVar[str] = "clip_value"

    max_value: float = attrs.field(converter=float, validator=finite_positive)


@attrs.frozen
class SkipNonfinite(TransformBase):
    """Skip optimizer updates whose gradients hold inf or NaN (optax's ``apply_if_finite``).

    A skipped update leaves parameters, optimizer state, scheduler and ``state.step``
    unchanged and is counted in ``transforms_state["skips"]``; after
    ``max_consecutive_skips`` skips in a row training stops with ``af.NonFiniteError``.
    Checking costs one device-to-host transfer per update.
    """

    phase: ClassVar[Phase] = Phase.UPDATE
    kind: ClassVar[str] = "skip_nonfinite"
    verb: ClassVar[str] = "skip_nonfinite"

    max_consecutive_skips: int = attrs.field(default=50, validator=count_at_least_one)

    def init(self, state: TrainState) -> TrainState:
        if "skips" in state.transforms_state:
            return state
        return state.with_transform_state(skips=SkipCount())


def _require_number(fn: str, name: str, value: object) -> None:
    """TypeError before float() conversion turns a string or a bool into a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{fn}({name}=...) must be a number, got {value!r}")


Transform = Union[ShardData, Replicate, WithPrecision, Accumulate, Clip, ClipValue, SkipNonfinite]
TRANSFORM_TYPES: tuple[type, ...] = (
    ShardData, Replicate, WithPrecision, Accumulate, Clip, ClipValue, SkipNonfinite,
)


def shard_data(*, seed: int = 0, drop_last: bool = False, even_batches: bool = True) -> ShardData:
    """Each process reads its own shard of every epoch; see :class:`ShardData`.

    Args:
        seed: base of the shuffle, agreed by all ranks; epoch ``e`` shuffles with ``seed + e``.
        drop_last: drop the tail that does not divide by the world size (default: pad it).
        even_batches: pad so that every rank runs the same number of batches (default True).

    Returns:
        ShardData: the transform.

    Raises:
        ValueError: ``seed`` negative.
        TypeError: a flag that is not a bool, or ``seed`` not an int.

    Example:
        >>> import accelfn as af
        >>> af.shard_data(seed=1)
        ShardData(seed=1, drop_last=False, even_batches=True)
    """
    return ShardData(seed=seed, drop_last=drop_last, even_batches=even_batches)


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


def with_precision(
    policy: str,
    *,
    init_scale: float | None = None,
    growth_factor: float | None = None,
    backoff_factor: float | None = None,
    growth_interval: int | None = None,
    max_consecutive_skips: int | None = None,
) -> WithPrecision:
    """Mixed or low precision.

    Args:
        policy: ``"fp32"``; ``"bf16"`` (autocast to bfloat16, fp32 parameters and
            gradients); ``"fp16"`` (autocast to float16, fp32 parameters, dynamic loss
            scaling); ``"bf16-true"`` (parameters, gradients and compute in bfloat16).
        init_scale: fp16 only: first loss scale (default ``2**16``).
        growth_factor: fp16 only: scale multiplier after ``growth_interval`` finite updates (2.0).
        backoff_factor: fp16 only: scale multiplier after a non-finite update (0.5).
        growth_interval: fp16 only: finite updates in a row before growing (2000).
        max_consecutive_skips: fp16 only: skipped updates in a row that stop training (50).

    Returns:
        WithPrecision: the transform, its policy parsed into a record.

    Raises:
        ValueError: an unknown policy (the message lists the accepted ones), a loss-scale
            option for a policy without loss scaling, or an option out of range.

    References:
        Micikevicius et al., "Mixed Precision Training", ICLR 2018 (loss scaling); the
        defaults are ``torch.amp.GradScaler``'s.
    """
    options = {
        "init_scale": init_scale,
        "growth_factor": growth_factor,
        "backoff_factor": backoff_factor,
        "growth_interval": growth_interval,
        "max_consecutive_skips": max_consecutive_skips,
    }
    given = {k: v for k, v in options.items() if v is not None}
    scaling = DynamicScaling(**given) if given else None
    return WithPrecision(parse_policy(policy, scaling))


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


def clip(max_norm: float, *, norm_type: float = 2.0) -> Clip:
    """Clip the global gradient norm (over all parameter groups) to ``max_norm``.

    Args:
        max_norm: the largest allowed total norm, a finite number > 0.
        norm_type: the p of the p-norm (2.0), or ``math.inf`` for the max-norm.

    Raises:
        TypeError: not a number.
        ValueError: ``max_norm`` negative, zero, inf or NaN; ``norm_type`` not > 0.
    """
    _require_number("clip", "max_norm", max_norm)
    _require_number("clip", "norm_type", norm_type)
    return Clip(max_norm, norm_type)


def clip_value(max_value: float) -> ClipValue:
    """Clamp every gradient element to ``[-max_value, max_value]``.

    Args:
        max_value: a finite number > 0.

    Raises:
        TypeError: not a number.
        ValueError: negative, zero, inf or NaN.
    """
    _require_number("clip_value", "max_value", max_value)
    return ClipValue(max_value)


def skip_nonfinite(*, max_consecutive_skips: int = 50) -> SkipNonfinite:
    """Skip updates whose gradients are not finite, in any precision (optax's ``apply_if_finite``).

    Args:
        max_consecutive_skips: skipped updates in a row after which training stops with
            ``af.NonFiniteError``.

    Raises:
        ValueError: ``max_consecutive_skips`` < 1.
    """
    return SkipNonfinite(max_consecutive_skips)


def compose(*transforms: Transform) -> Callable[[Step], Step]:
    """Composes transforms into one ``Step -> Step`` function (``toolz.compose``).

    The order of the arguments does not matter: every transform acts at its own phase.

    Raises:
        TypeError: an argument that is not a transform (a common slip: ``af.clip`` instead
            of ``af.clip(1.0)``).

    Example:
        >>> import accelfn as af
        >>> step = af.compose(af.accumulate(2), af.clip(1.0))(af.train_step(lambda m, b: m(b).sum()))
        >>> [type(t).__name__ for t in step.transforms]
        ['Accumulate', 'Clip']
    """
    for t in transforms:
        if not isinstance(t, TRANSFORM_TYPES):
            verb = getattr(t, "__name__", None)
            hint = f" (call it: af.{verb}(...), not af.{verb})" if verb in _VERB_NAMES else ""
            raise TypeError(f"compose() takes transforms such as af.clip(1.0), got {t!r}{hint}")
    return toolz.compose(*transforms)



_VERB_NAMES = frozenset(t.verb for t in TRANSFORM_TYPES)


def check_composition(existing: tuple[Transform, ...], new: Transform) -> None:
    """Raises TransformError if ``new`` repeats a kind in ``existing`` or conflicts with one."""
    for t in existing:
        if t.kind == new.kind:
            raise TransformError(
                f"{new!r} cannot be applied to a step that already has {t!r}: "
                f"one {new.kind} transform per step; remove one of them"
            )
        reason = t.conflicts_with(new) or new.conflicts_with(t)
        if reason:
            raise TransformError(f"{new!r} conflicts with {t!r}: {reason}")
