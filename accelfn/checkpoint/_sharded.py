"""Sharded checkpoints: each rank writes and reads only its own shards, and any world loads them.

A state whose model holds DTensor parameters (FSDP2 ``fully_shard``, as ``af.shard_params``
applies it) is saved with ``torch.distributed.checkpoint`` (DCP) into the checkpoint's
``dcp/`` folder through DCP's Hugging Face storage (``HuggingFaceStorageWriter`` with
``save_distributed=True``): every rank writes one ``shard-<rank + 1>-model-00001-of-00001.safetensors``
holding its shards of the model's parameters and buffers, of the optimizer's per-parameter
state and of open-window gradients, each under its own key with the shard's offset in the
file's safetensors header (JSON). DCP's default ``FileSystemWriter`` is not used: it pickles
its ``.metadata`` file. No file of a sharded checkpoint is a pickle, and loading never
unpickles: ``HuggingFaceStorageReader`` rebuilds DCP's metadata from the headers.

Everything else is what an unsharded checkpoint holds, written by the same code
(``_serialize``): ``manifest.json`` with the counters, every rank's RNG and transform states,
the optimizer's hyperparameters and the scheduler, ``state.safetensors`` for their tensors,
plus the ``sharded`` table (where each DCP tensor belongs, its global shape and dtype) and
the sha256 of every DCP file. Each rank hashes the files it wrote; rank 0 writes the
manifest last into the temporary directory every rank wrote into, then renames it
(``_atomic``), so a crash at any instant leaves the old checkpoint or the new one.

Loading verifies every file's sha256 first (the ranks split the files and share what they
found), then the checkpoint against the state it is loaded into (keys, global shapes,
dtypes, values; ``restore.verify``, on "meta" tensors of the recorded shapes), and only then
reads: DCP loads into tensors laid out as the target's own, DTensors of its mesh and
placements or plain full tensors, so a checkpoint saved by N ranks loads into M ranks
sharded or into one unsharded process (resharding). An unsharded checkpoint loads into a
sharded state through ``put_unsharded``, which cuts each rank's shard out of the full tensors.
Mid-window, the gradients FSDP2 holds unsharded between micro-batches that skip the
reduce-scatter are each rank's own, kept with its RNG states (``_fsdp_window``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import torch
import torch.distributed as dist

from accelfn.checkpoint import _atomic, _manifest, _serialize
from accelfn.checkpoint import restoring as _restore
from accelfn.checkpoint import snapshots as _snapshot
from accelfn.checkpoint._context import ProcessContext
from accelfn.checkpoint._dcp_files import (
    DCP_DIR,
    GROUP,
    own_files,
    unexpected_files,
    verify_files,
)
from accelfn.checkpoint._exchange import exchange
from accelfn.checkpoint._fsdp_window import hidden_gradients, put_hidden_gradients
from accelfn.checkpoint._manifest import (
    FileEntry,
    Manifest,
    ShardedTables,
    ShardedTensor,
)
from accelfn.checkpoint.snapshots import Snapshot, clean_name, unwrap
from accelfn.collectives import is_dtensor
from accelfn.errors import CheckpointError
from accelfn.state import TrainState

__all__ = ["DCP_DIR", "is_sharded", "load", "put_unsharded", "save"]

#: the folder of a checkpoint that holds DCP's files


def is_sharded(state: TrainState) -> bool:
    """True if any parameter of the state's model is a DTensor (FSDP2 ``fully_shard``)."""
    return any(is_dtensor(p) for p in unwrap(state.model).parameters())


def _dcp() -> ModuleType:
    """``torch.distributed.checkpoint``, imported when a sharded checkpoint is first written
    or read: it brings DTensor, about 0.7 s that a process that never shards should not pay."""
    import torch.distributed.checkpoint as dcp

    return dcp


