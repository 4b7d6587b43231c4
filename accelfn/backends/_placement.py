"""Placement: moving the model (the ``Place`` model phase) and a batch's tensors to the
backend's device, or not.

A backend built with ``place_model=False`` casts the model (for a low-precision policy)
where it is, and one built with ``place_batches=False`` hands batches on unchanged: the
model split over devices by hand, the batches a collate function placed itself.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from accelfn.data.tree import map_tensors
from accelfn.distributed.meta import is_meta
from accelfn.distributed.ops import is_dtensor
from accelfn.distributed.phases import ModelPhase
from accelfn.errors import wrong_type

if TYPE_CHECKING:
    from accelfn.distributed.phases import Preparation


def place_on(device: torch.device) -> Callable[[Any], Any]:
    """A function moving every tensor of a batch to ``device`` (asynchronously when pinned)."""
    non_blocking = device.type == "cuda"
    # checking is cheaper than .to(), which would return the tensor itself (is_cpu most)
    here: Callable[[torch.Tensor], bool] = (
        operator.attrgetter("is_cpu") if device.type == "cpu" else (lambda t: t.device == device))

    def move(t: torch.Tensor) -> torch.Tensor:
        return t if here(t) else t.to(device, non_blocking=non_blocking)

    def place(batch: Any) -> Any:
        if type(batch) is tuple:  # the common case: a tuple of tensors already there, kept as is
            for t in batch:
                if type(t) is not torch.Tensor or not here(t):
                    break
            else:
                return batch
        return map_tensors(move, batch)

    return place


def check_placement(call: str, *, place_model: Any, place_batches: Any) -> None:
    """Raises TypeError unless both placement options of ``call`` (``"CPU"``, ``"auto"``) are bools."""
    for name, value in (("place_model", place_model), ("place_batches", place_batches)):
        if not isinstance(value, bool):
            raise wrong_type(call, name, "True or False", value)


def unchanged(batch: Any) -> Any:
    """The placement of a backend built with ``place_batches=False``: none."""
    return batch


def move_module(model: torch.nn.Module, device: torch.device | None,
                 dtype: torch.dtype | None) -> dict[int, torch.nn.Parameter]:
    """Moves ``model`` to ``device`` (None: leaves every part where it is) and ``dtype`` in
    place; returns {id(old): new} for the parameters the move replaced.

    ``Module.to`` keeps each Parameter object when the new tensor can share its type (CPU to
    CUDA) but makes new ones otherwise (CPU to XLA); tied parameters are then tied again.
    """
    owners = [(m, name, p) for m in model.modules() for name, p in m._parameters.items() if p is not None]
    if device is not None:
        model.to(device)
    if dtype is not None:
        model.to(dtype)
    moved: dict[int, torch.nn.Parameter] = {}
    for module, name, old in owners:
        new = module._parameters[name]
        assert new is not None, "model.to() keeps every parameter"
        if new is not old:
            module._parameters[name] = moved.setdefault(id(old), new)
    return moved


def rebind_optimizer(optimizer: torch.optim.Optimizer, moved: dict[int, torch.nn.Parameter]) -> None:
    """Points ``optimizer``'s param groups and state at the parameters that replaced theirs."""
    if not moved:
        return
    for group in optimizer.param_groups:
        group["params"] = [moved.get(id(p), p) for p in group["params"]]
    optimizer.state = defaultdict(dict, {moved.get(id(p), p): v for p, v in optimizer.state.items()})


class Place(ModelPhase):
    """The first model phase: the model (and any optimizer state) moved to the backend's device
    and cast for a true low-precision policy (``bf16-true``); a backend built with
    ``place_model=False`` casts it where it is.

    Not for a model an earlier ``prepare`` split or sharded (placed then), one on the meta
    device the backend places (filled on the device by ``distributed.meta.Materialize``), or
    one an engine places itself (``deepspeed()``).
    """

    name: ClassVar[str] = "place"

    @classmethod
    def of(cls, prep: Preparation) -> Place | None:
        model, placed = prep.state.model, prep.hardware.place_model
        if ((placed and is_meta(model)) or any(is_dtensor(p) for p in model.parameters())
                or any(t.engine for t in prep.step.transforms)):
            return None
        return cls()


    def apply(self, prep: Preparation) -> None:
        model, optimizer, policy = prep.state.model, prep.state.optimizer, prep.policy
        dtype = policy.param_dtype if policy.param_dtype != torch.float32 else None
        device = prep.hardware.device if prep.hardware.place_model else None  # None: cast where it is
        rebind_optimizer(optimizer, move_module(model, device, dtype))
        if optimizer.state:  # re-cast existing moments to the parameters' device and dtype
            optimizer.load_state_dict(optimizer.state_dict())
