"""Tensor files: ``.safetensors`` written and hashed in one pass and fsynced, read and
verified in one pass, by the checksum a manifest names (``xxh3_128``, or ``sha256``).

Each group of tensors (the model's, the optimizer's and other states', each rank's own) is
written in shards of at most ``MAX_SHARD_BYTES``, one shard per worker thread at a time
(writing, hashing and fsync release the GIL). A file is laid out in the safetensors format
(an 8-byte little-endian header length, the JSON header padded with spaces to a multiple
of 8, then the tensors' raw bytes, largest elements first so each tensor stays aligned to
its element size; https://huggingface.co/docs/safetensors) and streamed in chunks of
``CHUNK_BYTES``, each hashed right after it is written, while it is still in the CPU cache.
Reading maps the whole file (copy-on-write), hashes the mapping in one call, checks the
header as safetensors' own reader does, and views each tensor into the mapping; hashing is
what first reads the file's pages, so the caller's copy of the tensors, once the checksum
matched, reads memory: the file is read once.

The checksum is XXH3-128 (the ``xxhash`` package): a non-cryptographic hash built for
checksums at memory speed (measured on 96 MiB here: 13 GB/s on one core, and the package
releases the GIL, so files hash in parallel; sha256 ran at 0.8 GB/s, crc32c at 5.3 GB/s,
blake3 at 1.5 GB/s). Its 128 bits make an undetected accidental corruption vanishingly
unlikely; it does not protect against a deliberate forgery, which a checkpoint beside its
own manifest could not anyway. Format versions up to 3 used sha256, which is still read
(and written, when ``xxhash`` is not installed).

References:
    Y. Collet, "xxHash - Extremely fast hash algorithm", https://xxhash.com (XXH3).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import mmap
import os
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Protocol, TypeVar

import attrs
import orjson
import torch

from accelfn.errors import CheckpointError

try:  # a dependency of accelfn; an install without it writes sha256 and reads xxh3 with a clear error
    import xxhash
except ImportError:  # pragma: no cover - where xxhash is not installed
    xxhash = None  # type: ignore[assignment]

#: the algorithms a manifest may name, fastest first
ALGORITHMS = ("xxh3_128", "sha256")


class Hasher(Protocol):
    """An incremental hash (``hashlib``'s interface)."""

    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


def default() -> str:
    """The algorithm new checkpoints use: ``"xxh3_128"``, or ``"sha256"`` without ``xxhash``."""
    return "xxh3_128" if xxhash is not None else "sha256"


def new(algorithm: str) -> Hasher:
    """A fresh hasher of ``algorithm`` (one of ``ALGORITHMS``).

    Raises:
        CheckpointError: an unknown algorithm, or ``xxh3_128`` without ``xxhash`` installed.
    """
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "xxh3_128":
        if xxhash is None:
            raise CheckpointError("this checkpoint's files are checked with xxh3_128, which needs the xxhash "
                                  "package (a dependency of accelfn): pip install xxhash")
        return xxhash.xxh3_128()
    raise CheckpointError(f"unknown checksum algorithm {algorithm!r}; this accelfn knows {', '.join(ALGORITHMS)} "
                          "(a newer accelfn wrote it?)")


@attrs.frozen
class FileEntry:
    """One tensor file.

    Attributes:
        group: the tensor table it belongs to: ``"model"``, ``"state"`` (optimizer,
            scheduler, ``extra``) or ``"rank_00001"`` (one rank's own tensors).
        num_bytes: its size in bytes.
        rank: the rank whose own tensors (gradients of an open window) it holds, or None
            for a file every rank reads.
        xxh3_128: hex XXH3-128 of the whole file (format version 4 on), or None.
        sha256: hex sha256 of the whole file (format versions up to 3, and 4 without
            ``xxhash``), or None. Exactly one of the two is set.
    """

    group: str
    num_bytes: int
    rank: int | None = None
    xxh3_128: str | None = None
    sha256: str | None = None

    @property
    def checksum(self) -> tuple[str, str]:
        """``(algorithm, hex digest)`` of the file."""
        for algorithm in ALGORITHMS:
            digest = getattr(self, algorithm)
            if digest is not None:
                return algorithm, digest
        raise AssertionError("a FileEntry without a checksum passed _check")


#: the unit of writing and hashing (small enough to stay in the CPU's cache in between)
CHUNK_BYTES = 1 << 20
#: safetensors' dtype names (https://huggingface.co/docs/safetensors, "Format")
_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64", torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def _bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    return t.detach().reshape(-1).view(torch.uint8).numpy().data


def _header(tensors: Mapping[str, torch.Tensor]) -> tuple[bytes, list[str]]:
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header, offset = {}, 0
    for key in order:
        t = tensors[key]
        if t.dtype not in _DTYPES:
            raise TypeError(f"tensor {key!r} has dtype {t.dtype}, which safetensors cannot store; "
                            f"supported: {', '.join(str(d) for d in _DTYPES)}")
        size = t.numel() * t.element_size()
        header[key] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    data = orjson.dumps(header)
    data += b" " * (-len(data) % 8)
    return struct.pack("<Q", len(data)) + data, order


def _chunks(tensors: Mapping[str, torch.Tensor]) -> Iterator[bytes | memoryview]:
    """The bytes of the safetensors file of ``tensors`` (CPU tensors, any layout), in chunks of
    at most ``CHUNK_BYTES``: its header, then each tensor's raw bytes."""
    contiguous = {k: t.detach().to("cpu").contiguous() for k, t in tensors.items()}
    prefix, order = _header(contiguous)
    yield prefix
    for key in order:
        data = _bytes(contiguous[key])
        for start in range(0, len(data), CHUNK_BYTES):
            yield data[start:start + CHUNK_BYTES]


def write_file(path: Path, tensors: Mapping[str, torch.Tensor], algorithm: str) -> tuple[str, int]:
    """Writes ``tensors`` (CPU tensors, any layout) as the safetensors file ``path``, fsynced.

    Returns:
        tuple: the hex checksum of the file by ``algorithm`` and its size in bytes.

    Raises:
        OSError: the file system refused.
        TypeError: a dtype that safetensors cannot store.
    """
    hasher = new(algorithm)
    size = 0
    with open(path, "wb") as f:
        for chunk in _chunks(tensors):
            f.write(chunk)  # a buffered file writes all of it, or raises
            hasher.update(chunk)
            size += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return hasher.hexdigest(), size


def checksum(tensors: Mapping[str, torch.Tensor], algorithm: str) -> tuple[str, int]:
    """The hex checksum by ``algorithm`` and the size in bytes of the file ``write_file``
    would write for ``tensors``, computed in memory (nothing is written).

    Raises:
        TypeError: a dtype that safetensors cannot store.
    """
    hasher = new(algorithm)
    size = 0
    for chunk in _chunks(tensors):
        hasher.update(chunk)
        size += len(chunk)
    return hasher.hexdigest(), size


#: safetensors' dtype names back to torch's
_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}
#: the largest header read (safetensors' own limit)
MAX_HEADER_BYTES = 100 << 20


