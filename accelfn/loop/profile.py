"""``Profile``: a ``torch.profiler`` trace of a window of a run's optimizer updates."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from accelfn.backends.base import Backend
from accelfn.errors import check_directory, check_int, to_path, wrong_type


def _count(minimum: int) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong_type("Profile", attribute.name, "an int (optimizer updates)", value)
        check_int("Profile", attribute.name, value, minimum=minimum)

    return check


def _directory(instance: Any, attribute: attrs.Attribute, value: Path) -> None:
    check_directory(value, f"Profile(dir={str(value)!r})")


@attrs.frozen
class Profile:
    """Records a ``torch.profiler`` trace over a window of optimizer updates of ``run``.

    Counting the updates of this ``run`` call: the first ``skip_first`` are not profiled,
    then ``repeat`` cycles of ``wait`` idle updates, ``warmup`` updates traced but discarded
    (the profiler's own start-up) and ``active`` updates recorded (``torch.profiler.schedule``).
    Each cycle writes one Chrome trace, ``dir/rank{r}.<timestamp>.pt.trace.json``
    (``torch.profiler.tensorboard_trace_handler``), which opens in Perfetto
    (ui.perfetto.dev), ``chrome://tracing`` and TensorBoard's profile plugin
    (``pip install torch-tb-profiler``; ``tensorboard --logdir dir``). Update ``k`` of the
    call (from 0) is the trace's ``ProfilerStep#k``. CPU activity is always recorded, CUDA
    kernels on a CUDA backend.

    Args:
        dir: the directory of the trace files (created if missing).
        wait: idle updates at the start of each cycle.
        warmup: updates traced and discarded before the recorded ones.
        active: updates recorded per cycle, >= 1.
        repeat: cycles to record, >= 1.
        skip_first: updates skipped before the first cycle.
        all_ranks: trace every process (one file per rank), not only the main process.
        record_shapes, profile_memory, with_stack: passed to ``torch.profiler.profile``.

    Raises:
        TypeError: a count that is not an int.
        ValueError: a negative count, ``active``/``repeat`` below 1, or ``dir`` is a file.

    Example:
        >>> import accelfn as af
        >>> profile = af.Profile("runs/profile", wait=5, warmup=1, active=3)
    """

    dir: Path = attrs.field(converter=lambda value: to_path("Profile", "dir", value), validator=_directory)
    wait: int = attrs.field(default=1, kw_only=True, validator=_count(0))
    warmup: int = attrs.field(default=1, kw_only=True, validator=_count(0))
    active: int = attrs.field(default=3, kw_only=True, validator=_count(1))
    repeat: int = attrs.field(default=1, kw_only=True, validator=_count(1))
    skip_first: int = attrs.field(default=0, kw_only=True, validator=_count(0))
    all_ranks: bool = attrs.field(default=False, kw_only=True, validator=attrs.validators.instance_of(bool))
    record_shapes: bool = attrs.field(default=False, kw_only=True, validator=attrs.validators.instance_of(bool))
    profile_memory: bool = attrs.field(default=False, kw_only=True, validator=attrs.validators.instance_of(bool))
    with_stack: bool = attrs.field(default=False, kw_only=True, validator=attrs.validators.instance_of(bool))


@contextlib.contextmanager
def profiling(profile: Profile | None, backend: Backend) -> Iterator[Any]:
    """The profiler of a run (call ``.step()`` after each update), or None when not profiling here."""
    if profile is None or not (profile.all_ranks or backend.is_main_process):
        yield None
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if backend.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(skip_first=profile.skip_first, wait=profile.wait, warmup=profile.warmup,
                                       active=profile.active, repeat=profile.repeat)
    handler = torch.profiler.tensorboard_trace_handler(os.fspath(profile.dir), worker_name=f"rank{backend.rank}")
    with torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=handler,
                                record_shapes=profile.record_shapes, profile_memory=profile.profile_memory,
                                with_stack=profile.with_stack) as profiler:
        yield profiler
