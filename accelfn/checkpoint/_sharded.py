"""Sharded checkpoints: the ``torch.distributed.checkpoint`` (DCP) steps of a save and a load.

A state whose model holds DTensor parameters (FSDP2 ``fully_shard``, as ``af.shard_params``
applies it) is saved with DCP into the checkpoint's ``dcp/`` folder through DCP's Hugging
Face storage (``HuggingFaceStorageWriter`` with ``save_distributed=True``): every rank writes
one ``shard-<rank + 1>-model-00001-of-00001.safetensors`` holding its shards of the model's
parameters and buffers, of the optimizer's per-parameter state and of open-window gradients,
each under its own key with the shard's offset in the file's safetensors header (JSON).
DCP's default ``FileSystemWriter`` is not used: it pickles its ``.metadata`` file. No file of
a sharded checkpoint is a pickle, and loading never unpickles: ``HuggingFaceStorageReader``
rebuilds DCP's metadata from the headers. Everything else is what an unsharded checkpoint
holds, written by the same flow (``save_load``), plus the manifest's ``sharded`` table (where
each DCP tensor belongs, its global shape and dtype) and the checksum of every DCP file.
The model's frozen tensors (a LoRA's base) are a DCP save of their own in ``dcp-frozen/``,
written once per run (``_frozen``); a load reads both folders, checked alike.

Loading checks the DCP files (the ranks split the hashing and share what they found) and
the checkpoint against the state on "meta" placeholders of the recorded shapes, before DCP
reads anything: it then loads into tensors laid out as the target's own, DTensors of its mesh
and placements or plain full tensors, so a checkpoint saved by N ranks loads into M ranks
sharded or into one unsharded process (resharding). An unsharded checkpoint loads into a
sharded state through ``put_unsharded``, which cuts each rank's shard out of the full tensors.

Mid-window, FSDP2 holds each rank's gradients unsharded and unreduced between micro-batches
that skip the reduce-scatter (``set_requires_gradient_sync(False)``, what ``accumulate`` does
under sharding), inside its own records (``FSDPParam.unsharded_accumulated_grad``, or the
unsharded parameter's ``.grad``), out of reach of the sharded parameters' ``.grad``. A
checkpoint keeps them per rank, as it keeps DDP's local gradients, with the rank's RNG
states; on loading they go back into ``unsharded_accumulated_grad``, which FSDP2 adds the
next micro-batch's gradient to and reduce-scatters at the end of the window. These are FSDP2
internals (``torch.distributed.fsdp._fully_shard``), read through ``getattr`` so that a torch
without them only loses this feature, with a clear error.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import numpy as np
import torch
import torch.distributed as dist

from accelfn import distributed
from accelfn.checkpoint import _tensorfiles
from accelfn.checkpoint._format import MANIFEST
from accelfn.checkpoint._frozen import SHARDED_DIR as FROZEN_DIR
from accelfn.checkpoint._frozen import SHARDED_GROUP as FROZEN_GROUP
from accelfn.checkpoint._manifest import ExtraTensor, ShardedTables, ShardedTensor
from accelfn.checkpoint._tensorfiles import FileEntry
from accelfn.checkpoint.snapshot import Snapshot, clean_name, is_sharded, put, unwrap
from accelfn.distributed import ProcessContext, is_dtensor
from accelfn.errors import CheckpointError
from accelfn.state import TrainState

#: the folder of a checkpoint holding DCP's files, and their tensor-table group in the manifest
DCP_DIR = "dcp"
GROUP = "dcp"
_RANK_FILE = re.compile(r"^shard-(\d{5})-model-\d{5}-of-\d{5}\.safetensors$")


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
        raise CheckpointError(f"{MANIFEST}: sharded.{key}: unknown dtype {name!r}")
    return dtype


def _flat_names(snap: Snapshot) -> list[str]:
    """The model name of each optimizer state index (torch numbers parameters across groups)."""
    return [name for group in snap.optimizer_params for name in group]


def _dtensors(tree: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
    """``(path, DTensor)`` for each DTensor in ``tree`` (mappings, lists and tuples), in order."""
    if is_dtensor(tree):
        yield path, tree
        return
    items = tree.items() if isinstance(tree, Mapping) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    for key, value in items:
        yield from _dtensors(value, (*path, key))


def _at(tree: Any, path: Any) -> Any:
    """The value at ``path`` in ``tree``, or None where there is none."""
    for key in path:
        if isinstance(tree, Mapping) and key in tree:
            tree = tree[key]
        elif isinstance(tree, (list, tuple)) and isinstance(key, int) and 0 <= key < len(tree):
            tree = tree[key]
        else:
            return None
    return tree


def _with(tree: Any, path: Any, value: Any, where: str) -> Any:
    """``tree`` with ``value`` at ``path`` (the containers on the way copied).

    Raises:
        CheckpointError: ``path`` does not lead to a value of ``tree`` (``where`` names it).
    """
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(tree, Mapping) and key in tree:
        return {**tree, key: _with(tree[key], rest, value, where)}
    if isinstance(tree, (list, tuple)) and isinstance(key, int) and not isinstance(key, bool) and 0 <= key < len(tree):
        items = [*tree[:key], _with(tree[key], rest, value, where), *tree[key + 1:]]
        return items if isinstance(tree, list) else type(tree)(*items) if hasattr(tree, "_fields") else tuple(items)
    raise CheckpointError(f"{MANIFEST}: {where} places a tensor at {list(path)!r}, which the saved state "
                          "does not have; the manifest is inconsistent")


def _split_extra(snap: Snapshot, flat: dict[str, torch.Tensor], tables: ShardedTables) -> dict[str, Any]:
    """``snap``'s ``extra`` trees with None for each DTensor, which goes into ``flat`` under
    ``extra/<name>/<path>`` and into ``tables.extra``."""
    extra = {}
    for name, tree in snap.extra.items():
        for path, t in list(_dtensors(tree)):
            key = "/".join(["extra", name, *map(str, path)])
            while key in flat:  # keys that join to the same string ("a/b" and "a", "b")
                key += "'"
            flat[key] = t
            tables.extra[key] = ExtraTensor(name=name, path=list(path), shape=tuple(t.shape),
                                            dtype=str(t.dtype).removeprefix("torch."))
            tree = _with(tree, path, None, key)
        extra[name] = tree
    return extra


def split(snap: Snapshot, model: torch.nn.Module) -> tuple[Snapshot, dict[str, torch.Tensor], ShardedTables]:
    """``snap`` without the tensors DCP writes, those tensors by DCP key, and where they belong.

    Tied weights are written once, under their first name; the others are aliases. DTensors
    in ``extra`` states are DCP's too (None in their place in the shell).
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
    extra = _split_extra(snap, flat, tables)
    shell = attrs.evolve(snap, model={}, optimizer={**snap.optimizer, "state": state}, grads={}, extra=extra)
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


