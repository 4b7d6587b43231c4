"""The closed registry of records a checkpoint may hold, under stable short tags.

A record in a state tree (the loss scale, the skip count, the accumulation window, a
rank's RNG states) is written as ``{"__record__": TAG, "fields": {...}}``. The tag names
the record, never the module that defines it, so moving code breaks no checkpoint on disk:
renaming a tag or reusing one for another record is a format change. Checkpoints of format
version 2 named records by module path; ``LEGACY_NAMES`` maps those paths to today's tags,
so they still load.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from accelfn.checkpoint._rng import RngState
from accelfn.transforms import LossScale, SkipCount, Window

#: tag -> record class; the only records a checkpoint can hold
RECORDS: Mapping[str, type] = MappingProxyType({
    "loss_scale": LossScale,
    "skip_count": SkipCount,
    "accumulation_window": Window,
    "rng_state": RngState,
})
TAGS: Mapping[type, str] = MappingProxyType({cls: tag for tag, cls in RECORDS.items()})
#: the module paths format 2 wrote -> tag
LEGACY_NAMES: Mapping[str, str] = MappingProxyType({
    "accelfn._precision.LossScale": "loss_scale",
    "accelfn._precision.SkipCount": "skip_count",
    "accelfn.backends._interpreter.Window": "accumulation_window",
    "accelfn._rng.RngState": "rng_state",
})


def record_class(name: str) -> type | None:
    """The record class written as ``name`` (a tag, or a format-2 module path), or None."""
    return RECORDS.get(LEGACY_NAMES.get(name, name))
