"""``skip_nonfinite``: skip updates whose gradients are not finite, and the skip counter."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import attrs

from accelfn.errors import count_at_least_one
from accelfn.step import Phase, TransformBase
from accelfn.transforms.precision import SkipCount

if TYPE_CHECKING:
    from accelfn.state import TrainState


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


def skip_nonfinite(*, max_consecutive_skips: int = 50) -> SkipNonfinite:
    """Skip updates whose gradients are not finite, in any precision (optax's ``apply_if_finite``).

    Args:
        max_consecutive_skips: skipped updates in a row after which training stops with
            ``af.NonFiniteError``.

    Raises:
        ValueError: ``max_consecutive_skips`` < 1.
    """
    return SkipNonfinite(max_consecutive_skips)
