"""The exceptions accelfn raises beyond Python's own ValueError and TypeError."""

from __future__ import annotations


class TransformError(ValueError):
    """A transform cannot be applied to this Step: same kind twice, or two that conflict."""


class NonFiniteError(RuntimeError):
    """Training cannot go on: too many consecutive non-finite updates were skipped."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupted, or does not match the state it is loaded into."""


class LaunchError(RuntimeError):
    """The launch environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) is missing or inconsistent."""
