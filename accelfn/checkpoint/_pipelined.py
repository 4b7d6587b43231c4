"""Checkpoints and exports of a pipelined model (``af.pipeline``): each rank writes its own
stages, a load keeps this rank's stages.

Each rank of a pipelined state holds only its stages' parameters and optimizer state, under
the whole model's names (``distributed.stages``). A save takes the sharded path
(``save_load``, ``_sharded``): every rank numbers its optimizer states as the whole
optimizer does (:func:`stage_shell`), writes its tensors into the checkpoint's DCP files
under their own names (the stages' keys do not overlap; data-parallel replicas of a stage
hold the same keys, which DCP writes once), and sends only its tables (shapes and dtypes)
and its optimizer states' non-tensor values, as JSON, for rank 0's manifest (:func:`merged`).
No rank holds more than its own stages' state, and the checkpoint is the whole model's: it
loads into one unsharded process (DCP reads every stage's file), and into a pipelined state
of any layout, whose ranks read only their stages' part (:func:`kept_tables`, :func:`kept`;
an unsharded checkpoint's whole snapshot is cut the same way). ``save_model`` writes the
whole model's files on rank 0, which receives the other stages' weights one file at a time
(:func:`whole_model` plans the files, :func:`file_part` sends each: JSON and raw tensor
bytes, never pickled), as it gathers a sharded model's.
"""

from __future__ import annotations

from typing import Any

import attrs
import orjson
import torch

from accelfn import distributed
from accelfn.checkpoint import _manifest, _tensorfiles
from accelfn.checkpoint._codec import Encoder, decode
from accelfn.checkpoint._manifest import ShardedTables, ShardedTensor
from accelfn.checkpoint.snapshot import Snapshot, _param_names, clean_name, unwrap
from accelfn.distributed import ProcessContext
from accelfn.distributed.pipeline import StageLayout, gather_bytes, stage_layout
from accelfn.errors import CheckpointError
from accelfn.state import TrainState

__all__ = ["file_part", "kept", "kept_tables", "merged", "stage_layout", "stage_shell", "whole_model"]


def _pack(tree: Any) -> torch.Tensor:
    """``tree`` encoded (its tensors by key) and packed to send (``_tensorfiles.pack_tensors``)."""
    encoder = Encoder()
    plain = encoder.encode(tree, "")
    return _tensorfiles.pack_tensors({"tree": plain}, encoder.tensors)


def _unpack(data: torch.Tensor) -> Any:
    header, tensors = _tensorfiles.unpack_tensors(data)
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


def stage_shell(snap: Snapshot, layout: StageLayout) -> Snapshot:
    """This rank's snapshot under the whole model's optimizer numbering: ``optimizer_params``
    the whole optimizer's, its per-parameter states under the whole model's indices (only
    this rank's stages' parameters have any), so that every rank's sharded-checkpoint keys
    and tables name the same parameters alike and join without overlap."""
    states = _states_by_name(snap.optimizer, snap.optimizer_params)
    return attrs.evolve(snap, optimizer_params=layout.param_names,
                        optimizer=_optimizer_for(snap.optimizer, states, layout.param_names))


def merged(shell: Snapshot, tables: ShardedTables, layout: StageLayout, backend: ProcessContext
           ) -> tuple[Snapshot, ShardedTables]:
    """The whole model's manifest tables and optimizer shell, joined from every rank's (a
    collective over all ranks: each sends only its tables, shapes and dtypes, and its
    optimizer states' non-tensor values, as JSON; the tensors stay on their ranks, which
    write them into the DCP files themselves). Data-parallel replicas of a stage send the
    same entries; the last one read is kept (they are equal)."""
    encoder = Encoder()
    plain = encoder.encode({str(i): v for i, v in shell.optimizer["state"].items()}, "optimizer.state")
    assert not encoder.tensors, "split() moves every tensor of the optimizer state to the DCP files"
    sent = {"tables": _manifest.unstructure(tables), "state": plain}
    model: dict[str, ShardedTensor] = {}
    whole = ShardedTables(model={}, aliases={}, optimizer={}, grads={}, extra={})
    state: dict[int, Any] = {}
    for part in distributed.exchange(sent, device=backend.collective_device):
        received = _manifest.loads(orjson.dumps(part["tables"]), ShardedTables)
        model.update(received.model)
        whole.aliases.update(received.aliases)
        whole.optimizer.update(received.optimizer)
        whole.grads.update(received.grads)
        whole.extra.update(received.extra)
        state.update({int(i): v for i, v in decode(part["state"], {}, "optimizer.state").items()})
    whole.model.update({k: model[k] for k in layout.keys if k in model})
    whole.model.update({k: v for k, v in model.items() if k not in whole.model})
    return attrs.evolve(shell, optimizer={**shell.optimizer, "state": dict(sorted(state.items()))}), whole


