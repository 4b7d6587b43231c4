"""``manifest.json``: the records of a checkpoint directory, through one cattrs converter.

The manifest is written last (a checkpoint without one is incomplete) and holds everything
but the tensors: versions, the world size, counters, each rank's RNG states and transform
states as plain data, the optimizer/scheduler/``extra`` skeletons whose tensors are
references into the ``.safetensors`` files, the program's transforms, and the sha256 of
every tensor file. Tensors live in the files; nothing in a checkpoint is a pickle.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs
import cattrs
import orjson
import torch
from cattrs.preconf.orjson import make_converter

from accelfn._errors import CheckpointError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


@attrs.frozen
class FileEntry:
    """One tensor file.

    Attributes:
        group: the tensor table it belongs to: ``"model"``, ``"state"`` (optimizer,
            scheduler, ``extra``) or ``"rank_00001"`` (one rank's own tensors).
        sha256: hex digest of the whole file.
        num_bytes: its size in bytes.
        rank: the rank whose own tensors (gradients of an open window) it holds, or None
            for a file every rank reads.
    """

    group: str
    sha256: str
    num_bytes: int
    rank: int | None = None


@attrs.frozen
class RankEntry:
    """What differs between ranks (the Snapshot fields of the same names), as encoded trees."""

    rng: Any
    transforms_state: Any
    grads: Any


@attrs.frozen
class Manifest:
    """Everything in a checkpoint but the tensors.

    After the format fields come the Snapshot's shared fields as trees encoded by
    ``accelfn._plain`` (tensors as references into the files), then each rank's entry and
    the tensor files with their checksums.
    """

    format_version: int
    accelfn_version: str
    torch_version: str
    world_size: int
    transforms: Any
    counters: Any
    model: Any
    optimizer_type: Any
    optimizer_params: Any
    optimizer: Any
    scheduler_type: Any
    scheduler: Any
    extra: Any
    ranks: tuple[RankEntry, ...]
    files: dict[str, FileEntry]


_converter = make_converter()
_converter.register_unstructure_hook(torch.dtype, str)


def unstructure(value: Any) -> Any:
    """Plain data for a record (``torch.dtype`` as its name), e.g. a transform."""
    return _converter.unstructure(value)


def dumps(value: Any) -> bytes:
    """JSON bytes of a record (orjson)."""
    return _converter.dumps(value)


def loads(data: bytes, cls: type) -> Any:
    """The record of type ``cls`` in JSON ``data``.

    Raises:
        CheckpointError: the data is not JSON, or does not have the record's structure.
    """
    try:
        return _converter.loads(data, cls)
    except (orjson.JSONDecodeError, cattrs.BaseValidationError, KeyError, TypeError, ValueError) as e:
        detail = "; ".join(cattrs.transform_error(e)) if isinstance(e, cattrs.BaseValidationError) else str(e)
        raise CheckpointError(f"not a valid accelfn {cls.__name__}: {detail}") from None


def write(directory: Path, manifest: Manifest) -> None:
    """Writes ``manifest.json`` into ``directory`` durably and atomically (write, fsync, rename)."""
    part = directory / (MANIFEST + ".part")
    with open(part, "wb") as f:
        f.write(dumps(manifest))
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, directory / MANIFEST)


def read(directory: Path) -> Manifest:
    """The manifest of the checkpoint in ``directory``.

    Raises:
        CheckpointError: no manifest, an unreadable one, or a newer format version.
    """
    path = directory / MANIFEST
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the manifest ({e.strerror})") from None
    try:
        version = orjson.loads(data).get("format_version")
    except (orjson.JSONDecodeError, AttributeError):
        raise CheckpointError(f"{path}: not JSON; the manifest is corrupted") from None
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format version {version!r}; this accelfn reads versions up to "
            f"{FORMAT_VERSION} (upgrade accelfn to load it)"
        )
    try:
        return loads(data, Manifest)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
