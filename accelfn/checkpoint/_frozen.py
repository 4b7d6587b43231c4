"""The frozen part of a model, written once per run: a LoRA's base model in every checkpoint
without rewriting it.

A model fine-tuned with adapters (``peft``'s LoRA) trains a few tensors and leaves the rest
(the base model: almost all of its bytes) untouched. Its checkpoints put the parameters that do
not require gradients (``requires_grad=False``) into files of their own, ``frozen.safetensors``
(``frozen-00000.safetensors``, ... above a shard's size), of the ``model`` group: a reader sees
the same model table as ever, so a checkpoint with frozen files loads in an accelfn that
predates them. Where the previous checkpoint of the same directory (``Checkpoints``) holds a
frozen file of the same name, size and checksum as the one about to be written, the new file
is a hard link to it: the same bytes on disk, nothing written. The decision is by content, not
by trust: the file's checksum is computed over the bytes it would hold (the layout
``_tensorfiles.write_file`` writes), and the linked file is verified on disk (read, hashed)
before it counts; a changed frozen tensor (a layer unfrozen and trained, a base edited by
hand) gives another checksum and a file written afresh. Hashing in memory runs at memory
speed (XXH3-128, ``_tensorfiles``), far below the cost of writing the bytes.

Why hard links rather than a manifest entry that points into an earlier checkpoint: every
checkpoint directory stays complete on its own. Retention (``keep``) deletes any checkpoint
without asking which others refer to it (the file lives on while a link to it does); a
checkpoint copied elsewhere (``cp -r``, ``rsync``) copies the bytes; the reader, the atomic
write (links are made in the temporary directory, before the rename) and every check of a
load are unchanged: a missing, truncated or corrupted frozen file is the ``CheckpointError``
naming the file that any tensor file gets. The cost of sharing: one corrupted frozen file
corrupts every checkpoint that links it (each load then refuses it, naming the file; a
reference into an earlier checkpoint would share that fate). Where the file system refuses a
hard link (another device, a file system without them), the file is written, as before.

Sharded checkpoints (``shard_params``, ``tensor_parallel``: every rank writes its shards
through DCP, ``_sharded``) do the same with DCP files. The frozen tensors are a DCP save of
their own, in ``dcp-frozen/`` beside ``dcp/``; the manifest's ``sharded.frozen`` table
(``FrozenShards``) places them and records, per rank, the checksum of that rank's local
frozen shards (their keys, offsets in the global tensor, shapes, dtypes and bytes, hashed in
memory as ``_tensorfiles.checksum`` hashes a file's bytes): a DCP file's bytes cannot be
known before DCP writes it, its content can. A later save of the same ``Checkpoints``
directory has every rank hash its local frozen shards; rank 0 sends the previous
checkpoint's frozen table and ``dcp-frozen/`` entries with them, in one
``distributed.exchange``. Where the world size, the table and every rank's checksum are
the previous ones, the previous ``dcp-frozen/`` files hold exactly what DCP would write:
each rank verifies its own of them on disk (size and checksum) and hard-links them into
the new checkpoint. The ranks decide together by ``distributed.any_rank``: one rank that
cannot verify or link its files makes every rank write afresh (its links removed first,
so that nothing is ever written into a linked file), and all of them enter DCP's
collectives together or none does. A load reads and checks ``dcp-frozen/`` exactly as
``dcp/`` (listed files only, each file's size and checksum, every header's chunks against
the table), so a missing or corrupted linked file is the ``CheckpointError`` naming it. A
pipelined model keeps its frozen tensors in ``dcp/`` (each rank's stages are its own).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from accelfn import distributed
from accelfn.checkpoint import _tensorfiles
from accelfn.checkpoint._manifest import FrozenShards, Manifest, ShardedTables, unstructure, validated
from accelfn.checkpoint._tensorfiles import SUFFIX, FileEntry
from accelfn.checkpoint.snapshot import clean_name
from accelfn.distributed import ProcessContext, is_dtensor
from accelfn.errors import CheckpointError

#: the file name (stem) of a checkpoint's frozen model tensors
STEM = "frozen"
#: the tensor table frozen files belong to: the model's own
GROUP = "model"
#: the folder of a sharded checkpoint holding the DCP files of its frozen tensors, and their group
SHARDED_DIR = "dcp-frozen"
SHARDED_GROUP = "dcp-frozen"
#: errors of ``os.link`` that mean "no hard links here": the file is written instead
_NO_LINKS = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}


def names(model: torch.nn.Module) -> frozenset[str]:
    """The checkpoint names (``state_dict`` names, ``clean_name``) of the unwrapped ``model``'s
    parameters that do not require gradients, every name of a tied one."""
    return frozenset(clean_name(name) for name, p in model.named_parameters(remove_duplicate=False)
                     if not p.requires_grad)


def split(tensors: Mapping[str, torch.Tensor], frozen: frozenset[str]) -> tuple[dict[str, torch.Tensor],
                                                                              dict[str, torch.Tensor]]:
    """``tensors`` (the model table, key -> tensor) as (the others, the frozen ones)."""
    if not frozen:
        return dict(tensors), {}
    rest = {k: t for k, t in tensors.items() if k not in frozen}
    return rest, {k: t for k, t in tensors.items() if k in frozen}


def _filenames(num_files: int) -> list[str]:
    return [STEM + SUFFIX] if num_files == 1 else [f"{STEM}-{i:05d}{SUFFIX}" for i in range(num_files)]


def _linked(directory: Path, filename: str, earlier: Path, entry: FileEntry) -> bool:
    """Hard-links ``earlier/filename`` as ``directory/filename`` if it is intact (its size and
    checksum those of ``entry``); False where it is not, or the file system has no links."""
    try:
        _tensorfiles.verify_file(earlier / filename, entry)
    except CheckpointError:  # gone or damaged: written afresh
        return False
    try:
        os.link(earlier / filename, directory / filename)
    except FileNotFoundError:  # deleted between the check and the link
        return False
    except OSError as e:
        if e.errno in _NO_LINKS:
            return False
        raise
    return True


def write(directory: Path, tensors: Mapping[str, torch.Tensor], earlier: tuple[Path, Mapping[str, FileEntry]] | None,
          algorithm: str | None = None) -> tuple[dict[str, FileEntry], int]:
    """Writes the frozen ``tensors`` into ``directory`` (``frozen*.safetensors``, group
    ``model``), each file a hard link to ``earlier``'s identical one where it has one.

    Args:
        directory: the checkpoint's (temporary) directory.
        tensors: the frozen tensors, by key of the model table.
        earlier: the previous checkpoint's directory and its manifest's files, or None.
        algorithm: the checksum (one of ``_tensorfiles.ALGORITHMS``); by default the default.

    Returns:
        tuple: file name -> FileEntry, and the bytes written (0 when every file was linked).

    Raises:
        OSError: the file system refused (other than refusing a hard link).
        TypeError: a dtype that safetensors cannot store.
    """
    if not tensors:
        return {}, 0
    algorithm = algorithm or _tensorfiles.default()
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    shards = _tensorfiles.split_shards(tensors, _tensorfiles.shard_bytes(total))
    entries, written = {}, 0
    for filename, shard in zip(_filenames(len(shards)), shards):
        on_cpu = {k: t.to("cpu") for k, t in shard.items()}
        before = earlier[1].get(filename) if earlier is not None else None
        if before is not None and before.group == GROUP and before.checksum[0] == algorithm:
            digest, num_bytes = _tensorfiles.checksum(on_cpu, algorithm)
            if (digest, num_bytes) == (before.checksum[1], before.num_bytes) and _linked(
                    directory, filename, earlier[0], before):  # type: ignore[index]  # not None: `before` is set
                entries[filename] = FileEntry(group=GROUP, num_bytes=num_bytes, rank=None, **{algorithm: digest})
                continue
        digest, num_bytes = _tensorfiles.write_file(directory / filename, on_cpu, algorithm)
        entries[filename] = FileEntry(group=GROUP, num_bytes=num_bytes, rank=None, **{algorithm: digest})
        written += num_bytes
    return entries, written


@attrs.frozen
class Reuse:
    """The previous checkpoint's ``dcp-frozen/`` files, which hold what this save would write:
    its directory and the manifest's entries of those files (every rank's)."""

    earlier: Path
    files: dict[str, FileEntry]


def split_sharded(flat: Mapping[str, torch.Tensor], tables: ShardedTables, frozen: frozenset[str]
                  ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], ShardedTables]:
    """``flat`` (DCP key -> tensor, ``_sharded.split``) as the tensors of ``dcp/`` and the
    model's ``frozen`` ones (``names``), and ``tables`` with those moved from ``model``
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