def _fsdp_params(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """``(parameter name, FSDP2's record of it)`` for each parameter FSDP2 manages."""
    names = {id(p): clean_name(n) for n, p in model.named_parameters()}
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        group = getattr(get_state(), "_fsdp_param_group", None) if callable(get_state) else None
        for fsdp_param in getattr(group, "fsdp_params", ()):
            name = names.get(id(getattr(fsdp_param, "sharded_param", None)))
            if name is not None:
                yield name, fsdp_param


def hidden_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's unsharded, unreduced window gradients FSDP2 holds, by parameter name
    (full shape; empty outside a window that skipped the reduce-scatter)."""
    found = {}
    for name, fsdp_param in _fsdp_params(model):
        grad = getattr(fsdp_param, "unsharded_accumulated_grad", None)
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if grad is None and unsharded is not None:
            grad = unsharded.grad
        if grad is not None:
            found[name] = grad.detach()
    return found


def put_hidden_gradients(model: torch.nn.Module, grads: Mapping[str, torch.Tensor]) -> None:
    """Makes ``grads`` (by parameter name, full shape) the window gradients FSDP2 holds for
    this rank, to be added to and reduce-scattered at the end of the window.

    Raises:
        CheckpointError: a gradient for a parameter FSDP2 does not manage here (the state
            is sharded otherwise than the one saved, or this torch's FSDP2 keeps no such record).
    """
    if not grads:
        return
    records = dict(_fsdp_params(model))
    missing = sorted(set(grads) - set(records))
    if missing or not all(hasattr(r, "unsharded_accumulated_grad") for r in records.values()):
        raise CheckpointError(
            f"the checkpoint holds the unsharded gradients of an open accumulation window for {missing or sorted(grads)}, "
            "which this model's FSDP2 does not manage; resume it with the model sharded as it was saved")
    for name, grad in grads.items():
        record = records[name]
        dtype = getattr(record, "reduce_dtype", None) or grad.dtype
        record.unsharded_accumulated_grad = grad.to(device=getattr(record, "device", grad.device), dtype=dtype)


def announce(backend: ProcessContext, path: Path, directory: Path | None) -> Path | None:
    """Rank 0's temporary directory for ``path`` (None where it could not make one), on every
    rank (a collective: rank 0 gives its ``directory``, the others None)."""
    if backend.world_size == 1:
        return directory
    sent = distributed.exchange(directory.name if directory is not None else "", device=backend.collective_device)[0]
    return path.parent / sent if sent else None


def _own_files(folder: Path, rank: int) -> dict[str, dict[str, Any]]:
    """Checksum and size of the DCP files rank ``rank`` wrote into ``folder``."""
    mine = sorted(e.name for e in os.scandir(folder)
                  if (m := _RANK_FILE.match(e.name)) is not None and int(m[1]) == rank + 1)
    digests = _tensorfiles.in_parallel(lambda n: _tensorfiles.hash_file(folder / n), mine)
    return {name: {algorithm: digest, "num_bytes": (folder / name).stat().st_size}
            for name, (algorithm, digest) in zip(mine, digests)}


def write_shards(backend: ProcessContext, path: Path, directory: Path, flat: dict[str, torch.Tensor], *,
                 folder_name: str = DCP_DIR, group: str = GROUP) -> dict[str, FileEntry]:
    """Every rank writes its shards into ``directory/<folder_name>`` (a collective): returns
    the FileEntry (of ``group``) of every rank's files, the same on every rank.

    Raises:
        CheckpointError: on every rank, when some rank failed (each failure named by rank).
    """
    folder = directory / folder_name
    dcp = _dcp()
    files: dict[str, dict[str, Any]] = {}
    error: str | None = None
    try:
        with _single_process_quiet():
            dcp.save(flat, storage_writer=dcp.HuggingFaceStorageWriter(str(folder), save_distributed=True),
                     no_dist=_no_dist(backend))
        files = _own_files(folder, backend.rank)
    except (Exception, dcp.api.CheckpointException) as e:  # every rank reports, so that all agree on the outcome
        error = _failure(e, backend.rank)
    failed = distributed.failures(error, device=backend.collective_device)
    if failed:
        what = "a rank failed to write its shards" if backend.is_main_process else "the checkpoint was not written"
        raise CheckpointError(f"{path}: {what}: {'; '.join(failed)}")
    every = distributed.exchange(files, device=backend.collective_device)
    return {f"{folder_name}/{name}": FileEntry(group=group, num_bytes=f["num_bytes"], rank=rank,
                                            **{k: v for k, v in f.items() if k != "num_bytes"})
            for rank, rank_files in enumerate(every) for name, f in rank_files.items()}


def manifest_files(files: Mapping[str, FileEntry]) -> dict[str, FileEntry]:
    """The files of ``files`` that are not DCP's (the manifest's tensor files)."""
    return {name: e for name, e in files.items() if e.group not in (GROUP, FROZEN_GROUP)}


def _folders(tables: ShardedTables) -> list[tuple[str, str, dict[str, ShardedTensor | ExtraTensor]]]:
    """Each DCP folder of a checkpoint of ``tables``: its name, its files' group, and the
    tensors its files hold (DCP key -> global shape and dtype)."""
    folders = [(DCP_DIR, GROUP, _placed(tables))]
    if tables.frozen is not None:
        folders.append((FROZEN_DIR, FROZEN_GROUP, dict(tables.frozen.model)))
    return folders


def check_files(backend: ProcessContext, directory: Path, files: Mapping[str, FileEntry],
                tables: ShardedTables) -> None:
    """Checks the DCP files of a checkpoint before any is read: none the manifest does not list
    (DCP's reader would read them too), the size and checksum of each, the ranks sharing the
    work, and what their headers say DCP will read (``_chunk_problems``) against ``tables``
    (a collective).

    Raises:
        CheckpointError: on every rank, naming each unlisted, missing, truncated or corrupted
            file, and each tensor whose chunks do not fit the manifest's tables.
    """
    folders = _folders(tables)
    for folder, group, _ in folders:
        unexpected = _unexpected_files(directory, files, folder, group)
        if unexpected:
            raise CheckpointError(f"{directory / folder}: files the manifest does not list: {', '.join(unexpected)}; "
                                  "the checkpoint was changed after it was written")
    names = sorted(name for name, entry in files.items() if entry.group in (GROUP, FROZEN_GROUP))

    def check(name: str) -> str | None:
        try:
            _tensorfiles.verify_file(directory / name, files[name])
        except CheckpointError as e:
            return str(e)
        return None

    found = [problem for problem in _tensorfiles.in_parallel(check, names[backend.rank::backend.world_size])
             if problem]
    problems = distributed.failures("\n".join(found) or None, device=backend.collective_device)
    if not problems:  # the verified files' headers (small, all of them: the chunks of every tensor)
        chunks = [problem for folder, group, placed in folders if backend.rank == 0
                  for problem in _chunk_problems(directory, folder, placed,
                                                 sorted(n for n in names if files[n].group == group))]
        problems = distributed.failures("\n".join(chunks) or None, device=backend.collective_device)
    if problems:
        raise CheckpointError("\n".join(problems))


def _placed(tables: ShardedTables) -> dict[str, ShardedTensor | ExtraTensor]:
    """Every tensor the DCP files hold by the manifest's tables: its DCP key -> its global shape and dtype."""
    placed: dict[str, ShardedTensor | ExtraTensor] = dict(tables.model)
    placed |= {f"optimizer/{name}/{key}": meta for name, entries in tables.optimizer.items()
               for key, meta in entries.items()}
    return placed | {f"grad/{name}": meta for name, meta in tables.grads.items()} | tables.extra


def _chunk_problems(directory: Path, folder: str, placed: Mapping[str, ShardedTensor | ExtraTensor],
                    names: list[str]) -> list[str]:
    """How the headers of the DCP files ``names`` (of ``folder``) disagree with ``placed`` (the
    manifest's tables of that folder, ``_folders``): a tensor the tables do not place, a chunk of another dtype than its tensor's or outside its shape (the chunk's
    offsets are in the header's ``DCP_SHARDING_INFO``), or a tensor its chunks do not cover
    exactly once (DCP would read it so, silently: an integer read into a float tensor, a
    region never written). Empty when the files hold what the tables say."""
    found = []
    chunks: dict[str, list[tuple[list[int], list[int]]]] = {}
    for name in names:
        read = _tensorfiles.read_header(directory / name)
        try:
            sharding = json.loads(read[1].get("DCP_SHARDING_INFO", "{}")) if read is not None else None
        except (TypeError, ValueError):
            sharding = None
        if read is None or not isinstance(sharding, dict):
            found.append(f"{directory / name}: not a safetensors file of DCP's (its header does not parse)")
            continue
        for key, (dtype, shape) in read[0].items():
            meta, where = placed.get(key), f"{directory / name}: {key!r}"
            info = sharding.get(key)
            offsets = info.get("saved_offsets") if isinstance(info, dict) else [0] * len(shape)
            if meta is None:
                found.append(f"{where}: a tensor the manifest's sharded tables do not place")
            elif str(dtype).removeprefix("torch.") != meta.dtype:
                found.append(f"{where}: dtype {str(dtype).removeprefix('torch.')} in the file, {meta.dtype} in "
                             f"{MANIFEST}")
            elif not (isinstance(offsets, list) and len(offsets) == len(shape) == len(meta.shape)
                      and all(type(o) is int and 0 <= o and o + n <= g for o, n, g in zip(offsets, shape, meta.shape))):
                found.append(f"{where}: a chunk of shape {tuple(shape)} at {offsets}, outside its shape "
                             f"{tuple(meta.shape)} in {MANIFEST}")
            else:
                chunks.setdefault(key, []).append((offsets, shape))
    for key, meta in placed.items():
        mine = [chunk for chunk in chunks.get(key, []) if math.prod(chunk[1])]
        if sum(math.prod(shape) for _, shape in mine) != math.prod(meta.shape) or _overlap(mine):
            found.append(f"{directory / folder}: {key!r}: its chunks do not cover its shape {tuple(meta.shape)} "
                         f"in {MANIFEST} exactly once ({len(mine)} chunks)")
    return found


def _overlap(chunks: list[tuple[list[int], list[int]]]) -> bool:
    """True if two of the boxes ``(offsets, shape)`` share an element: counted on the grid of
    their edges (skipped past 4M cells, where only their sizes' sum is checked)."""
    edges = [sorted({o for o, _ in dims} | {o + n for o, n in dims}) for dims in
             zip(*[list(zip(offsets, shape)) for offsets, shape in chunks])]
    if len(chunks) < 2 or math.prod(len(e) - 1 for e in edges) > 1 << 22:
        return False
    counts = np.zeros([len(e) - 1 for e in edges], dtype=np.int32)
    for offsets, shape in chunks:
        counts[tuple(slice(e.index(o), e.index(o + n)) for e, o, n in zip(edges, offsets, shape))] += 1
    return bool((counts > 1).any())


def _unexpected_files(directory: Path, files: Mapping[str, FileEntry], folder: str, group: str) -> list[str]:
    """Files in ``folder`` the manifest does not list (DCP's reader would read them too)."""
    listed = {name.removeprefix(f"{folder}/") for name, e in files.items() if e.group == group}
    try:
        present = {e.name for e in os.scandir(directory / folder)}
    except FileNotFoundError:
        return []
    return sorted(present - listed)


def _placeholder(meta: ShardedTensor | ExtraTensor, key: str) -> torch.Tensor:
    return torch.empty(meta.shape, dtype=_dtype(meta.dtype, key), device="meta")


def joined(shell: Snapshot, tables: ShardedTables, tensor: Any) -> Snapshot:
    """``shell`` with the DCP tensors put back where ``split`` took them from, each made by
    ``tensor(dcp_key, meta)`` (a placeholder of the recorded shape, or the loaded tensor);
    the shell's own gradients (FSDP2's unsharded window gradients, per rank) stay."""
    model = {name: tensor(name, meta) for name, meta in _model_table(tables).items()}
    model |= {alias: model[name] for alias, name in tables.aliases.items() if name in model}
    index = {name: i for i, name in enumerate(_flat_names(shell))}
    state = {i: dict(entries) for i, entries in shell.optimizer["state"].items()}
    for name, entries in tables.optimizer.items():
        if name not in index:
            raise CheckpointError(f"{MANIFEST}: sharded.optimizer names {name!r}, which is not among "
                                  "optimizer_params")
        state.setdefault(index[name], {}).update(
            {key: tensor(f"optimizer/{name}/{key}", meta) for key, meta in entries.items()})
    grads = {**shell.grads, **{name: tensor(f"grad/{name}", meta) for name, meta in tables.grads.items()}}
    extra = dict(shell.extra)
    for key, entry in tables.extra.items():
        where = f"sharded.extra[{key!r}]"
        if entry.name not in extra or not isinstance(entry.path, list) or not all(
                isinstance(k, (str, int)) and not isinstance(k, bool) for k in entry.path):
            raise CheckpointError(f"{MANIFEST}: {where} names {entry.name!r} at {entry.path!r}: not an extra "
                                  f"entry of the checkpoint ({sorted(extra)}) and a list of keys and indices")
        extra[entry.name] = _with(extra[entry.name], entry.path, tensor(key, entry), where)
    return attrs.evolve(shell, model=model, optimizer={**shell.optimizer, "state": state}, grads=grads, extra=extra)


def _model_table(tables: ShardedTables) -> dict[str, ShardedTensor]:
    """The model's tensors of both DCP folders (the frozen ones last, as ``split`` put them apart)."""
    return tables.model if tables.frozen is None else {**tables.model, **tables.frozen.model}


def _targets(state: TrainState, tables: ShardedTables) -> dict[str, torch.Tensor]:
    """Empty tensors for DCP to load into, laid out as ``state``'s own: for a tensor of a
    DTensor parameter's global shape, a DTensor of its mesh and placements; otherwise a
    plain full tensor (CPU for optimizer state; the optimizer moves it on loading)."""
    model = unwrap(state.model)
    live = {clean_name(k): v for k, v in model.state_dict().items()}
    params = {clean_name(n): p for n, p in model.named_parameters()}
    targets = {name: torch.empty_like(live[name], dtype=_dtype(meta.dtype, name))
               for name, meta in _model_table(tables).items()}

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
    targets |= _extra_targets(state, tables, [p for p in params.values() if is_dtensor(p)])
    return targets


def _extra_targets(state: TrainState, tables: ShardedTables, sharded: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Empty tensors for the DTensors of ``extra`` states: laid out as the receiving ``extra``
    object's own DTensor at that place where it has one of the same global shape; else, in a
    sharded state, as the model's DTensor parameters are (their mesh and placements, a
    placement sharding a dimension the tensor lacks replicated); else a full tensor, on the
    device of the receiving object's tensor at that place (the CPU where it has none)."""
    live = {name: state.extra[name].state_dict() for name in {e.name for e in tables.extra.values()}
            if name in state.extra}
    targets = {}
    for key, meta in tables.extra.items():
        dtype = _dtype(meta.dtype, f"extra[{key!r}]")
        own = _at(live.get(meta.name), meta.path)
        if is_dtensor(own) and tuple(own.shape) == tuple(meta.shape):
            targets[key] = torch.empty_like(own, dtype=dtype)
        elif sharded:
            from torch.distributed.tensor import Replicate, Shard, empty  # imported: the model holds DTensors

            like: Any = sharded[0]  # a DTensor
            placements = [Replicate() if isinstance(p, Shard) and p.dim >= len(meta.shape) else p
                          for p in like.placements]
            targets[key] = empty(meta.shape, dtype=dtype, device_mesh=like.device_mesh, placements=placements)
        else:
            device = own.device if isinstance(own, torch.Tensor) else torch.device("cpu")
            targets[key] = torch.empty(meta.shape, dtype=dtype, device=device)
    return targets


def placeholders(shell: Snapshot, tables: ShardedTables) -> Snapshot:
    """``shell`` with "meta" tensors of the recorded shapes where DCP's tensors go: what the
    checkpoint holds, to check against a state before anything is read."""
    return joined(shell, tables, lambda key, meta: _placeholder(meta, key))


def load_into(state: TrainState, directory: Path, shell: Snapshot, tables: ShardedTables,
              backend: ProcessContext) -> TrainState:
    """Reads the verified sharded checkpoint in ``directory`` into ``state``, sharded or not
    (a collective; the frozen model tensors from ``dcp-frozen/``, the rest from ``dcp/``), and
    puts ``shell`` (its other values) with it.

    Raises:
        CheckpointError: DCP failed reading the verified files (each rank's error; the state
            may be partly loaded).
    """
    targets = _targets(state, tables)
    frozen = set(tables.frozen.model) if tables.frozen is not None else set()
    dcp = _dcp()
    for folder, keys in ((DCP_DIR, set(targets) - frozen), (FROZEN_DIR, frozen)):
        if not keys and folder == FROZEN_DIR:
            continue
        try:
            with _single_process_quiet():
                dcp.load({k: targets[k] for k in keys}, storage_reader=dcp.HuggingFaceStorageReader(
                    str(directory / folder)), no_dist=_no_dist(backend))
        except dcp.api.CheckpointException as e:  # DCP's; it raises on every rank alike
            raise CheckpointError(f"{directory / folder}: reading the shards failed: {_failure(e, backend.rank)}; "
                                  "the state may be partly loaded, build it again before retrying") from None
    snap = joined(attrs.evolve(shell, grads={}), tables, lambda key, meta: targets[key])
    if not is_sharded(state):  # a rank's unreduced window gradients are what DDP's .grad holds
        return put(state, attrs.evolve(snap, grads={**snap.grads, **shell.grads}), copy=False)
    restored = put(state, snap, copy=False)
    put_hidden_gradients(unwrap(state.model), shell.grads)
    return restored


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
    state = put(state, attrs.evolve(
        snap,
        model={k: local(live.get(k), v) for k, v in snap.model.items()},
        optimizer={**snap.optimizer, "state": optimizer_state},
        grads={k: v for k, v in snap.grads.items() if k not in sharded},
    ), copy=False)
    put_hidden_gradients(model, {k: v for k, v in snap.grads.items() if k in sharded})
    return state