def _meta(t: torch.Tensor) -> ShardedTensor:
    return ShardedTensor(shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."))


def _dtype(name: str, key: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{_manifest.MANIFEST}: sharded.{key}: unknown dtype {name!r}")
    return dtype


def _flat_names(snap: Snapshot) -> list[str]:
    """The model name of each optimizer state index (torch numbers parameters across groups)."""
    return [name for group in snap.optimizer_params for name in group]


def split(snap: Snapshot, model: torch.nn.Module) -> tuple[Snapshot, dict[str, torch.Tensor], ShardedTables]:
    """``snap`` without the tensors DCP writes, those tensors by DCP key, and where they belong.

    Tied weights are written once, under their first name; the others are aliases.
    """
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        name = clean_name(name)
        if id(t) in first and first[id(t)] != name:
            aliases[name] = first[id(t)]
        first.setdefault(id(t), name)
    flat: dict[str, torch.Tensor] = {}
    tables = ShardedTables(model={}, aliases=aliases, optimizer={}, grads={})
    for name, t in snap.model.items():
        if name not in aliases:
            flat[name] = t
            tables.model[name] = _meta(t)
    names = _flat_names(snap)
    state: dict[Any, Any] = {}
    for index, entries in snap.optimizer["state"].items():
        plain = {}
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                dcp_key = f"optimizer/{names[index]}/{key}"
                flat[dcp_key] = value
                tables.optimizer.setdefault(names[index], {})[key] = _meta(value)
            else:
                plain[key] = value
        state[index] = plain
    for name, grad in snap.grads.items():
        flat[f"grad/{name}"] = grad
        tables.grads[name] = _meta(grad)
    shell = attrs.evolve(snap, model={}, optimizer={**snap.optimizer, "state": state}, grads={})
    return shell, flat, tables


def _no_dist(backend: ProcessContext) -> bool:
    """True when DCP is to run without collectives: a world of one process."""
    return backend.world_size == 1 or not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silences DCP's warning that it runs in a single process (where that is the intent)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized")
        yield


def _failure(e: BaseException, rank: int) -> str:
    """What went wrong, by rank: DCP's CheckpointException carries every failed rank's error."""
    if isinstance(e, _dcp().api.CheckpointException):
        return "; ".join(f"rank {r}: {type(error).__name__}: {error}" for r, (error, _) in sorted(e.failures.items()))
    return f"rank {rank}: {type(e).__name__}: {e}"


def _write_shards(backend: ProcessContext, directory: Path, flat: dict[str, torch.Tensor]
                  ) -> dict[str, FileEntry] | str:
    """Every rank writes its shards into ``directory/dcp``; the FileEntry of every rank's
    files (the same on every rank), or the first error a rank met."""
    folder = directory / DCP_DIR
    report: dict[str, Any]
    dcp = _dcp()
    try:
        with _single_process_quiet():
            dcp.save(flat, storage_writer=dcp.HuggingFaceStorageWriter(str(folder), save_distributed=True),
                     no_dist=_no_dist(backend))
        report = {"files": own_files(folder, backend.rank)}
    except (Exception, dcp.api.CheckpointException) as e:  # every rank reports, so that all agree on the outcome
        report = {"error": _failure(e, backend.rank)}
    reports = exchange(backend, report)
    errors = [r["error"] for r in reports if "error" in r]
    if errors:
        return errors[0]
    return {f"{DCP_DIR}/{name}": FileEntry(group=GROUP, num_bytes=f["num_bytes"], rank=rank,
                                            **{k: v for k, v in f.items() if k != "num_bytes"})
            for rank, r in enumerate(reports) for name, f in r["files"].items()}


def _announce(backend: ProcessContext, path: Path, directory: Path | None) -> Path | None:
    """Rank 0's temporary directory for ``path`` (None if it could not make one), on every rank."""
    if backend.world_size == 1:
        return directory
    sent = exchange(backend, directory.name if directory is not None else "")[0]
    return path.parent / sent if sent else None


def save(state: TrainState, path: Path, backend: ProcessContext, transforms: Any) -> Path:
    """Writes the sharded ``state`` as a checkpoint at ``path``: a collective, in which every
    rank writes its own shards into rank 0's temporary directory and rank 0 then writes the
    manifest and renames the directory into place.

    Raises:
        CheckpointError: a rank failed to write its shards (the message names the rank and
            its error), or as ``af.save``.
        OSError: the file system refused; ``path`` is untouched.
    """
    model = unwrap(state.model)
    shell, flat, tables = split(_snapshot.capture(state, copy=False), model)
    # FSDP2's unsharded window gradients are this rank's own: they go with its RNG states
    shell = attrs.evolve(shell, grads=hidden_gradients(model))
    part = _serialize.rank_part(shell)
    parts = [part] if backend.world_size == 1 else _serialize.gather_parts(backend, part)
    failure: BaseException | None = None
    announced = False

    def fill(directory: Path) -> None:
        nonlocal announced
        announced = True
        _announce(backend, path, directory)
        files = _write_shards(backend, directory, flat)
        if isinstance(files, str):
            raise CheckpointError(f"{path}: a rank failed to write its shards: {files}")
        _serialize.write(directory, shell, parts, transforms, sharded=tables, files=files)

    if backend.is_main_process:
        try:
            _atomic.write_directory(path, fill)
        except BaseException as e:  # re-raised below, after telling the other ranks
            failure = e
            if not announced:
                _announce(backend, path, None)
    else:
        directory = _announce(backend, path, None)
        files = _write_shards(backend, directory, flat) if directory is not None else "rank 0 could not start"
        if isinstance(files, str):
            failure = CheckpointError(f"{path}: the checkpoint was not written: {files}")
    if backend.world_size > 1 and not exchange(backend, failure is None)[0] and failure is None:
        raise CheckpointError(f"rank 0 failed to write the checkpoint {path}; its error says why")
    if failure is not None:
        raise failure
    return path


def _placeholder(meta: ShardedTensor, key: str) -> torch.Tensor:
    return torch.empty(meta.shape, dtype=_dtype(meta.dtype, key), device="meta")


def joined(shell: Snapshot, tables: ShardedTables, tensor: Any) -> Snapshot:
    """``shell`` with the DCP tensors put back where ``split`` took them from, each made by
    ``tensor(dcp_key, meta)`` (a placeholder of the recorded shape, or the loaded tensor);
    the shell's own gradients (FSDP2's unsharded window gradients, per rank) stay."""
    model = {name: tensor(name, meta) for name, meta in tables.model.items()}
    model |= {alias: model[name] for alias, name in tables.aliases.items() if name in model}
    index = {name: i for i, name in enumerate(_flat_names(shell))}
    state = {i: dict(entries) for i, entries in shell.optimizer["state"].items()}
    for name, entries in tables.optimizer.items():
        if name not in index:
            raise CheckpointError(f"{_manifest.MANIFEST}: sharded.optimizer names {name!r}, which is not among "
                                  "optimizer_params")
        state.setdefault(index[name], {}).update(
            {key: tensor(f"optimizer/{name}/{key}", meta) for key, meta in entries.items()})
    grads = {**shell.grads, **{name: tensor(f"grad/{name}", meta) for name, meta in tables.grads.items()}}
    return attrs.evolve(shell, model=model, optimizer={**shell.optimizer, "state": state}, grads=grads)


def _targets(state: TrainState, tables: ShardedTables) -> dict[str, torch.Tensor]:
    """Empty tensors for DCP to load into, laid out as ``state``'s own: for a tensor of a
    DTensor parameter's global shape, a DTensor of its mesh and placements; otherwise a
    plain full tensor (CPU for optimizer state; the optimizer moves it on loading)."""
    model = unwrap(state.model)
    live = {clean_name(k): v for k, v in model.state_dict().items()}
    params = {clean_name(n): p for n, p in model.named_parameters()}
    targets = {name: torch.empty_like(live[name], dtype=_dtype(meta.dtype, name)) for name, meta in tables.model.items()}

    def like_param(name: str, meta: ShardedTensor, key: str) -> torch.Tensor:
        dtype = _dtype(meta.dtype, key)
        param = params.get(name)
        if is_dtensor(param) and tuple(param.shape) == meta.shape:
            return torch.empty_like(param, dtype=dtype)
        device = param.device if param is not None and key.startswith("grad/") else torch.device("cpu")
        return torch.empty(meta.shape, dtype=dtype, device=device)

    for name, entries in tables.optimizer.items():
        for key, meta in entries.items():
            targets[f"optimizer/{name}/{key}"] = like_param(name, meta, f"optimizer/{name}/{key}")
    for name, meta in tables.grads.items():
        targets[f"grad/{name}"] = like_param(name, meta, f"grad/{name}")
    return targets


def load(directory: Path, manifest: Manifest, into: TrainState, backend: ProcessContext,
         position: Callable[[int, int, int], int] | None = None) -> TrainState:
    """Restores the sharded checkpoint in ``directory`` into ``into``, sharded or not, at any
    world size (a collective); nothing in ``into`` changes until every check passed.

    Raises:
        CheckpointError: a missing, truncated or corrupted file (named), a file in ``dcp/``
            the manifest does not list, a mismatch with ``into``, a checkpoint saved
            mid-accumulation-window loaded by another number of processes (all before
            anything changes), or DCP failed reading the verified files (each rank's error).
    """
    tables = manifest.sharded
    assert tables is not None
    unexpected = unexpected_files(directory, manifest.files)
    if unexpected:
        raise CheckpointError(f"{directory / DCP_DIR}: files the manifest does not list: {', '.join(unexpected)}; "
                              "the checkpoint was changed after it was written")
    verify_files(backend, directory, manifest.files)
    if tables.grads and backend.world_size != manifest.world_size:
        raise CheckpointError(
            f"{directory} was saved by {manifest.world_size} processes in the middle of an accumulation window, "
            f"whose gradients are per process; resume it with {manifest.world_size} processes "
            f"(this world has {backend.world_size})")
    own = {name: e for name, e in manifest.files.items() if e.group != GROUP}
    shell = _serialize.read(directory, attrs.evolve(manifest, files=own), rank=backend.rank,
                            world_size=backend.world_size)
    try:
        names = _serialize.field_names(_serialize.section(manifest, backend.rank))
        _restore.verify(into, joined(shell, tables, lambda key, meta: _placeholder(meta, key)),
                        source=_manifest.MANIFEST, names=names)
    except CheckpointError as e:
        raise CheckpointError(f"{directory}: {e}") from None
    if position is not None:
        counters = shell.counters
        start = position(counters["epoch"], counters["epoch_micro_step"], manifest.world_size)
        shell = attrs.evolve(shell, counters={**counters, "epoch_micro_step": start})
    targets = _targets(into, tables)
    dcp = _dcp()
    try:
        with _single_process_quiet():
            dcp.load(targets, storage_reader=dcp.HuggingFaceStorageReader(str(directory / DCP_DIR)),
                     no_dist=_no_dist(backend))
    except dcp.api.CheckpointException as e:  # DCP's; it raises on every rank alike
        raise CheckpointError(f"{directory / DCP_DIR}: reading the shards failed: {_failure(e, backend.rank)}; "
                              "the state may be partly loaded, build it again before retrying") from None
    snap = joined(attrs.evolve(shell, grads={}), tables, lambda key, meta: targets[key])
    if not is_sharded(into):  # a rank's unreduced window gradients are what DDP's .grad holds
        return _restore.put(into, attrs.evolve(snap, grads={**snap.grads, **shell.grads}), copy=False)
    state = _restore.put(into, snap, copy=False)
    put_hidden_gradients(unwrap(into.model), shell.grads)
    return state


def put_unsharded(state: TrainState, snap: Snapshot) -> TrainState:
    """Puts ``snap`` (full tensors, from an unsharded checkpoint, verified) into the sharded
    ``state``: each tensor of a DTensor parameter or buffer is cut into this rank's shard
    (no communication: every rank holds the full tensor), and the gradients of an open
    window (each rank's own, unreduced, as DDP holds them) become FSDP2's window gradients."""
    model = unwrap(state.model)
    live = {clean_name(k): v for k, v in model.state_dict().items()}
    params = {clean_name(n): p for n, p in model.named_parameters()}

    def local(like: Any, t: torch.Tensor) -> torch.Tensor:
        if is_dtensor(like) and tuple(like.shape) == tuple(t.shape) and not is_dtensor(t):
            from torch.distributed.tensor import distribute_tensor  # imported: like is a DTensor

            return distribute_tensor(t, like.device_mesh, like.placements, src_data_rank=None)
        return t

    names = _flat_names(snap)
    optimizer_state = {i: {k: local(params.get(names[i]), v) if isinstance(v, torch.Tensor) else v
                           for k, v in entries.items()}
                       for i, entries in snap.optimizer["state"].items()}
    sharded = {k for k in snap.grads if is_dtensor(params.get(k))}
    state = _restore.put(state, attrs.evolve(
        snap,
        model={k: local(live.get(k), v) for k, v in snap.model.items()},
        optimizer={**snap.optimizer, "state": optimizer_state},
        grads={k: v for k, v in snap.grads.items() if k not in sharded},
    ), copy=False)
    put_hidden_gradients(model, {k: v for k, v in snap.grads.items() if k in sharded})
    return state
