"""The exceptions accelfn raises beyond Python's own ValueError and TypeError, and the one
vocabulary of argument checks (attrs validators, and the checks of path arguments when they
are given rather than at their first write) whose messages name the call and the rule."""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import attrs


class TransformError(ValueError):
    """A transform cannot be applied to this Step: same kind twice, or two that conflict."""


class NonFiniteError(RuntimeError):
    """Training cannot go on: too many consecutive non-finite updates were skipped."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupted, or does not match the state it is loaded into."""


class PlanError(ValueError):
    """The plan of a run has errors (``af.plan``'s problems): each named with what is wrong and
    its fix. ``problems`` holds them; ``run(..., plan=False)`` skips the check."""

    def __init__(self, problems: tuple[object, ...]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"the plan of this run has {len(problems)} error{'s' if len(problems) != 1 else ''}, "
                         f"found before the first forward (run(..., plan=False) skips the check):\n{lines}")


class PlanWarning(RuntimeWarning):
    """A warning of a run's plan (``af.plan``'s problems that are not errors), issued by ``run``
    before the first forward; filter it like any warning (``warnings.simplefilter``)."""


class LaunchError(RuntimeError):
    """The launch environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) is missing or inconsistent."""


# The argument checks. Every message has one of two forms, naming the call a user wrote
# (a record's ``verb`` class attribute, such as ``with_precision``, or its class name):
#   TypeError:  with_precision(growth_interval=...) must be an int, got 2.5
#   ValueError: with_precision(growth_interval=0): must be >= 1


def call_name(instance: object) -> str:
    """The call that builds ``instance``, for messages: its ``verb`` class attribute
    (``"shard_data"``), or its class name."""
    return getattr(type(instance), "verb", type(instance).__name__)


def wrong_type(call: str, name: str, expected: str, value: object) -> TypeError:
    """``call(name=...) must be EXPECTED, got VALUE``."""
    return TypeError(f"{call}({name}=...) must be {expected}, got {value!r}")


def wrong_value(call: str, name: str, rule: str, value: object) -> ValueError:
    """``call(name=VALUE): must be RULE``."""
    return ValueError(f"{call}({name}={value!r}): must be {rule}")


def check_int(call: str, name: str, value: object, *, minimum: int) -> None:
    """An int (not a bool) >= ``minimum``.

    Raises:
        TypeError: not an int.
        ValueError: below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong_type(call, name, "an int", value)
    if value < minimum:
        raise wrong_value(call, name, f">= {minimum}", value)


def check_finite_positive(call: str, name: str, value: object) -> None:
    """A finite int or float (not a bool) > 0.

    Raises:
        TypeError: not a number.
        ValueError: zero, negative, inf or NaN.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise wrong_type(call, name, "a number", value)
    if not (math.isfinite(value) and value > 0):
        raise wrong_value(call, name, "a finite number > 0", value)


def require_number(call: str, name: str, value: object) -> None:
    """A number (TypeError before ``float()`` turns a string or a bool into one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise wrong_type(call, name, "a number", value)


def non_negative_int(instance: object, attribute: attrs.Attribute, value: int) -> None:
    """attrs validator: an int >= 0 (a count)."""
    check_int(call_name(instance), attribute.name, value, minimum=0)


def count_at_least_one(instance: object, attribute: attrs.Attribute, value: int) -> None:
    """attrs validator: an int >= 1."""
    check_int(call_name(instance), attribute.name, value, minimum=1)


def finite_positive(instance: object, attribute: attrs.Attribute, value: float) -> None:
    """attrs validator: a finite number > 0."""
    check_finite_positive(call_name(instance), attribute.name, value)


def boolean(instance: object, attribute: attrs.Attribute, value: bool) -> None:
    """attrs validator: True or False."""
    if not isinstance(value, bool):
        raise wrong_type(call_name(instance), attribute.name, "True or False", value)


def to_path(call: str, name: str, value: object) -> Path:
    """``value`` as a Path.

    Raises:
        TypeError: not a str or os.PathLike (``call(name=...) must be a path (str or os.PathLike), got 3``).
    """
    if not isinstance(value, (str, os.PathLike)):
        raise wrong_type(call, name, "a path (str or os.PathLike)", value)
    return Path(value)


def check_directory(path: Path, what: str) -> None:
    """Raises unless ``path`` is a directory this process can write in, or can be created as one.

    Args:
        path: the directory (it may not exist yet).
        what: the argument, as the message names it, e.g. ``"Checkpoints(directory='runs/ckpt')"``.

    Raises:
        ValueError: ``path``, or the nearest of its parents that exists, is not a directory.
        PermissionError: that directory is not writable by this process.
    """
    existing = _nearest_existing(path)
    if existing == path and not path.is_dir():
        raise ValueError(f"{what}: {path} is a file, not a directory; give a directory (it is created if missing)")
    _check_parent(existing, path, what)


def check_file(path: Path, what: str) -> None:
    """Raises unless ``path`` is a file this process can append to, or can be created as one.

    Raises:
        ValueError: ``path`` is a directory, or the nearest of its parents that exists is not one.
        PermissionError: ``path`` or that parent is not writable by this process.
    """
    if path.is_dir():
        raise ValueError(f"{what}: {path} is a directory; give a file path, e.g. {str(path / 'metrics.jsonl')!r}")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{what}: {path} is not writable by this process")
        return
    _check_parent(_nearest_existing(path.parent), path, what)


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest parent that exists (the current directory for a relative path)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(".")


def _check_parent(existing: Path, path: Path, what: str) -> None:
    """Raises unless a file can be made in the directory ``existing``: it is tried (an empty
    file made and removed), since permission bits do not tell for root, nor for read-only
    or virtual file systems (``/sys``, ``/proc``)."""
    if not existing.is_dir():
        raise ValueError(f"{what}: {path} cannot be created, since {existing} is a file, not a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".accelfn-write-check-")
    except OSError as e:
        raise PermissionError(f"{what}: {path} cannot be written, since {existing} refuses new files "
                              f"({e.strerror}); give a directory this process can write in") from None
    os.close(fd)
    os.unlink(probe)
