"""Tensor files of a checkpoint: ``.safetensors`` written hashed and fsynced; read verified.

Each group of tensors (the model's, the optimizer's and other states', each rank's own) is
written in shards of at most ``MAX_SHARD_BYTES``, one shard per worker thread at a time:
each file is hashed while it is written and fsynced (``_hashed_io``; writing, hashing and
fsync release the GIL). Loading reads every file in parallel, hashing it as its pages are
first read, and returns its tensors only once its size and checksum match the manifest.
The checksum is XXH3-128 (``_checksums``), which runs at memory speed; sha256 files of
format versions up to 3 are still verified.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from accelfn.checkpoint import _checksums, _hashed_io
from accelfn.checkpoint._manifest import FileEntry
from accelfn.errors import CheckpointError

#: shard sizes: at most MAX_SHARD_BYTES, and small enough for every core to write one
#: (but not below MIN_SHARD_BYTES, where fsyncs of many files cost more than they save)
MAX_SHARD_BYTES = 256 << 20
MIN_SHARD_BYTES = 16 << 20
SUFFIX = ".safetensors"


def _workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def shard_bytes(total_bytes: int) -> int:
    """The shard size for a state of ``total_bytes``: one shard per core, within bounds."""
    return max(MIN_SHARD_BYTES, min(MAX_SHARD_BYTES, -(-total_bytes // (os.cpu_count() or 1))))


def _shards(tensors: Mapping[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        if shards[-1] and size + _nbytes(t) > limit:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += _nbytes(t)
    return shards


def write(directory: Path, groups: Mapping[str, tuple[Mapping[str, torch.Tensor], int | None]],
          algorithm: str | None = None) -> dict[str, FileEntry]:
    """Writes each group ``name -> (tensors, rank)`` as ``name.safetensors`` (or
    ``name-00000.safetensors``, ... when larger than a shard), hashed and fsynced.

    Files are written in parallel threads, each hashed as it is written. Empty groups
    write no file. Tensors are moved to the CPU (in the calling thread) one shard at a time.

    Args:
        directory: where to write.
        groups: the tensors of each group, and the rank whose own they are (or None).
        algorithm: the checksum (``_checksums.ALGORITHMS``); by default ``_checksums.default()``.

    Returns:
        dict: file name -> its FileEntry.

    Raises:
        OSError: the file system refused (the first failure, in file order).
    """
    algorithm = algorithm or _checksums.default()
    jobs: list[tuple[str, str, int | None, Future[tuple[str, int]]]] = []
    limit = shard_bytes(sum(_nbytes(t) for tensors, _ in groups.values() for t in tensors.values()))
    with ThreadPoolExecutor(max_workers=_workers()) as pool:
        for name, (tensors, rank) in groups.items():
            if not tensors:
                continue
            shards = _shards(tensors, limit)
            for i, shard in enumerate(shards):
                filename = name + SUFFIX if len(shards) == 1 else f"{name}-{i:05d}{SUFFIX}"
                on_cpu = {k: t.to("cpu") for k, t in shard.items()}
                jobs.append((filename, name, rank, pool.submit(_hashed_io.write, directory / filename, on_cpu, algorithm)))
        entries = {}
        for filename, group, rank, job in jobs:
            digest, num_bytes = job.result()
            entries[filename] = FileEntry(group=group, num_bytes=num_bytes, rank=rank, **{algorithm: digest})
        return entries


def read(directory: Path, files: Mapping[str, FileEntry]) -> dict[str, dict[str, torch.Tensor]]:
    """The tensors of ``files`` by group, every file's size and checksum verified.

    The tensors stay mapped to their files (copy-on-write, their pages already read): copy
    them before the files may go away.

    Raises:
        CheckpointError: a missing, truncated or corrupted file (the message names it; the
            first in the manifest's order), or two files of a group holding the same tensor.
    """
    groups: dict[str, dict[str, torch.Tensor]] = {}
    with ThreadPoolExecutor(max_workers=_workers()) as pool:
        jobs = {name: pool.submit(_hashed_io.read, directory / name, *entry.checksum, entry.num_bytes)
                for name, entry in files.items()}
        for name, entry in files.items():
            table = groups.setdefault(entry.group, {})
            for key, t in jobs[name].result().items():
                if key in table:
                    raise CheckpointError(f"{directory / name}: tensor {key!r} is also in another file")
                table[key] = t
    return groups


def hash_file(path: Path, algorithm: str | None = None) -> tuple[str, str]:
    """``(algorithm, hex digest)`` of the whole file at ``path``, read through a memory map:
    for files another writer made (DCP's shard files), which cannot be hashed as written."""
    algorithm = algorithm or _checksums.default()
    hasher = _checksums.new(algorithm)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                hasher.update(memoryview(m))
    return algorithm, hasher.hexdigest()


def verify_file(path: Path, entry: FileEntry) -> None:
    """Raises unless the file at ``path`` has the size and checksum ``entry`` records.

    Raises:
        CheckpointError: the file is missing, of another size, or of another checksum
            (the message names the file).
    """
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"{path}: the tensor file is missing; the checkpoint is incomplete") from None
    if size != entry.num_bytes:
        raise CheckpointError(f"{path}: {size} bytes, but the manifest says {entry.num_bytes}; the file is "
                              "truncated or was changed after the checkpoint was written")
    algorithm, expected = entry.checksum
    _, digest = hash_file(path, algorithm)
    if digest != expected:
        raise CheckpointError(f"{path}: {algorithm} {digest} does not match the manifest's {algorithm} {expected}; "
                              "the file is corrupted or was changed after the checkpoint was written")
