"""One ``.safetensors`` file written and hashed in one pass; read and verified in one pass.

Writing: the file is laid out in the safetensors format (an 8-byte little-endian header
length, the JSON header padded with spaces to a multiple of 8, then the tensors' raw bytes,
largest elements first so each tensor stays aligned to its element size) and streamed in
chunks of ``CHUNK_BYTES``; each chunk is hashed right after it is written, while it is
still in the CPU cache, so the bytes are read from memory once. The format is the
documented one (https://huggingface.co/docs/safetensors); files are read by ``safetensors``
itself, which validates the header.

Reading: ``safetensors`` maps the file; the header bytes and then every tensor's bytes in
file order are hashed, which is the hash of the whole file (safetensors checks that the
tensors cover the data exactly; the size is checked against the manifest first). Hashing
is what first reads the file's pages, so the caller's copy of the tensors, once the
checksum matched, reads memory: the file is read once.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from pathlib import Path

import orjson
import safetensors.torch
import torch

from accelfn.checkpoint import _checksums
from accelfn.errors import CheckpointError

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


def write(path: Path, tensors: Mapping[str, torch.Tensor], algorithm: str) -> tuple[str, int]:
    """Writes ``tensors`` (CPU tensors, any layout) as the safetensors file ``path``, fsynced.

    Returns:
        tuple: the hex checksum of the file by ``algorithm`` and its size in bytes.

    Raises:
        OSError: the file system refused.
        TypeError: a dtype that safetensors cannot store.
    """
    hasher = _checksums.new(algorithm)
    contiguous = {k: t.detach().to("cpu").contiguous() for k, t in tensors.items()}
    prefix, order = _header(contiguous)
    size = len(prefix)
    with open(path, "wb") as f:
        f.write(prefix)
        hasher.update(prefix)
        for key in order:
            data = _bytes(contiguous[key])
            for start in range(0, len(data), CHUNK_BYTES):
                chunk = data[start:start + CHUNK_BYTES]
                f.write(chunk)  # a buffered file writes all of it, or raises
                hasher.update(chunk)
            size += len(data)
        f.flush()
        os.fsync(f.fileno())
    return hasher.hexdigest(), size


def _prefix(path: Path) -> bytes:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return head
        (length,) = struct.unpack("<Q", head)
        return head + f.read(min(length, 100 << 20))


def read(path: Path, algorithm: str, expected: str, num_bytes: int) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``path`` (mapped to it, copy-on-write), once its
    size and checksum match; hashing them faults their pages in, so the caller's copy of
    them reads memory, not the file.

    Args:
        path: the file.
        algorithm: the checksum's algorithm (``accelfn.checkpoint._checksums``).
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
    hasher = _checksums.new(algorithm)
    prefix = _prefix(path)
    hasher.update(prefix)
    covered = len(prefix)
    try:
        tensors = safetensors.torch.load_file(path)
        offsets = {key: entry["data_offsets"][0] for key, entry in orjson.loads(prefix[8:]).items()
                   if key != "__metadata__"}
    except Exception:  # safetensors raises its own error types for a damaged header
        tensors, offsets, covered = {}, {}, -1  # the message below names the damage
    if offsets.keys() != tensors.keys():
        tensors, covered = {}, -1
    for key in sorted(tensors, key=offsets.__getitem__):  # file order: the hash of the whole file
        data = _bytes(tensors[key])
        hasher.update(data)
        covered += len(data)
    digest = hasher.hexdigest()
    if covered != size or digest != expected:
        found = f"{algorithm} {digest}" if covered == size else "a safetensors header that does not parse"
        raise CheckpointError(f"{path}: {found} does not match the manifest's {algorithm} {expected}; the file "
                              "is corrupted or was changed after the checkpoint was written")
    return tensors