def _tensor_table(data: memoryview) -> dict[str, tuple[torch.dtype, list[int], int, int]] | None:
    """``key -> (dtype, shape, start, end)`` (byte offsets into ``data``) of the safetensors
    file ``data``, or None where its header does not parse or does not describe the file
    exactly: the checks of safetensors' own reader (a JSON object of known dtypes and
    non-negative shapes whose byte ranges fit their shapes and tile the data after the header
    without a gap or an overlap; https://huggingface.co/docs/safetensors, "Format")."""
    if len(data) < 8:
        return None
    (length,) = struct.unpack_from("<Q", data, 0)
    if length > min(MAX_HEADER_BYTES, len(data) - 8):
        return None
    try:
        header = orjson.loads(data[8:8 + length])
    except orjson.JSONDecodeError:
        return None
    if not isinstance(header, dict):
        return None
    table, base = {}, 8 + length
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = _TORCH_DTYPES[entry["dtype"]], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            return None
        if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)
                and type(start) is int and type(end) is int and 0 <= start <= end
                and end - start == math.prod(shape) * dtype.itemsize):
            return None
        table[key] = (dtype, shape, base + start, base + end)
    position = base
    for _, _, start, end in sorted(table.values(), key=lambda entry: (entry[2], entry[3])):
        if start != position:
            return None
        position = end
    return table if position == len(data) else None


