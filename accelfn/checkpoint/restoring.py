"""Putting a snapshot back in place: ``af.restore``, and the two halves ``af.load`` uses.

``verify`` runs every check of ``accelfn.checkpoint.snapshots`` and changes nothing; ``put`` then
copies the snapshot into the state (tensors to its device), sets the counters, transform
states and global RNG states, and returns the new record. Nothing is changed unless every
check passed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from accelfn.checkpoint import _rng
from accelfn.checkpoint._codec import copy_tree
from accelfn.checkpoint.snapshots import (
    TRANSIENT,
    Snapshot,
    check,
    clean_name,
    invalid_values,
    unwrap,
)
from accelfn.errors import CheckpointError
from accelfn.state import TrainState


def _device(model: torch.nn.Module) -> torch.device:
    for param in model.parameters():
        return param.device
    for buffer in model.buffers():
        return buffer.device
    return torch.device("cpu")


def apply(state: TrainState, snap: Snapshot, *, copy: bool, source: str = "the snapshot",
          names: Mapping[str, str] = MappingProxyType({})) -> TrainState:
    """Checks ``snap`` (:func:`verify`), then puts it in place (:func:`put`).

    Raises:
        CheckpointError: as ``verify``; nothing was changed.
    """
    verify(state, snap, source=source, names=names)
    return put(state, snap, copy=copy)


def verify(state: TrainState, snap: Snapshot, *, source: str = "the snapshot",
           names: Mapping[str, str] = MappingProxyType({})) -> None:
    """Checks ``snap``'s values, then its fit to ``state``; ``source`` and ``names`` name
    the values in messages (``check``). Changes nothing.

    Raises:
        TypeError: arguments of the wrong types.
        CheckpointError: a value no state could take, or the snapshot does not fit the state.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"restore() takes a TrainState first, got {type(state).__name__}")
    if not isinstance(snap, Snapshot):
        raise TypeError(f"restore() takes a Snapshot second (af.snapshot(state)), got {type(snap).__name__}")
    invalid = invalid_values(snap, names=names)
    if invalid:
        raise CheckpointError(f"invalid values in {source}:\n  " + "\n  ".join(invalid))
    differ = check(state, snap, source=source, names=names)
    if differ:
        raise CheckpointError("the checkpoint does not match the state it is loaded into:\n  " + "\n  ".join(differ))


def put(state: TrainState, snap: Snapshot, *, copy: bool) -> TrainState:
    """Puts a verified ``snap`` in place; ``copy=False`` lets the state take ownership of
    the snapshot's tensors (the snapshot must not be used again). Cannot fail but in a
    user's ``extra`` object, whose ``load_state_dict`` therefore runs first.

    Parameters and buffers are copied into the model's own tensors; so are optimizer
    states where the optimizer already holds a tensor of the same shape, dtype and key
    (no fresh memory); any other tensor is copied (``copy``) or taken over."""
    model = unwrap(state.model)
    device = _device(model)

    def own(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if copy else t

    for name, obj in state.extra.items():
        obj.load_state_dict(copy_tree(snap.extra[name], own))
    keys = {clean_name(k): k for k in model.state_dict()}
    model.load_state_dict({keys[k]: v for k, v in snap.model.items()})  # copies into the parameters
    state.optimizer.load_state_dict(_into_live(state.optimizer, snap.optimizer, own))
    if state.scheduler is not None:
        state.scheduler.load_state_dict(copy_tree(snap.scheduler, own))
    _restore_grads(model, snap.grads, copy)
    restored = {k: copy_tree(v, lambda t: t.to(device, copy=copy)) for k, v in snap.transforms_state.items()}
    for key, value in state.transforms_state.items():
        if key not in restored and key not in TRANSIENT:  # a transform added since the snapshot
            restored[key] = value
    _rng.restore(snap.rng)
    return state.replace(transforms_state=restored, **snap.counters)


def _into_live(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any],
               own: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    """``saved`` (an optimizer's state dict) with each state tensor copied into the
    optimizer's own tensor of the same parameter and key when that has the same shape and
    dtype (``load_state_dict`` then keeps it), and the others passed through ``own``."""
    live = optimizer.state_dict()["state"]

    def into(index: Any, key: Any, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return copy_tree(value, own)
        target = live.get(index, {}).get(key)
        if (isinstance(target, torch.Tensor) and target is not value and target.shape == value.shape
                and target.dtype == value.dtype):
            with torch.no_grad():
                target.copy_(value)
            return target
        return own(value)

    state = {index: {key: into(index, key, value) for key, value in entry.items()}
             for index, entry in saved["state"].items()}
    return {**copy_tree({k: v for k, v in saved.items() if k != "state"}, own), "state": state}


def _restore_grads(model: torch.nn.Module, grads: Mapping[str, torch.Tensor], copy: bool) -> None:
    for name, p in model.named_parameters():
        saved = grads.get(clean_name(name))
        if saved is None:
            p.grad = None
            continue
        g = saved.to(device=p.device, dtype=p.dtype, copy=copy)
        if p.grad is not None:
            p.grad.copy_(g)
        else:
            p.grad = g


def restore(state: TrainState, snap: Snapshot) -> TrainState:
    """Puts ``snap`` back into ``state`` in place and returns the restored record.

    Copies parameters, buffers and optimizer state into the state's tensors (on its
    device), loads the scheduler and ``extra`` states, sets open-window gradients, the
    transforms' states, the counters and the global RNG states. The snapshot stays intact
    and can be restored again. Transform state the snapshot lacks (a transform added since)
    keeps the state's own entry.

    Args:
        state: a state with the same model architecture, optimizer type and parameter
            groups, scheduler type and ``extra`` names as the one snapshotted.
        snap: from ``af.snapshot``.

    Returns:
        TrainState: ``state`` with the snapshot's counters and transform states.

    Raises:
        TypeError: arguments of the wrong types.
        CheckpointError: the snapshot holds values no state could take (a negative
            counter, an RNG state of the wrong size), or does not fit the state (the message
            lists every missing, unexpected or mismatched key, shape, dtype and value of
            another kind than the state's); nothing was changed.
    """
    return apply(state, snap, copy=True)
