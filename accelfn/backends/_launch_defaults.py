"""The transforms ``accelfn launch`` adds to a program: ``--precision``, ``--accumulate``, ``--compile``."""

from __future__ import annotations

import warnings

from accelfn.backends.env import LaunchEnv
from accelfn.step import Step
from accelfn.transforms import (
    Accumulate,
    Compile,
    WithPrecision,
    accumulate,
    with_precision,
)
from accelfn.transforms import compile as compile_transform


def with_launch_defaults(step: Step, env: LaunchEnv, *, warn: bool) -> Step:
    """``step`` with the transforms ``accelfn launch --precision/--accumulate/--compile``
    asked for, added where the script set none of that kind. A script's own transform
    wins, with a warning (when ``warn``: the main process, once per job) where it differs
    from the launch's."""
    if env.precision is not None:
        present = step.find(WithPrecision)
        if present is None:
            step = with_precision(env.precision)(step)
        elif present.policy.name != env.precision and warn:
            origin = env.precision_from
            asked = (f"accelfn launch --precision {env.precision}" if origin == "--precision"
                     else f"ACCELFN_PRECISION={env.precision}" if origin is None
                     else f"precision: {env.precision} in the launch config {origin}")
            _overridden(asked, f"with_precision({present.policy.name!r})")
    if env.accumulate is not None:
        window = step.find(Accumulate)
        if window is None:
            step = accumulate(env.accumulate)(step)
        elif window.num_micro_batches != env.accumulate and warn:
            _overridden(f"accelfn launch --accumulate {env.accumulate}", f"accumulate({window.num_micro_batches})")
    if env.compile and step.find(Compile) is None:  # the script's own compile(...) refines it
        step = compile_transform()(step)
    return step


def _overridden(asked: str, script: str) -> None:
    # _overridden <- with_launch_defaults <- Backend.prepare <- its caller (run, or the script)
    warnings.warn(f"{asked} is overridden by the script's {script}", stacklevel=4)
