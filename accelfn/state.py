"""TrainState: one immutable record of everything a training run is at a moment.

The record is frozen; every change returns a new record through ``replace``. Tensors are
updated in place for speed, as JAX donates buffers: the old record's model and optimizer
are handed to the new one, so keep using the state a step returned, not the one you passed.
The immutable *value* of a state is its :class:`~accelfn.Snapshot` (``af.snapshot``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from accelfn.errors import check_int, wrong_type


@runtime_checkable
class Stateful(Protocol):
    """An object whose state a checkpoint can carry (``state_dict``/``load_state_dict``)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def _frozen_mapping(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    if isinstance(value, MappingProxyType):
        return value
    return MappingProxyType(dict(value or {}))


def _check_model(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, torch.nn.Module):
        raise wrong_type("TrainState", "model", "a torch.nn.Module", value)
    if isinstance(value, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        raise TypeError(
            f"TrainState.model is wrapped in {type(value).__name__}; pass the model itself "
            f"(model.module): af.replicate() wraps it for data parallelism"
        )


#: set (True) on a model whose optimizer an engine drives (``af.deepspeed``): the engine
#: points the optimizer at partitions of its own, which are no parameters of the model
ENGINE_OWNED = "_accelfn_engine_owned"
#: on such a model: the optimizer as checkpoints see it (``param_groups`` of the model's own
#: parameters, ``state_dict``/``load_state_dict`` in torch's format with whole tensors)
OPTIMIZER_VIEW = "_accelfn_optimizer_view"


def _check_ownership(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    owned = {id(p) for p in model.parameters()}
    for group_index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in owned:
                raise ValueError(
                    f"optimizer param_groups[{group_index}] holds a tensor of shape "
                    f"{tuple(p.shape)} that is not a parameter of the model; build the "
                    "optimizer from model.parameters() (a new model needs a new optimizer)"
                )


def _check_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    if scheduler is None:
        return
    if isinstance(scheduler, torch.optim.Optimizer) or not hasattr(scheduler, "step") or not isinstance(
            scheduler, Stateful):
        raise TypeError(
            "scheduler must be an lr scheduler of the optimizer (torch.optim.lr_scheduler), with "
            f"step(), state_dict() and load_state_dict(); got {type(scheduler).__name__}"
        )
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise TypeError(
            "ReduceLROnPlateau steps on a validation metric, but accelfn steps the scheduler "
            "once per optimizer update without arguments; keep it out of TrainState and call "
            "scheduler.step(metric) yourself after af.evaluate (pass it in extra= to checkpoint it)"
        )
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError("scheduler was built for another optimizer than the one given")


def _check_optimizer(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, torch.optim.Optimizer):
        raise wrong_type("TrainState", "optimizer", "a torch.optim.Optimizer", value)


def _check_counter(instance: object, attribute: attrs.Attribute, value: int) -> None:
    check_int("TrainState", attribute.name, value, minimum=0)


@attrs.frozen
class Stopped:
    """Why a run ended before its totals: a hook returned ``af.Stop`` after update ``step``.

    ``run`` sets it in the state (and so in every checkpoint written from then on); a later
    ``run`` of that state, or one resumed from such a checkpoint, trains nothing more unless
    it is called with ``continue_after_stop=True`` (or the state is ``state.replace(stopped=None)``).

    Attributes:
        step: the optimizer update after which the run stopped (``state.step`` then).
        reason: the ``af.Stop``'s reason.
    """

    step: int
    reason: str


def _check_stopped(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and not isinstance(value, Stopped):
        raise wrong_type("TrainState", "stopped", "None or a Stopped(step, reason) record", value)


def _check_data_state(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and not isinstance(value, Mapping) and not callable(getattr(value, "state_dict", None)):
        raise wrong_type("TrainState", "data_state",
                         "None, a mapping (the readers' saved state) or the live readers (with state_dict())", value)


@attrs.frozen(eq=False)
class TrainState:
    """The state of a training run.

    Attributes:
        model: the unwrapped model (never the DDP or compiled wrapper).
        optimizer: its optimizer.
        scheduler: an lr scheduler stepped once per applied optimizer update, or None.
        step: optimizer updates applied (a skipped fp16 update does not count).
        micro_step: micro-batches consumed since the start of training.
        epoch: the epoch in progress (0-based).
        epoch_micro_step: micro-batches of the current epoch consumed; a resumed run skips
            exactly these.
        transforms_state: the state transforms carry, keyed by kind (``"loss_scale"``,
            ``"skips"``, ``"window"``), each an immutable record.
        extra: user objects with ``state_dict``/``load_state_dict`` that checkpoints carry.
        stopped: None, or why and at which update a hook's ``af.Stop`` ended the run
            (:class:`Stopped`); a run of a stopped state trains nothing more unless asked.
        data_state: where this process's data readers are in the epoch, beyond the counters:
            a stream's readers' own saved state at ``epoch_micro_step`` (``accelfn.data.streams``),
            so that a resumed epoch continues the stream instead of reading it again. None when
            the counters alone place the epoch (map-style data, lists) or at an epoch's start;
            a mapping as a checkpoint holds it; during ``run``, the live readers of the epoch in
            progress (an object whose ``state_dict()`` a snapshot takes).
    """

    model: torch.nn.Module = attrs.field(validator=_check_model)
    optimizer: torch.optim.Optimizer = attrs.field(validator=_check_optimizer)
    scheduler: Any = None
    step: int = attrs.field(default=0, validator=_check_counter)
    micro_step: int = attrs.field(default=0, validator=_check_counter)
    epoch: int = attrs.field(default=0, validator=_check_counter)
    epoch_micro_step: int = attrs.field(default=0, validator=_check_counter)
    transforms_state: Mapping[str, Any] = attrs.field(factory=dict, converter=_frozen_mapping)
    extra: Mapping[str, Stateful] = attrs.field(factory=dict, converter=_frozen_mapping)
    stopped: Stopped | None = attrs.field(default=None, validator=_check_stopped)
    data_state: Any = attrs.field(default=None, validator=_check_data_state)

    @classmethod
    def create(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scheduler: Any = None,
        extra: Mapping[str, Stateful] | None = None,
    ) -> TrainState:
        """Builds the state at step 0.

        Args:
            model: the model; every parameter the optimizer updates must belong to it.
            optimizer: an optimizer over (some of) the model's parameters.
            scheduler: an lr scheduler of ``optimizer`` (``torch.optim.lr_scheduler``), or None.
            extra: named objects with ``state_dict``/``load_state_dict`` to checkpoint too.

        Returns:
            TrainState: the new state.

        Raises:
            TypeError: a model, optimizer, scheduler or extra object of the wrong type; a
                model already wrapped in DistributedDataParallel (``replicate()`` wraps it).
            ValueError: the optimizer updates a tensor that is not a parameter of the model,
                or the scheduler drives another optimizer.

        Example:
            >>> import torch, accelfn as af
            >>> model = torch.nn.Linear(2, 1)
            >>> state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
            >>> state.step
            0
        """
        return cls(model, optimizer, scheduler, extra=extra or {})

    def __attrs_post_init__(self) -> None:
        if not getattr(self.model, ENGINE_OWNED, False):  # an engine's optimizer holds its own partitions
            _check_ownership(self.model, self.optimizer)
            _check_scheduler(self.scheduler, self.optimizer)
        for name, obj in self.extra.items():
            if not isinstance(name, str) or not isinstance(obj, Stateful):
                raise TypeError(
                    f"extra[{name!r}] must be an object with state_dict() and "
                    f"load_state_dict(), got {type(obj).__name__}"
                )

    def replace(self, **changes: Any) -> TrainState:
        """Returns a new record with ``changes`` applied (``attrs.evolve``), checked as ``create``.

        Raises:
            TypeError: an unknown field name, or a value of the wrong type.
            ValueError: a model the optimizer does not update, or a counter below 0.
        """
        return attrs.evolve(self, **changes)

    def _advance(self, *, step: int, micro_step: int, epoch_micro_step: int,
                 transforms_state: Mapping[str, Any]) -> TrainState:
        """The state after a micro-batch, for the interpreter's hot path.

        ``replace`` without validation or conversion: the caller guarantees valid counters
        and a ``transforms_state`` of immutable records (a plain dict is wrapped read-only
        once; a read-only mapping is kept, never wrapped again). It writes the slots through
        their own setters, as attrs' ``__init__`` does; a new field must be added here too
        (the setters' unpacking below fails on import, and a test checks).
        """
        new = _new(TrainState)
        _set_model(new, self.model)
        _set_optimizer(new, self.optimizer)
        _set_scheduler(new, self.scheduler)
        _set_step(new, step)
        _set_micro_step(new, micro_step)
        _set_epoch(new, self.epoch)
        _set_epoch_micro_step(new, epoch_micro_step)
        _set_transforms_state(new, _frozen_mapping(transforms_state))
        _set_extra(new, self.extra)
        _set_stopped(new, self.stopped)
        _set_data_state(new, self.data_state)
        return new

    def with_transform_state(self, **entries: Any) -> TrainState:
        """Returns a new record whose ``transforms_state`` has ``entries`` set (None removes)."""
        merged = dict(self.transforms_state)
        for key, value in entries.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = value
        return attrs.evolve(self, transforms_state=merged)


_new = object.__new__
# each slot's descriptor setter, which the frozen record's __setattr__ does not go through
(_set_model, _set_optimizer, _set_scheduler, _set_step, _set_micro_step, _set_epoch, _set_epoch_micro_step,
 _set_transforms_state, _set_extra, _set_stopped, _set_data_state) = (getattr(TrainState, field.name).__set__ for field in attrs.fields(TrainState))


def require_state(call: str, value: object) -> None:
    """Raises unless ``value`` is a TrainState; the message names the call, what was passed
    and what to use instead (a model or optimizer is wrapped by ``TrainState.create``; a dict
    of tensors is not a state; a path where the state was due means swapped arguments).

    Args:
        call: the argument as the user wrote it, e.g. ``"af.save(state, ...)"`` or
            ``"af.load(path, into=...)"``.
        value: what was passed.

    Raises:
        TypeError: ``value`` is not a TrainState.
    """
    if isinstance(value, TrainState):
        return
    kind = type(value).__name__
    if isinstance(value, torch.nn.Module):
        hint = (f"got the model ({kind}) itself; wrap it with its optimizer first: "
                "state = af.TrainState.create(model, optimizer)")
    elif isinstance(value, torch.optim.Optimizer):
        hint = (f"got the optimizer ({kind}) itself; wrap the model and it first: "
                "state = af.TrainState.create(model, optimizer)")
    elif isinstance(value, Mapping):
        hint = (f"got a {kind}; a dict is not a state: build one with af.TrainState.create(model, optimizer) "
                "and put objects with state_dict()/load_state_dict() in its extra={...} (to save a plain dict "
                "of tensors use safetensors.torch.save_file)")
    elif isinstance(value, (str, bytes, os.PathLike)):
        hint = f"got a path ({value!r}); are the arguments swapped? The state is built by af.TrainState.create(model, optimizer)"
    else:
        hint = f"got a {kind}; build one with af.TrainState.create(model, optimizer)"
    raise TypeError(f"{call} takes a TrainState, {hint}")
