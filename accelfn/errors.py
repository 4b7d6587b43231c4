"""The exceptions accelfn raises beyond Python's own ValueError and TypeError, and the one
vocabulary of argument checks (attrs validators, and the checks of path arguments when they
are given rather than at their first write) whose messages name the call and the rule."""

from __future__ import annotations

import math
import os
from pathlib import Path

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
    if not existing.is_dir():
        raise ValueError(f"{what}: {path} cannot be created, since {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"{what}: {path} cannot be written, since {existing} is not writable by this process")
