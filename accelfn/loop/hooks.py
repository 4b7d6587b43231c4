"""Hooks: functions ``run`` calls between updates (every N updates, at each epoch's end).

A hook is a plain function of the state and the backend. What it returns is logged to the
run's trackers at the current step; returning :class:`Stop` ends the run cleanly after this
update. Hooks run on every process, so a hook may call ``af.evaluate`` or any collective;
``run`` stops when any process asks to.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import attrs

from accelfn import distributed
from accelfn.backends.base import Backend
from accelfn.errors import check_int, wrong_type
from accelfn.state import TrainState


@attrs.frozen
class Stop:
    """What a hook returns to end the run after the current update.

    Args:
        reason: why (printed by the main process: ``"accelfn: stopped at step 40: ..."``).
        metrics: values to log at the current step before stopping, as a hook's mapping.

    Example:
        >>> import accelfn as af
        >>> af.Stop("val/loss has not improved for 3 epochs", {"val/loss": 0.31})
        Stop(reason='val/loss has not improved for 3 epochs', metrics={'val/loss': 0.31})
    """

    reason: str = attrs.field(validator=attrs.validators.instance_of(str))
    metrics: Mapping[str, float] = attrs.field(factory=dict, converter=dict)


HookResult = Union[Mapping[str, Any], Stop, None]
HookFn = Callable[[TrainState, Backend], HookResult]


def _every_steps(instance: Hook, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong_type("Hook", "every_steps", "an int (optimizer updates) or None", value)
    check_int("Hook", "every_steps", value, minimum=1)


def _callable(instance: Hook, attribute: attrs.Attribute, value: Any) -> None:
    if not callable(value):
        raise wrong_type("Hook", "fn", "a function fn(state, backend) -> metrics or None", value)


@attrs.frozen
class Hook:
    """Calls ``fn(state, backend)`` every ``every_steps`` optimizer updates and/or at the end
    of each epoch, inside ``run``.

    ``fn`` returns a mapping of values to log at the current step (``{"val/loss": 0.3}``),
    None, or :class:`Stop` to end the run after this update. It runs on every process after
    the update's metrics are logged and before a checkpoint of the same step is saved, so a
    checkpoint holds what the hook changed; state that must survive a resume (an early-
    stopping patience counter, a best score) belongs in ``TrainState.extra`` (objects with
    ``state_dict``/``load_state_dict``), which checkpoints hold. Steps count from the start of
    training (``state.step``): ``every_steps=100`` fires at steps 100, 200, ... also after a
    resume. When both triggers fall on one update, ``fn`` runs once. An fp16 update skipped
    for overflow does not advance ``state.step`` and fires no ``every_steps`` hook.

    The values ``fn`` returns are logged as the main process computed them: make them the
    same on every process (``af.evaluate`` returns the whole dataset's outputs on every
    process; ``backend.reduce`` averages a number).

    Args:
        fn: ``fn(state, backend) -> Mapping[str, float] | af.Stop | None``.
        every_steps: call every this many optimizer updates, or None.
        at_epoch_end: call after the last update of each epoch.

    Raises:
        TypeError: ``fn`` is not callable; ``every_steps`` not an int; ``at_epoch_end`` not a bool.
        ValueError: ``every_steps`` below 1, or neither trigger given.

    Example:
        >>> import accelfn as af
        >>> hook = af.Hook(lambda state, backend: {"lr_now": 0.1}, every_steps=100)
    """

    fn: HookFn = attrs.field(validator=_callable)
    every_steps: int | None = attrs.field(default=None, kw_only=True, validator=_every_steps)
    at_epoch_end: bool = attrs.field(default=False, kw_only=True, validator=attrs.validators.instance_of(bool))

    def __attrs_post_init__(self) -> None:
        if self.every_steps is None and not self.at_epoch_end:
            raise ValueError("Hook(fn) needs a trigger: every_steps=<updates> and/or at_epoch_end=True")



def check_hooks(hooks: Any) -> tuple[Hook, ...]:
    """``hooks`` as a tuple, or TypeError naming what is wrong."""
    if isinstance(hooks, Hook) or not isinstance(hooks, Sequence):
        raise TypeError(f"run(hooks=...) takes a list of af.Hook, e.g. hooks=[af.Hook(fn, at_epoch_end=True)], "
                        f"got {hooks!r}")
    for hook in hooks:
        if not isinstance(hook, Hook):
            raise TypeError(f"run(hooks=...) takes af.Hook values (af.Hook(fn, every_steps=100)), got {hook!r}")
    return tuple(hooks)


class Hooks:
    """The hooks of one ``run``: which fire after an update, what they return, whether to stop."""

    def __init__(self, hooks: tuple[Hook, ...], backend: Backend, start_step: int):
        self._hooks = hooks
        self._backend = backend
        self._last_step = start_step
        self.stop_reason: str | None = None

    def __bool__(self) -> bool:
        return bool(self._hooks)

    def after_update(self, state: TrainState, epoch_end: bool) -> dict[str, float]:
        """Runs the hooks due after the update that reached ``state.step``; returns what they
        logged (merged, later hooks win) and sets ``stop_reason`` if one asked to stop."""
        step = state.step
        advanced = step != self._last_step  # an fp16 update skipped for overflow leaves the step as it was
        self._last_step = step
        due = [hook for hook in self._hooks
               if (epoch_end and hook.at_epoch_end)
               or (advanced and hook.every_steps is not None and step % hook.every_steps == 0)]
        if not due:
            return {}
        distributed.sync_buffers(state.model, self._backend.collective_device)  # hooks read one model
        logged: dict[str, float] = {}
        reason: str | None = None
        for hook in due:
            result = hook.fn(state, self._backend)
            if isinstance(result, Stop):
                reason = reason or result.reason
                result = result.metrics
            if result is None:
                continue
            if not isinstance(result, Mapping):
                raise TypeError(f"the hook {hook.fn!r} returned {result!r}; a hook returns a mapping of values to "
                                "log ({'val/loss': 0.3}), af.Stop(reason), or None")
            logged.update({str(k): _number(k, v, hook) for k, v in result.items()})
        self.stop_reason = self._agree(reason)
        return logged

    def _agree(self, reason: str | None) -> str | None:
        """A stop asked on any process stops every process (one scalar all-reduce per firing)."""
        if not distributed.any_rank(reason is not None, device=self._backend.collective_device):
            return None
        return reason or "another process's hook asked to stop"


def _number(name: Any, value: Any, hook: Hook) -> float:
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"the hook {hook.fn!r} returned {name!r}: {value!r}; logged values must be numbers "
                        "(a Python number or a one-element tensor)") from None