def kept_tables(tables: ShardedTables, into: TrainState) -> ShardedTables:
    """Of a sharded checkpoint's tables, the entries the pipelined state ``into`` holds on
    this rank: its stages' tensors, optimizer states and gradients (DCP reads only those)."""
    model = unwrap(into.model)
    keys = {clean_name(k) for k in model.state_dict()}
    names = {n for group in _param_names(model, into.optimizer) for n in group}
    return attrs.evolve(tables, model={k: v for k, v in tables.model.items() if k in keys},
                        aliases={k: v for k, v in tables.aliases.items() if k in keys and v in keys},
                        optimizer={k: v for k, v in tables.optimizer.items() if k in names},
                        grads={k: v for k, v in tables.grads.items() if k in keys},
                        frozen=None if tables.frozen is None else attrs.evolve(
                            tables.frozen, model={k: v for k, v in tables.frozen.model.items() if k in keys}))


def whole_model(tensors: list[tuple[str, torch.Tensor]], layout: StageLayout, backend: ProcessContext
                ) -> list[tuple[str, torch.Tensor]]:
    """The whole model's ``(name, tensor)`` pairs in its order, as "meta" tensors of their
    shapes and dtypes, on every rank (a collective over all ranks: each sends its stages'
    names, shapes and dtypes as JSON), for every rank to plan an export's files alike."""
    sent = [[k, str(t.dtype).removeprefix("torch."), list(t.shape)] for k, t in tensors]
    found: dict[str, torch.Tensor] = {}
    for part in distributed.exchange(sent, device=backend.collective_device):
        for key, dtype_name, shape in part:
            dtype = getattr(torch, dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise CheckpointError(f"a stage holds a tensor of unknown dtype {dtype_name!r}")
            found[key] = torch.empty(shape, dtype=dtype, device="meta")
    return [(k, found[k]) for k in layout.keys if k in found]


def file_part(tensors: dict[str, torch.Tensor], keys: list[str], layout: StageLayout) -> dict[str, torch.Tensor]:
    """The tensors ``keys`` (one export file's) on rank 0, each sent by the stage that holds
    it (copied to the CPU); empty elsewhere. A collective over the pipeline that holds rank 0
    (called on every rank: the other pipelines return at once), so that rank 0 holds one
    file's worth of the other stages' weights at a time."""
    if layout.data_rank != 0:
        return {}
    parts = gather_bytes(_pack({k: tensors[k] for k in keys if k in tensors}), layout)
    if parts is None:
        return {}
    found: dict[str, torch.Tensor] = {}
    for part in map(_unpack, parts):
        found.update(part)
    return {k: found[k] for k in keys if k in found}


def kept(snap: Snapshot, into: TrainState) -> Snapshot:
    """Of a whole model's snapshot, what the pipelined state ``into`` holds on this rank: its
    stages' tensors, optimizer states and open-window gradients (``snap`` itself when it
    holds nothing more)."""
    model = unwrap(into.model)
    keys = set(model.state_dict())
    names = _param_names(model, into.optimizer)
    if set(snap.model) <= keys and tuple(map(tuple, snap.optimizer_params)) == names:
        return snap
    states = _states_by_name(snap.optimizer, snap.optimizer_params)
    return attrs.evolve(snap, model={k: v for k, v in snap.model.items() if k in keys},
                        grads={k: v for k, v in snap.grads.items() if k in keys}, optimizer_params=names,
                        optimizer=_optimizer_for(snap.optimizer, states, names))