def read_header(path: Path) -> tuple[dict[str, tuple[torch.dtype, list[int]]], dict[str, Any]] | None:
    """The tensors (``key -> (dtype, shape)``) and the ``__metadata__`` of the safetensors file
    ``path``, one another writer made (DCP's), or None where its header does not parse or does
    not describe the file exactly (the checks of ``_tensor_table``); reads the header only."""
    with open(path, "rb") as f:
        if not os.fstat(f.fileno()).st_size:
            return None
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            view = memoryview(data)
            table = _tensor_table(view)
            head = bytes(view[8:8 + struct.unpack_from("<Q", view, 0)[0]]) if table is not None else b""
            view.release()
    if table is None:
        return None
    metadata = orjson.loads(head).get("__metadata__")
    tensors = {key: (dtype, shape) for key, (dtype, shape, _, _) in table.items()}
    return tensors, metadata if isinstance(metadata, dict) else {}


def _tensor(data: mmap.mmap, dtype: torch.dtype, shape: list[int], start: int, end: int) -> torch.Tensor:
    if end == start:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype, count=(end - start) // dtype.itemsize, offset=start).view(shape)


def read_file(path: Path, algorithm: str, expected: str, num_bytes: int) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``path`` (mapped to it, copy-on-write), once its
    size and checksum match; hashing the whole mapping faults its pages in, so the caller's
    copy of the tensors reads memory, not the file.

    The file is mapped by this module, not by ``safetensors.torch.load_file``: hashing one
    mapping in one call and viewing tensors into it costs 4.9 ms for 96 MiB where
    ``load_file`` and hashing tensor by tensor cost 8 ms (50 against 83 ms for 1 GiB, 2
    cores); its header gets the checks safetensors' reader makes (``_tensor_table``).

    Args:
        path: the file.
        algorithm: the checksum's algorithm (one of ``ALGORITHMS``).
        expected: the checksum's hex digest, from the manifest.
        num_bytes: the file's size, from the manifest.

    Raises:
        CheckpointError: the file is missing, has another size, does not parse, or its
            checksum differs; the message names the file.
    """
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"{path}: the tensor file is missing; the checkpoint is incomplete") from None
    if size != num_bytes:
        raise CheckpointError(f"{path}: {size} bytes, but the manifest says {num_bytes}; the file is "
                              "truncated or was changed after the checkpoint was written")
    hasher = new(algorithm)
    with open(path, "rb") as f:  # private and writable: a tensor written to later copies its page
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
    view = memoryview(data) if data is not None else memoryview(b"")
    hasher.update(view)
    table = _tensor_table(view)
    view.release()
    digest = hasher.hexdigest()
    if table is None or digest != expected:
        found = f"{algorithm} {digest}" if table is not None else "a safetensors header that does not parse"
        raise CheckpointError(f"{path}: {found} does not match the manifest's {algorithm} {expected}; the file "
                              "is corrupted or was changed after the checkpoint was written")
    assert data is not None  # a file without a header does not parse
    return {key: _tensor(data, *entry) for key, entry in table.items()}


#: shard sizes: at most MAX_SHARD_BYTES, and small enough for every core to write one
#: (but not below MIN_SHARD_BYTES, where fsyncs of many files cost more than they save)
MAX_SHARD_BYTES = 256 << 20
MIN_SHARD_BYTES = 16 << 20
SUFFIX = ".safetensors"


#: threads that write, read and hash files (one per core, at most 8)
WORKERS = max(1, min(8, os.cpu_count() or 1))
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid, the pool of that process)
_T = TypeVar("_T")
_R = TypeVar("_R")


def in_parallel(fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
    """``[fn(item) for item in items]``, the items spread over the calling thread and the
    file threads (one per core, at most 8, made once per process: starting threads for every
    load costs milliseconds on a busy machine). Each thread, the calling one too, takes the
    next item not yet taken until none is left, so that the items' work splits evenly however
    their sizes differ (pass the largest first); one item costs no thread hand-off at all.
    Every item has finished before this returns or raises (the first failure in item order).
    Never call it from ``fn`` (a job waiting for a job of the same pool could wait forever)."""
    if len(items) <= 1:
        return [fn(item) for item in items]
    global _pool
    if _pool is None or _pool[0] != os.getpid():  # a forked child has no threads of its parent's pool
        _pool = (os.getpid(), ThreadPoolExecutor(max_workers=WORKERS - 1 or 1, thread_name_prefix="accelfn-files"))
    taken = itertools.count()  # next() of a count is atomic: each index is taken once
    outcomes: list[tuple[bool, Any]] = [(False, None)] * len(items)

    def drain() -> None:
        while (i := next(taken)) < len(items):
            try:
                outcomes[i] = (True, fn(items[i]))
            except Exception as e:  # raised below, in item order, once every item has finished
                outcomes[i] = (False, e)

    helpers = [_pool[1].submit(drain) for _ in range(min(WORKERS - 1 or 1, len(items) - 1))]
    try:
        drain()
    finally:
        wait(helpers)  # all of them, even when one fails: none is left running
    for helper in helpers:
        helper.result()  # what a helper raised outside fn's exceptions
    for ok, value in outcomes:
        if not ok:
            raise value
    return [value for _, value in outcomes]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def shard_bytes(total_bytes: int) -> int:
    """The shard size for a state of ``total_bytes``: one shard per core, within bounds."""
    return max(MIN_SHARD_BYTES, min(MAX_SHARD_BYTES, -(-total_bytes // (os.cpu_count() or 1))))


def split_shards(tensors: Mapping[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """``tensors`` in order, cut into shards of at most ``limit`` bytes (a larger tensor alone)."""
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
        algorithm: the checksum (one of ``ALGORITHMS``); by default ``default()``.

    Returns:
        dict: file name -> its FileEntry.

    Raises:
        OSError: the file system refused (the first failure, in file order).
    """
    algorithm = algorithm or default()
    jobs: list[tuple[str, str, int | None, Future[tuple[str, int]]]] = []
    limit = shard_bytes(sum(_nbytes(t) for tensors, _ in groups.values() for t in tensors.values()))
    # threads of its own, not threads(): they inherit the priority of the calling thread,
    # which a background save lowers so that training wins where both compete for a core
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        for name, (tensors, rank) in groups.items():
            if not tensors:
                continue
            shards = split_shards(tensors, limit)
            for i, shard in enumerate(shards):
                filename = name + SUFFIX if len(shards) == 1 else f"{name}-{i:05d}{SUFFIX}"
                on_cpu = {k: t.to("cpu") for k, t in shard.items()}
                jobs.append((filename, name, rank, pool.submit(write_file, directory / filename, on_cpu, algorithm)))
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
    def verified(name: str) -> dict[str, torch.Tensor] | CheckpointError:
        try:
            return read_file(directory / name, *files[name].checksum, files[name].num_bytes)
        except CheckpointError as e:
            return e

    names = sorted(files, key=lambda name: -files[name].num_bytes)  # the calling thread reads the largest
    found = dict(zip(names, in_parallel(verified, names)))
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, entry in files.items():
        tensors = found[name]
        if isinstance(tensors, CheckpointError):
            raise tensors
        table = groups.setdefault(entry.group, {})
        for key, t in tensors.items():
            if key in table:
                raise CheckpointError(f"{directory / name}: tensor {key!r} is also in another file")
            table[key] = t
    return groups


