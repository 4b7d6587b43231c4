"""The frozen part of a sharded model, written once per run: a LoRA's base under
``shard_params`` in every checkpoint without rewriting it.

The sharded counterpart of ``_frozen`` (read its docstring first: the same guarantees, for
the same reasons). A sharded checkpoint's model tensors that do not require gradients
(``requires_grad=False``: a LoRA's base) are a DCP save of their own, in ``dcp-frozen/``
(every rank writes its shards there through the same DCP storage as ``dcp/``, ``_sharded``);
the manifest's ``sharded.frozen`` table (``FrozenShards``) places them and records, per rank,
the checksum of that rank's local frozen shards (their keys, offsets in the global tensor,
shapes, dtypes and bytes, hashed in memory as ``_tensorfiles.checksum`` hashes a file's
bytes).

A later save of the same ``Checkpoints`` directory compares, on every rank, the checksum of
its local frozen shards with the one the previous checkpoint's manifest records for that
rank (rank 0 reads that manifest and sends its ``sharded.frozen`` and ``dcp-frozen/`` entries
to all, with the ranks' checksums, in one ``distributed.exchange``). Where the world size,
the table and every rank's checksum are the same, the previous ``dcp-frozen/`` files hold
exactly what this save would write: each rank verifies its own files of them on disk (size
and checksum, read and hashed) and hard-links them into the new checkpoint. The ranks decide
together, by ``distributed.any_rank`` (one rank that cannot verify or link its files makes
every rank write afresh, its links removed first, so that no rank ever writes into a linked
file), so that all of them go into DCP's collectives together or none does.

Every checkpoint directory stays complete on its own (retention deletes any of them, a copy
copies the bytes); a load reads and checks ``dcp-frozen/`` exactly as ``dcp/`` (listed files
only, each file's size and checksum, every header's chunks against the table), so a
missing or corrupted linked file is the ``CheckpointError`` naming it. A pipelined model
keeps its frozen tensors in ``dcp/`` (each rank's stages are already its own).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from accelfn import distributed
from accelfn.checkpoint import _format, _sharded, _tensorfiles
from accelfn.checkpoint._manifest import FrozenShards, ShardedTables, unstructure, validated
from accelfn.checkpoint._tensorfiles import FileEntry
from accelfn.distributed import ProcessContext, is_dtensor
from accelfn.errors import CheckpointError


@attrs.frozen
class Reuse:
    """The previous checkpoint's ``dcp-frozen/`` files, which hold what this save would write:
    its directory and the manifest's entries of those files (every rank's)."""

    earlier: Path
    files: dict[str, FileEntry]


def split(flat: Mapping[str, torch.Tensor], tables: ShardedTables, frozen: frozenset[str]
          ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], ShardedTables]:
    """``flat`` (DCP key -> tensor, ``_sharded.split``) as the tensors of ``dcp/`` and the
    model's ``frozen`` ones (``_frozen.names``), and ``tables`` with those moved from ``model``
    into ``frozen`` (its checksums still empty; None where there are none)."""
    keys = sorted(k for k in tables.model if k in frozen)
    if not keys:
        return dict(flat), {}, tables
    moved = FrozenShards(model={k: tables.model[k] for k in keys}, algorithm=_tensorfiles.default(), checksums=())
    tables = attrs.evolve(tables, model={k: v for k, v in tables.model.items() if k not in moved.model}, frozen=moved)
    return {k: t for k, t in flat.items() if k not in moved.model}, {k: flat[k] for k in keys}, tables


def local_checksum(frozen: Mapping[str, torch.Tensor], algorithm: str) -> str:
    """The hex checksum of this rank's local shards of the ``frozen`` tensors: each keyed by
    its DCP key, its offsets in the global tensor (DCP's own chunk, ``__create_chunk_list__``)
    and its global shape, so that equal checksums mean equal ``dcp-frozen/`` content."""
    local = {}
    for key, t in frozen.items():
        if is_dtensor(t):
            offsets = [list(chunk.offsets) for chunk in t.__create_chunk_list__()]  # DTensor's own chunks for DCP
            local[f"{key}@{offsets}/{list(t.shape)}"] = t.to_local()
        else:
            local[f"{key}/{list(t.shape)}"] = t
    return _tensorfiles.checksum(local, algorithm)[0]


def _previous(earlier: Path | None) -> dict[str, Any] | None:
    """The previous checkpoint's frozen table and ``dcp-frozen/`` entries as JSON (rank 0's
    offer), or None where there is none or its manifest does not read."""
    if earlier is None:
        return None
    try:
        manifest = _format.read(earlier)
    except CheckpointError:
        return None
    if manifest.sharded is None or manifest.sharded.frozen is None:
        return None
    return {"path": str(earlier), "frozen": unstructure(manifest.sharded.frozen),
            "files": {name: unstructure(e) for name, e in manifest.files.items() if e.group == _sharded.FROZEN_GROUP}}


def _reusable(offer: Any, tables: FrozenShards, world_size: int) -> Reuse | None:
    """The previous checkpoint rank 0 offered, where its frozen table and every rank's
    checksum are ``tables``'s (the same decision on every rank: the same inputs)."""
    if not isinstance(offer, dict):
        return None
    previous, problems = validated(offer.get("frozen"), FrozenShards)
    files = {name: validated(entry, FileEntry) for name, entry in dict(offer.get("files") or {}).items()}
    if problems or any(found for _, found in files.values()) or previous != tables or len(tables.checksums) != world_size:
        return None
    return Reuse(Path(offer["path"]), {name: entry for name, (entry, _) in files.items()})


