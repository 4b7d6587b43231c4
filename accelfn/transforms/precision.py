"""``with_precision``: precision policies and the dynamic loss scale, pure values parsed once from a string.

The vocabulary follows jmp: a policy names the dtype parameters are stored in
(``param_dtype``) and the dtype the forward computes in (``compute_dtype``). A policy whose
compute dtype is narrower than its parameters runs the forward under ``torch.autocast``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import attrs
import torch

from accelfn.errors import (
    count_at_least_one,
    finite_positive,
    non_negative_int,
    wrong_value,
)
from accelfn.step import Phase, TransformBase

PolicyName = Literal["fp32", "bf16", "fp16", "bf16-true"]
POLICY_NAMES: tuple[str, ...] = ("fp32", "bf16", "fp16", "bf16-true")
_TINY = math.ulp(0.0)  # the smallest positive float

if TYPE_CHECKING:
    from accelfn.state import TrainState


@attrs.frozen
class DynamicScaling:
    """How the fp16 loss scale moves; the defaults are ``torch.amp.GradScaler``'s.

    Args:
        init_scale: the loss scale of the first update.
        growth_factor: multiplies the scale after ``growth_interval`` finite updates in a row.
        backoff_factor: multiplies the scale after an update with non-finite gradients.
        growth_interval: finite updates in a row before the scale grows (optimizer updates).
        min_scale: the floor; a scale that would fall below it stops training.
        max_consecutive_skips: non-finite updates in a row that stop training.

    Raises:
        ValueError: a factor or count out of range.
    """

    verb: ClassVar[str] = "with_precision"

    init_scale: float = attrs.field(default=2.0**16, validator=finite_positive)
    growth_factor: float = attrs.field(default=2.0, validator=finite_positive)
    backoff_factor: float = attrs.field(default=0.5, validator=finite_positive)
    growth_interval: int = attrs.field(default=2000, validator=count_at_least_one)
    min_scale: float = attrs.field(default=2.0**-14, validator=finite_positive)
    max_consecutive_skips: int = attrs.field(default=50, validator=count_at_least_one)

    def __attrs_post_init__(self) -> None:
        if self.growth_factor <= 1.0:
            raise wrong_value(self.verb, "growth_factor", "> 1", self.growth_factor)
        if self.backoff_factor >= 1.0:
            raise wrong_value(self.verb, "backoff_factor", "< 1", self.backoff_factor)


@attrs.frozen
class Policy:
    """A precision policy: storage and compute dtypes, and whether the loss is scaled.

    Build one with :func:`parse_policy`; the accepted names are ``POLICY_NAMES``.
    """

    name: str
    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    scaling: DynamicScaling | None = None

    @property
    def autocast(self) -> bool:
        """True when the forward runs under ``torch.autocast(dtype=compute_dtype)``."""
        return self.compute_dtype != self.param_dtype

    @property
    def casts_inputs(self) -> bool:
        """True when floating-point inputs are cast to the (low) parameter dtype."""
        return self.param_dtype != torch.float32


def parse_policy(name: str, scaling: DynamicScaling | None = None) -> Policy:
    """Parses a policy name once into a :class:`Policy` record.

    Args:
        name: one of ``"fp32"``, ``"bf16"`` (autocast to bfloat16, fp32 parameters),
            ``"fp16"`` (autocast to float16, fp32 parameters, dynamic loss scaling) or
            ``"bf16-true"`` (parameters and compute in bfloat16, as Lightning's ``bf16-true``).
        scaling: loss-scale options; only meaningful for ``"fp16"``.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: an unknown name, or ``scaling`` given for a policy without loss scaling.
    """
    if not isinstance(name, str):
        raise TypeError(f"with_precision(policy=...) takes a string, got {type(name).__name__}")
    if name not in POLICY_NAMES:
        raise ValueError(
            f"with_precision(policy={name!r}): unknown policy; accepted values are "
            f"{', '.join(repr(p) for p in POLICY_NAMES)}"
        )
    if name == "fp16":
        return Policy(name, torch.float32, torch.float16, scaling or DynamicScaling())
    if scaling is not None:
        raise ValueError(
            f"with_precision({name!r}) does not scale the loss; loss-scale options (init_scale, "
            "growth_factor, backoff_factor, growth_interval, max_consecutive_skips) apply to "
            "'fp16' only (use skip_nonfinite() to skip non-finite updates in other precisions)"
        )
    if name == "bf16":
        return Policy(name, torch.float32, torch.bfloat16)
    if name == "bf16-true":
        return Policy(name, torch.bfloat16, torch.bfloat16)
    return Policy(name, torch.float32, torch.float32)


@attrs.frozen
class LossScale:
    """The dynamic loss scale of fp16 training: an immutable value in ``transforms_state``.

    Update rule, applied once per optimizer update (``adjust``), as in jmp's
    ``DynamicLossScale`` and ``torch.amp.GradScaler``::

        if grads_finite:
            growth_tracker += 1
            if growth_tracker == growth_interval:
                if isfinite(scale * growth_factor):  # GradScaler never grows the scale to inf
                    scale *= growth_factor
                growth_tracker = 0
        else:
            scale = max(scale * backoff_factor, smallest positive float)
            growth_tracker = 0

    Attributes:
        scale: the loss scale, a finite number > 0.
        growth_tracker: finite updates in a row since the scale last changed, an int >= 0.

    Raises:
        TypeError, ValueError: a field of the wrong type or out of range (a checkpoint
            edited by hand is refused this way, naming the field).

    References:
        Micikevicius et al., "Mixed Precision Training", ICLR 2018, section 3.2.
    """

    scale: float = attrs.field(validator=finite_positive)
    growth_tracker: int = attrs.field(default=0, validator=non_negative_int)

    def adjust(self, grads_finite: bool, scaling: DynamicScaling) -> LossScale:
        """Returns the scale for the next update given whether this one's gradients were finite.

        A scale that backs off below ``scaling.min_scale`` is returned as it is (the step
        function then stops training); one that would underflow to 0 stays at the smallest
        positive float, and one that would grow to inf does not grow.
        """
        if not grads_finite:
            return LossScale(max(self.scale * scaling.backoff_factor, _TINY), 0)
        tracker = self.growth_tracker + 1
        if tracker == scaling.growth_interval:
            grown = self.scale * scaling.growth_factor
            return LossScale(grown if grown != math.inf else self.scale, 0)
        return LossScale(self.scale, tracker)


@attrs.frozen
class SkipCount:
    """Bookkeeping of updates skipped for non-finite gradients (fp16 or ``skip_nonfinite``).

    Attributes:
        num_skipped: updates skipped since the start of training, an int >= 0.
        consecutive: the last updates in a row that were skipped, at most ``num_skipped``.

    Raises:
        TypeError, ValueError: a count of the wrong type, negative, or ``consecutive``
            above ``num_skipped``.
    """

    num_skipped: int = attrs.field(default=0, validator=non_negative_int)
    consecutive: int = attrs.field(default=0, validator=non_negative_int)

    def __attrs_post_init__(self) -> None:
        if self.consecutive > self.num_skipped:
            raise ValueError(f"consecutive ({self.consecutive}) must be <= num_skipped ({self.num_skipped}): "
                             "the updates skipped in a row are among those skipped in all")

    def record(self, grads_finite: bool) -> SkipCount:
        """Returns the count after one more update, finite or skipped."""
        if grads_finite:
            return SkipCount(self.num_skipped, 0)
        return SkipCount(self.num_skipped + 1, self.consecutive + 1)


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

    def conflicts_with(self, other: TransformBase) -> str | None:
        if other.kind == "skip_nonfinite" and self.policy.scaling is not None:
            return (
                "with_precision('fp16') already skips updates with non-finite gradients; "
                "remove skip_nonfinite()"
            )
        return None


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
    options: dict[str, Any] = {
        "init_scale": init_scale,
        "growth_factor": growth_factor,
        "backoff_factor": backoff_factor,
        "growth_interval": growth_interval,
        "max_consecutive_skips": max_consecutive_skips,
    }
    given = {k: v for k, v in options.items() if v is not None}
    scaling = DynamicScaling(**given) if given else None
    return WithPrecision(parse_policy(policy, scaling))