def _offer(previous: tuple[Path, Manifest] | None) -> dict[str, Any] | None:
    """The previous checkpoint's directory, frozen table and ``dcp-frozen/`` entries as JSON
    (rank 0's offer), or None where it has no frozen table."""
    if previous is None:
        return None
    earlier, manifest = previous
    frozen = manifest.sharded.frozen if manifest.sharded is not None else None
    if frozen is None:
        return None
    return {"path": str(earlier), "frozen": unstructure(frozen),
            "files": {name: unstructure(e) for name, e in manifest.files.items() if e.group == SHARDED_GROUP}}


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


def plan(backend: ProcessContext, tables: ShardedTables, frozen: Mapping[str, torch.Tensor],
         previous: tuple[Path, Manifest] | None) -> tuple[ShardedTables, Reuse | None]:
    """``tables`` with every rank's checksum of its frozen shards, and the previous checkpoint
    whose ``dcp-frozen/`` files may be linked, or None (a collective: one exchange; rank 0
    gives ``previous``, the previous checkpoint of the same directory and its manifest, the
    others None)."""
    assert tables.frozen is not None, "split found frozen tensors"
    mine = local_checksum(frozen, tables.frozen.algorithm)
    sent = distributed.exchange([mine, _offer(previous) if backend.rank == 0 else None],
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


def _link_own(reuse: Reuse, rank: int, directory: Path, made: list[Path]) -> bool:
    """Hard-links this rank's previous files into ``directory`` (each link made added to
    ``made``); False where one could not be (any OSError: the ranks then write afresh)."""
    try:
        (directory / SHARDED_DIR).mkdir(exist_ok=True)
        for name in _own(reuse, rank):
            os.link(reuse.earlier / name, directory / name)
            made.append(directory / name)
    except OSError:
        return False
    return True


def write_sharded(backend: ProcessContext, directory: Path, reuse: Reuse | None,
                  afresh: Callable[[], dict[str, FileEntry]]) -> dict[str, FileEntry]:
    """Puts the frozen tensors into ``directory/dcp-frozen`` (a collective): every rank's files
    hard links to ``reuse``'s where every rank verified and linked its own, else written by
    ``afresh()`` (DCP, ``_sharded.write_shards``). Returns the FileEntry of every rank's
    files, the same on every rank.

    Raises:
        CheckpointError: on every rank, when some rank failed to write (``afresh``).
    """
    device, made = backend.collective_device, list[Path]()
    if reuse is not None and not distributed.any_rank(not _verified(reuse, backend.rank), device=device):
        if not distributed.any_rank(not _link_own(reuse, backend.rank, directory, made), device=device):
            return dict(reuse.files)
        for link in made:  # some rank could not link: all write afresh, never into a linked file
            with contextlib.suppress(FileNotFoundError):
                link.unlink()
    return afresh()