def hash_file(path: Path, algorithm: str | None = None) -> tuple[str, str]:
    """``(algorithm, hex digest)`` of the whole file at ``path``, read through a memory map:
    for files another writer made (DCP's shard files), which cannot be hashed as written."""
    algorithm = algorithm or default()
    hasher = new(algorithm)
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


def pack_tensors(header: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``header`` (JSON) and ``tensors`` as bytes in a uint8 tensor, to send to another rank:
    the JSON header with each tensor's key, dtype and shape, then the tensors' raw bytes
    (never pickled)."""
    flat = [t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()]
    data = orjson.dumps({**header, "tensors": [[key, str(t.dtype).removeprefix("torch."), list(t.shape)]
                                               for key, t in tensors.items()]})
    head = torch.frombuffer(bytearray(struct.pack("<Q", len(data)) + data), dtype=torch.uint8)
    return torch.cat([head, *flat])


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown tensor dtype {name!r} from another rank")
    return dtype


def unpack_tensors(data: torch.Tensor) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The header and tensors ``pack_tensors`` packed.

    Raises:
        CheckpointError: a tensor of a dtype this torch does not know.
    """
    raw = data.numpy().tobytes()
    (length,) = struct.unpack_from("<Q", raw)
    header = orjson.loads(raw[8:8 + length])
    tensors, offset = {}, 8 + length
    for key, dtype_name, shape in header["tensors"]:
        dtype = _dtype(dtype_name)
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        tensors[key] = data[offset:offset + nbytes].clone().view(dtype).reshape(shape)
        offset += nbytes
    return header, tensors