def plan(backend: ProcessContext, tables: ShardedTables, frozen: Mapping[str, torch.Tensor], earlier: Path | None
         ) -> tuple[ShardedTables, Reuse | None]:
    """``tables`` with every rank's checksum of its frozen shards, and the previous checkpoint
    whose ``dcp-frozen/`` files may be linked, or None (a collective: one exchange; rank 0
    gives ``earlier``, the previous checkpoint of the same directory, the others None)."""
    assert tables.frozen is not None, "split found frozen tensors"
    mine = local_checksum(frozen, tables.frozen.algorithm)
    sent = distributed.exchange([mine, _previous(earlier) if backend.rank == 0 else None],
                                device=backend.collective_device)
    with_checksums = attrs.evolve(tables.frozen, checksums=tuple(checksum for checksum, _ in sent))
    return attrs.evolve(tables, frozen=with_checksums), _reusable(sent[0][1], with_checksums, backend.world_size)


def _own(reuse: Reuse, rank: int) -> dict[str, FileEntry]:
    return {name: e for name, e in reuse.files.items() if e.rank == rank}


def _verified(reuse: Reuse, rank: int) -> bool:
    """True if this rank's files of the previous checkpoint are there and intact."""
    try:
        for name, entry in _own(reuse, rank).items():
            _tensorfiles.verify_file(reuse.earlier / name, entry)
    except CheckpointError:
        return False
    return True


def _link(reuse: Reuse, rank: int, directory: Path, made: list[Path]) -> bool:
    """Hard-links this rank's previous files into ``directory`` (each link made added to
    ``made``); False where one could not be (any OSError: the ranks then write afresh)."""
    try:
        (directory / _sharded.FROZEN_DIR).mkdir(exist_ok=True)
        for name in _own(reuse, rank):
            os.link(reuse.earlier / name, directory / name)
            made.append(directory / name)
    except OSError:
        return False
    return True


def write(backend: ProcessContext, path: Path, directory: Path, frozen: dict[str, torch.Tensor],
          reuse: Reuse | None) -> dict[str, FileEntry]:
    """Puts the frozen tensors into ``directory/dcp-frozen`` (a collective): every rank's files
    hard links to ``reuse``'s where every rank verified and linked its own, else written by
    DCP. Returns the FileEntry of every rank's files, the same on every rank.

    Raises:
        CheckpointError: on every rank, when some rank failed to write (``write_shards``).
    """
    device, made = backend.collective_device, list[Path]()
    if reuse is not None and not distributed.any_rank(not _verified(reuse, backend.rank), device=device):
        if not distributed.any_rank(not _link(reuse, backend.rank, directory, made), device=device):
            return dict(reuse.files)
        for link in made:  # some rank could not link: all write afresh, never into a linked file
            with contextlib.suppress(FileNotFoundError):
                link.unlink()
    return _sharded.write_shards(backend, path, directory, frozen, folder_name=_sharded.FROZEN_DIR,
                                 group=_sharded.FROZEN_GROUP)
