"""Checkpoints and exports of a pipelined model (``af.pipeline``): the stages joined on save,
this rank's stages kept on load.

Each rank of a pipelined state holds only its stages' parameters and optimizer state, under
the whole model's names (``collectives.stages``). A save sends the stages of the pipeline
that holds rank 0 to rank 0 (encoded as checkpoints encode trees: JSON and raw tensor
bytes, never pickled), which joins them into the whole model's snapshot, in the whole
optimizer's parameter order, and writes it as an unsharded checkpoint: the same files as a
one-process run of the same model writes, so it loads into one unsharded process, and into
a pipelined state of any layout, whose ranks keep only their stages' part of it. Rank 0
holds the whole model's state while it writes (the stages are not written in parallel).
"""

from __future__ import annotations

import struct
from typing import Any

import attrs
import orjson
import torch

from accelfn.checkpoint._codec import Encoder, decode
from accelfn.checkpoint.snapshot import Snapshot, _param_names, unwrap
from accelfn.collectives.stages import StageLayout, gather_bytes, stage_layout
from accelfn.errors import CheckpointError
from accelfn.state import TrainState

__all__ = ["joined", "joined_model", "kept", "stage_layout"]


def _pack(tree: Any) -> torch.Tensor:
    """``tree`` as a uint8 tensor: a JSON header (the encoded tree and its tensors' keys,
    dtypes, shapes), then the tensors' raw bytes."""
    encoder = Encoder()
    plain = encoder.encode(tree, "")
    tensors = encoder.tensors
    header = orjson.dumps({"tree": plain, "tensors": [[k, str(t.dtype).removeprefix("torch."), list(t.shape)]
                                                      for k, t in tensors.items()]})
    flat = [t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()]
    head = torch.frombuffer(bytearray(struct.pack("<Q", len(header)) + header), dtype=torch.uint8)
    return torch.cat([head, *flat])


def _unpack(data: torch.Tensor) -> Any:
    raw = data.numpy().tobytes()
    (length,) = struct.unpack_from("<Q", raw)
    header = orjson.loads(raw[8:8 + length])
    tensors, offset = {}, 8 + length
    for key, dtype_name, shape in header["tensors"]:
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"a stage sent a tensor of unknown dtype {dtype_name!r}")
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        tensors[key] = data[offset:offset + nbytes].clone().view(dtype).reshape(shape)
        offset += nbytes
    return decode(header["tree"], tensors)


def _states_by_name(optimizer: Any, names: Any) -> dict[str, Any]:
    """An optimizer ``state_dict``'s per-parameter states by parameter name."""
    states = {}
    for g, group in enumerate(optimizer["param_groups"]):
        for j, index in enumerate(group["params"]):
            if index in optimizer["state"]:
                states[names[g][j]] = optimizer["state"][index]
    return states


def _optimizer_for(template: Any, states: dict[str, Any], names: tuple[tuple[str, ...], ...]) -> Any:
    """An optimizer ``state_dict`` over the parameters ``names`` (per group), their states
    taken from ``states``, the groups' options from ``template``'s."""
    state, groups, index = {}, [], 0
    for g, group_names in enumerate(names):
        indices = []
        for name in group_names:
            if name in states:
                state[index] = states[name]
            indices.append(index)
            index += 1
        options = {k: v for k, v in template["param_groups"][g].items() if k != "params"}
        groups.append({**options, "params": indices})
    return {**template, "state": state, "param_groups": groups}


def joined(snap: Snapshot, layout: StageLayout) -> Snapshot:
    """The whole model's snapshot on rank 0, joined from the stages of its pipeline; ``snap``
    unchanged elsewhere. A collective over the pipeline that holds rank 0 (called on every
    rank: the other pipelines return at once)."""
    if layout.data_rank != 0:
        return snap
    payload = _pack({"model": snap.model, "optimizer": snap.optimizer,
                     "params": [list(g) for g in snap.optimizer_params], "grads": snap.grads})
    parts = gather_bytes(payload, layout)
    if parts is None:
        return snap
    model: dict[str, Any] = {}
    grads: dict[str, Any] = {}
    states: dict[str, Any] = {}
    for part in map(_unpack, parts):
        model.update(part["model"])
        grads.update(part["grads"])
        states.update(_states_by_name(part["optimizer"], part["params"]))
    ordered = {k: model[k] for k in layout.keys if k in model}
    return attrs.evolve(snap, model=ordered, grads=grads, optimizer_params=layout.param_names,
                        optimizer=_optimizer_for(snap.optimizer, states, layout.param_names))


def joined_model(tensors: list[tuple[str, torch.Tensor]], layout: StageLayout) -> list[tuple[str, torch.Tensor]]:
    """The whole model's ``(name, tensor)`` pairs on rank 0 (in the model's order), joined from
    the stages of its pipeline; ``tensors`` elsewhere. A collective as :func:`joined`."""
    if layout.data_rank != 0:
        return tensors
    parts = gather_bytes(_pack(dict(tensors)), layout)
    if parts is None:
        return tensors
    model: dict[str, torch.Tensor] = {}
    for part in map(_unpack, parts):
        model.update(part)
    return [(k, model[k]) for k in layout.keys if k in model]


def kept(snap: Snapshot, into: TrainState) -> Snapshot:
    """Of a whole model's snapshot, what the pipelined state ``into`` holds on this rank: its
    stages' tensors, optimizer states and open-window gradients (``snap`` itself when it
    holds nothing more)."""
    model = unwrap(into.model)
    keys = set(model.state_dict())
    if set(snap.model) <= keys:
        return snap
    names = _param_names(model, into.optimizer)
    states = _states_by_name(snap.optimizer, snap.optimizer_params)
    return attrs.evolve(snap, model={k: v for k, v in snap.model.items() if k in keys},
                        grads={k: v for k, v in snap.grads.items() if k in keys}, optimizer_params=names,
                        optimizer=_optimizer_for(snap.optimizer, states, names))
