"""``with_precision``: precision policies and the dynamic loss scale, pure values parsed once from a string.

The vocabulary follows jmp: a policy names the dtype parameters are stored in
(``param_dtype``) and the dtype the forward computes in (``compute_dtype``). A policy whose
compute dtype is narrower than its parameters runs the forward under ``torch.autocast``.
The ``"fp8"`` policy adds :class:`Float8`: which ``nn.Linear`` layers torchao's float8
training converts (their matmuls in float8, everything else as ``"bf16"``), with which recipe,
and whether sharded weights are all-gathered in float8.
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
    wrong_type,
    wrong_value,
)
from accelfn.step import Phase, TransformBase

PolicyName = Literal["fp32", "bf16", "fp16", "bf16-true", "fp8"]
POLICY_NAMES: tuple[str, ...] = ("fp32", "bf16", "fp16", "bf16-true", "fp8")
#: torchao's float8 training recipes (``Float8LinearConfig.from_recipe_name``) accelfn offers
FLOAT8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise")
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


def _module_names(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not hasattr(value, "__iter__"):
        raise wrong_type("with_precision", "exclude", "a tuple of module names (strings)", value)
    names = tuple(value)
    for name in names:
        if not isinstance(name, str) or not name:
            raise wrong_type("with_precision", "exclude", "module names (non-empty strings, as named_modules() gives)",
                             name)
    return names


def _recipe(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if value not in FLOAT8_RECIPES:
        raise ValueError(f"with_precision('fp8', recipe={value!r}): unknown recipe; accepted values are "
                         f"{', '.join(map(repr, FLOAT8_RECIPES))} (torchao's float8 training recipes)")


def _all_gather(instance: object, attribute: attrs.Attribute, value: bool) -> None:
    if not isinstance(value, bool):
        raise wrong_type("with_precision", "float8_all_gather", "True or False", value)


@attrs.frozen
class Float8:
    """What ``with_precision("fp8")`` does beyond bf16 autocast: torchao's float8 training.

    Attributes:
        recipe: ``"tensorwise"`` (one dynamic scale per tensor; the fastest, and the one whose
            sharded weights can be all-gathered in float8) or ``"rowwise"`` (a scale per row,
            more accurate), torchao's ``Float8LinearConfig.from_recipe_name``.
        all_gather: under ``shard_params``, cast each weight shard to float8 before FSDP2's
            all-gather (torchao's ``enable_fsdp_float8_all_gather``), with the scales of all
            weights computed in one all-reduce after each update
            (``precompute_float8_dynamic_scale_for_fsdp``). Tensorwise only.
        exclude: module names (``named_modules()``'s) kept in high precision, with everything
            under them: the output head, typically (a model's ``get_output_embeddings()``, as
            Hugging Face models have, is kept without being named).

    Raises:
        ValueError: an unknown recipe, or ``all_gather`` with the rowwise recipe.
        TypeError: ``exclude`` is not a collection of module names.
    """

    verb: ClassVar[str] = "with_precision"

    recipe: str = attrs.field(default="tensorwise", validator=_recipe)
    all_gather: bool = attrs.field(default=False, validator=_all_gather)
    exclude: tuple[str, ...] = attrs.field(default=(), converter=_module_names)

    def __attrs_post_init__(self) -> None:
        if self.all_gather and self.recipe != "tensorwise":
            raise ValueError(f"with_precision('fp8', recipe={self.recipe!r}, float8_all_gather=True): float8 "
                             "all-gathers need one scale per weight, the 'tensorwise' recipe (torchao's "
                             "enable_fsdp_float8_all_gather); use recipe='tensorwise' or float8_all_gather=False")


@attrs.frozen
class Policy:
    """A precision policy: storage and compute dtypes, and whether the loss is scaled.

    Build one with :func:`parse_policy`; the accepted names are ``POLICY_NAMES``.
    """

    name: str
    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    scaling: DynamicScaling | None = None
    float8: Float8 | None = None

    @property
    def autocast(self) -> bool:
        """True when the forward runs under ``torch.autocast(dtype=compute_dtype)``."""
        return self.compute_dtype != self.param_dtype

    @property
    def casts_inputs(self) -> bool:
        """True when floating-point inputs are cast to the (low) parameter dtype."""
        return self.param_dtype != torch.float32


def parse_policy(name: str, scaling: DynamicScaling | None = None, float8: Float8 | None = None) -> Policy:
    """Parses a policy name once into a :class:`Policy` record.

    Args:
        name: one of ``"fp32"``, ``"bf16"`` (autocast to bfloat16, fp32 parameters),
            ``"fp16"`` (autocast to float16, fp32 parameters, dynamic loss scaling) or
            ``"bf16-true"`` (parameters and compute in bfloat16, as Lightning's ``bf16-true``)
            or ``"fp8"`` (``"bf16"``, and the matmuls of the ``nn.Linear`` layers that suit it
            in float8 through torchao).
        scaling: loss-scale options; only meaningful for ``"fp16"``.
        float8: float8 options; only meaningful for ``"fp8"`` (default: ``Float8()``).

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: an unknown name, ``scaling`` given for a policy without loss scaling, or
            ``float8`` for a policy other than ``"fp8"``.
    """
    if not isinstance(name, str):
        raise TypeError(f"with_precision(policy=...) takes a string, got {type(name).__name__}")
    if name not in POLICY_NAMES:
        raise ValueError(
            f"with_precision(policy={name!r}): unknown policy; accepted values are "
            f"{', '.join(repr(p) for p in POLICY_NAMES)}"
        )
    if float8 is not None and name != "fp8":
        raise ValueError(f"with_precision({name!r}) converts no layer to float8; the float8 options (recipe, "
                         "float8_all_gather, exclude) apply to 'fp8' only")
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
    if name == "fp8":
        return Policy(name, torch.float32, torch.bfloat16, float8=float8 or Float8())
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
    recipe: str | None = None,
    float8_all_gather: bool | None = None,
    exclude: tuple[str, ...] | None = None,
) -> WithPrecision:
    """Mixed or low precision.

    Args:
        policy: ``"fp32"``; ``"bf16"`` (autocast to bfloat16, fp32 parameters and
            gradients); ``"fp16"`` (autocast to float16, fp32 parameters, dynamic loss
            scaling); ``"bf16-true"`` (parameters, gradients and compute in bfloat16);
            ``"fp8"`` (``"bf16"``, and each ``nn.Linear`` whose dimensions are multiples of
            16 converted to torchao's float8 training: its matmuls in float8 e4m3 with
            dynamic scales, fp32 master weights; needs the ``accelfn[fp8]`` extra).
        init_scale: fp16 only: first loss scale (default ``2**16``).
        growth_factor: fp16 only: scale multiplier after ``growth_interval`` finite updates (2.0).
        backoff_factor: fp16 only: scale multiplier after a non-finite update (0.5).
        growth_interval: fp16 only: finite updates in a row before growing (2000).
        max_consecutive_skips: fp16 only: skipped updates in a row that stop training (50).
        recipe: fp8 only: ``"tensorwise"`` (default) or ``"rowwise"`` scaling (torchao's recipes).
        float8_all_gather: fp8 only: under ``shard_params``, all-gather weights in float8 (False).
        exclude: fp8 only: module names kept in high precision (the output head, say).

    Returns:
        WithPrecision: the transform, its policy parsed into a record.

    Raises:
        ValueError: an unknown policy (the message lists the accepted ones), a loss-scale
            option for a policy without loss scaling, a float8 option for a policy other than
            ``"fp8"``, or an option out of range.
        TypeError: ``exclude`` is not a collection of module names.

    References:
        Micikevicius et al., "Mixed Precision Training", ICLR 2018 (loss scaling); the
        defaults are ``torch.amp.GradScaler``'s. Micikevicius et al., "FP8 Formats for Deep
        Learning", 2022 (e4m3); torchao's ``torchao.float8`` (conversion, recipes, float8
        all-gathers), as torchtitan's ``components/quantization/float8.py`` uses it.
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
    eight: dict[str, Any] = {"recipe": recipe, "all_gather": float8_all_gather, "exclude": exclude}
    eight = {k: v for k, v in eight.items() if v is not None}
    return WithPrecision(parse_policy(policy, scaling, Float8(**eight) if eight else None))
