"""Corruptions of checkpoint files that pass their checksums: a tensor file's header edited,
the manifest's entries and ``manifest.sha256`` recomputed to match."""

from __future__ import annotations

import hashlib
import math
import random
import struct
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import xxhash

#: file name (relative to the checkpoint) -> its bytes
Files = dict[str, bytes]
Mutation = tuple[str, Files]
#: bytes per element of safetensors' dtypes
SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def signed(files: Files, changed: Files) -> Files:
    """``changed`` with the manifest's entries of the changed tensor files, and manifest.sha256,
    recomputed to match: the mutation passes every checksum."""
    data = changed.get("manifest.json", files["manifest.json"])
    tensor_files = {name: d for name, d in changed.items() if name.endswith(".safetensors")}
    if tensor_files:
        manifest = orjson.loads(data)
        for name, d in tensor_files.items():
            manifest["files"][name] |= {"num_bytes": len(d), "xxh3_128": xxhash.xxh3_128(d).hexdigest()}
        data = orjson.dumps(manifest)
    return {**changed, "manifest.json": data, "manifest.sha256": f"{hashlib.sha256(data).hexdigest()}  manifest.json\n".encode()}


def header(data: bytes) -> tuple[dict[str, Any], bytes]:
    """A safetensors file's JSON header and the bytes after it."""
    (length,) = struct.unpack_from("<Q", data)
    return orjson.loads(data[8:8 + length]), data[8 + length:]


def safetensors_file(head: dict[str, Any], body: bytes) -> bytes:
    """The safetensors file of ``head`` (padded to 8 bytes) and ``body``."""
    text = orjson.dumps(head)
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


def header_edits(rng: random.Random, files: Files, names: list[str], n: int,
                 keep_shape: Callable[[str], bool] = lambda key: False) -> Iterator[Mutation]:
    """``n`` edits of the headers of the tensor files ``names``, checksums recomputed: a tensor
    given another shape of as many elements, a scalar's shape made ``[1, 1, 1, 1, 1]``, another
    dtype (of the same size, or resized to the same bytes), another name, or dropped with its
    bytes. ``keep_shape(key)``: a tensor whose shape is left alone."""
    count = 0
    while count < n:
        name = rng.choice(names)
        head, body = header(files[name])
        key = rng.choice(sorted(k for k in head if k != "__metadata__"))
        entry, kind = head[key], rng.choice(["reshape", "scalar5", "dtype", "resize", "rename", "drop"])
        numel = math.prod(entry["shape"])
        if kind == "reshape" and numel and not keep_shape(key):
            shapes = [s for s in ([numel], [1, numel], [numel, 1], entry["shape"][::-1]) if s != entry["shape"]]
            if not shapes:
                continue
            entry["shape"] = rng.choice(shapes)
        elif kind == "scalar5" and numel == 1 and not keep_shape(key):
            entry["shape"] = [1, 1, 1, 1, 1]
        elif kind == "dtype":
            entry["dtype"] = rng.choice([d for d, s in SIZES.items() if s == SIZES[entry["dtype"]] and d != entry["dtype"]])
        elif kind == "resize" and numel:
            size = SIZES[entry["dtype"]]
            dtype = rng.choice([d for d, s in SIZES.items() if s != size and numel * size % s == 0])
            entry["dtype"], entry["shape"] = dtype, [numel * size // SIZES[dtype]]
        elif kind == "rename":
            head[key + "_"] = head.pop(key)
        elif kind == "drop":
            start, end = head.pop(key)["data_offsets"]
            body = body[:start] + body[end:]
            for other in (v for k, v in head.items() if k != "__metadata__" and v["data_offsets"][0] >= end):
                other["data_offsets"] = [o - (end - start) for o in other["data_offsets"]]
        else:
            continue
        count += 1
        yield f"{kind} {key} in {name}, signed", signed(files, {name: safetensors_file(head, body)})
