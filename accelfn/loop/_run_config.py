"""The run configuration handed to trackers: the user's hyperparameters and what accelfn knows."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch

from accelfn._version import __version__
from accelfn.backends.base import Backend
from accelfn.step import Step
from accelfn.transforms import WithPrecision


def check_config(config: Any) -> None:
    """Raises TypeError/ValueError for a ``run(config=...)`` that is not a mapping or uses ``"accelfn"``."""
    if config is None:
        return
    if not isinstance(config, Mapping):
        raise TypeError(f"run(config=...) takes a mapping of hyperparameters, e.g. config={{'lr': 3e-4}}, "
                        f"got {type(config).__name__}")
    if "accelfn" in config:
        raise ValueError("run(config=...) has a key 'accelfn', which is where run puts what it knows (transforms, "
                         "world size, ...); rename that key")


def _options(record: Any) -> Any:
    """A record's fields as plain values (nested records as mappings, dtypes as strings)."""
    if attrs.has(type(record)):
        return {f.name: _options(getattr(record, f.name)) for f in attrs.fields(type(record))}
    if record is None or isinstance(record, (bool, int, float, str)):
        return record
    return str(record)


def run_config(config: Mapping[str, Any] | None, step: Step, backend: Backend, data: Iterable[Any]) -> dict[str, Any]:
    """``config`` plus ``"accelfn"``: versions, backend, world size, precision, per-process
    batch size (the DataLoader's, else None) and each transform's options by its verb."""
    precision = step.find(WithPrecision)
    return {
        **(config or {}),
        "accelfn": {
            "version": __version__,
            "torch_version": torch.__version__,
            "backend": backend.name,
            "world_size": backend.world_size,
            "precision": precision.policy.name if precision is not None else "fp32",
            "batch_size": getattr(data, "batch_size", None),
            "transforms": {t.verb: _options(t) for t in step.transforms},
        },
    }
