"""Tensor files of a checkpoint: ``.safetensors`` written, fsynced and hashed; read verified.

Each group of tensors (the model's, the optimizer's and other states', each rank's own) is
written with ``safetensors`` in shards of at most ``SHARD_BYTES``. While the next shard is
written, worker threads fsync and sha256 the previous ones (``hashlib`` and the file
system release the GIL), so hashing costs little wall time. Loading verifies every file's
size and sha256 in parallel before any tensor is used.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import safetensors.torch
import torch

from accelfn._errors import CheckpointError
from accelfn._manifest import FileEntry

SHARD_BYTES = 1 << 30
SUFFIX = ".safetensors"


def _workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def sha256_file(path: Path) -> str:
    """Hex sha256 of the file at ``path`` (read through a memory map)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                digest.update(m)
    return digest.hexdigest()


def _sync_and_hash(path: Path, group: str, rank: int | None) -> FileEntry:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
        size = os.fstat(f.fileno()).st_size
    return FileEntry(group=group, sha256=sha256_file(path), num_bytes=size, rank=rank)


def _shards(tensors: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    return shards


def write(directory: Path, groups: Mapping[str, tuple[Mapping[str, torch.Tensor], int | None]]) -> dict[str, FileEntry]:
    """Writes each group ``name -> (tensors, rank)`` as ``name.safetensors`` (or
    ``name-00000.safetensors``, ... when larger than a shard), fsynced and hashed.

    Empty groups write no file. Tensors are moved to the CPU one shard at a time.

    Returns:
        dict: file name -> its FileEntry.
    """
    futures = {}
    with ThreadPoolExecutor(max_workers=_workers()) as pool:
        for name, (tensors, rank) in groups.items():
            if not tensors:
                continue
            shards = _shards(tensors)
            for i, shard in enumerate(shards):
                filename = name + SUFFIX if len(shards) == 1 else f"{name}-{i:05d}{SUFFIX}"
                cpu = {k: t.to("cpu") for k, t in shard.items()}
                safetensors.torch.save_file(cpu, directory / filename)
                del cpu
                futures[filename] = pool.submit(_sync_and_hash, directory / filename, name, rank)
        return {name: future.result() for name, future in futures.items()}


def _verify(path: Path, entry: FileEntry) -> None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"{path}: the tensor file is missing; the checkpoint is incomplete") from None
    if size != entry.num_bytes:
        raise CheckpointError(
            f"{path}: {size} bytes, but the manifest says {entry.num_bytes}; the file is "
            "truncated or was changed after the checkpoint was written"
        )
    digest = sha256_file(path)
    if digest != entry.sha256:
        raise CheckpointError(
            f"{path}: sha256 {digest} does not match the manifest's {entry.sha256}; the file "
            "is corrupted or was changed after the checkpoint was written"
        )


def read(directory: Path, files: Mapping[str, FileEntry]) -> dict[str, dict[str, torch.Tensor]]:
    """The tensors of ``files`` by group, after verifying each file's size and sha256.

    Tensors are memory-mapped (copy-on-write): copy them before the files may go away.

    Raises:
        CheckpointError: a missing, truncated or corrupted file (the message names it), or
            two files of a group holding the same tensor.
    """
    with ThreadPoolExecutor(max_workers=_workers()) as pool:
        for future in [pool.submit(_verify, directory / name, entry) for name, entry in files.items()]:
            future.result()
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, entry in files.items():
        table = groups.setdefault(entry.group, {})
        for key, t in safetensors.torch.load_file(directory / name).items():
            if key in table:
                raise CheckpointError(f"{directory / name}: tensor {key!r} is also in another file")
            table[key] = t
    return groups
