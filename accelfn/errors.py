"""The exceptions accelfn raises beyond Python's own ValueError and TypeError, and the one
vocabulary of argument checks (attrs validators) whose messages name the call and the rule."""

from __future__ import annotations

import math

import attrs


class TransformError(ValueError):
    """A transform cannot be applied to this Step: same kind twice, or two that conflict."""


class NonFiniteError(RuntimeError):
    """Training cannot go on: too many consecutive non-finite updates were skipped."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupted, or does not match the state it is loaded into."""


class LaunchError(RuntimeError):
    """The launch environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) is missing or inconsistent."""


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


def require_number(fn: str, name: str, value: object) -> None:
    """TypeError before float() conversion turns a string or a bool into a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{fn}({name}=...) must be a number, got {value!r}")
