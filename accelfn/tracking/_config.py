"""The run configuration as trackers take it: plain values, nested or flattened with dots."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping
from typing import Any

_SCALARS = (bool, int, float, str)


def require(module: str, tracker: str, extra: str) -> None:
    """Raises ImportError naming the extra that installs ``module`` when it is missing."""
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"af.{tracker} needs the {module!r} package: pip install \"accelfn[{extra}]\"")


def plain(value: Any) -> Any:
    """``value`` as JSON-like data: mappings (str keys) and lists of numbers, strings, bools
    and None; anything else becomes its ``str``. Non-finite floats stay floats."""
    if value is None or isinstance(value, _SCALARS):
        return value
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # a 0-d tensor or numpy scalar
        return plain(value.item())
    return str(value)


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, bool | int | float | str]:
    """One level: nested mappings joined with dots (``{"a": {"b": 1}}`` -> ``{"a.b": 1}``);
    lists and None become their ``str``, as parameter stores (MLflow, TensorBoard hparams)
    hold only scalars."""
    flat: dict[str, bool | int | float | str] = {}
    for key, value in plain(config).items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        elif isinstance(value, _SCALARS) and not (isinstance(value, float) and not math.isfinite(value)):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat
