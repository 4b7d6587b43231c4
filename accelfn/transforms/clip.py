"""``clip`` and ``clip_value``: gradient clipping, once per update, after unscaling."""

from __future__ import annotations

from typing import ClassVar

import attrs

from accelfn.errors import finite_positive, require_number
from accelfn.step import Phase, TransformBase


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


def clip(max_norm: float, *, norm_type: float = 2.0) -> Clip:
    """Clip the global gradient norm (over all parameter groups) to ``max_norm``.

    Args:
        max_norm: the largest allowed total norm, a finite number > 0.
        norm_type: the p of the p-norm (2.0), or ``math.inf`` for the max-norm.

    Raises:
        TypeError: not a number.
        ValueError: ``max_norm`` negative, zero, inf or NaN; ``norm_type`` not > 0.
    """
    require_number("clip", "max_norm", max_norm)
    require_number("clip", "norm_type", norm_type)
    return Clip(max_norm, norm_type)


def clip_value(max_value: float) -> ClipValue:
    """Clamp every gradient element to ``[-max_value, max_value]``.

    Args:
        max_value: a finite number > 0.

    Raises:
        TypeError: not a number.
        ValueError: negative, zero, inf or NaN.
    """
    require_number("clip_value", "max_value", max_value)
    return ClipValue(max_value)
