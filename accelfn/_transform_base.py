"""What every transform shares: its phase, ``Step -> Step`` application, and validators."""

from __future__ import annotations

import enum
import math
from typing import TYPE_CHECKING, ClassVar

import attrs

if TYPE_CHECKING:
    from accelfn.state import TrainState
    from accelfn.step import Step


class Phase(enum.IntEnum):
    """Where in the step a transform acts; ``Step.transforms`` is sorted by it."""

    DATA = 0
    MODEL = 1
    FORWARD = 2
    BACKWARD = 3
    GRADIENT = 4
    UPDATE = 5


class TransformBase:
    """Shared behaviour: a transform applied to a Step returns a new Step that holds it."""

    phase: ClassVar[Phase]
    # Transforms of the same kind cannot be applied twice (clip and clip_value share one).
    kind: ClassVar[str]
    # The lowercase constructor users call, for error messages.
    verb: ClassVar[str]

    def __call__(self, step: Step) -> Step:
        from accelfn.step import Step  # step.py imports this module for the Transform union

        if not isinstance(step, Step):
            raise TypeError(
                f"{self!r} transforms a Step, got {type(step).__name__}; "
                "build one with af.train_step(loss_fn)"
            )
        return step.with_transform(self)  # type: ignore[arg-type]

    def init(self, state: TrainState) -> TrainState:
        """Adds this transform's entry to ``state.transforms_state``, keeping one already there."""
        return state

    def conflicts_with(self, other: TransformBase) -> str | None:
        """Why ``self`` and ``other`` cannot be composed, or None."""
        return None


def non_negative_int(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{attribute.name} must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value!r}")


def boolean(instance: object, attribute: attrs.Attribute, value: bool) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{attribute.name} must be True or False, got {value!r}")


def _verb(instance: object) -> str:
    return getattr(type(instance), "verb", type(instance).__name__)


def finite_positive(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{_verb(instance)}({attribute.name}=...) must be a number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{_verb(instance)}({attribute.name}={value!r}): must be a finite number > 0")


def count_at_least_one(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{_verb(instance)}({attribute.name}=...) must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{_verb(instance)}({attribute.name}={value!r}): must be >= 1")
