"""``manifest.json``: the records of a checkpoint directory, through one cattrs converter.

The manifest is written last (a checkpoint without one is incomplete) and holds everything
but the tensors: versions, the world size, counters, each rank's RNG states and transform
states as plain data, the optimizer/scheduler/``extra`` skeletons whose tensors are
references into the ``.safetensors`` files, the program's transforms, and the checksum of
every tensor file (xxh3-128 from format version 4, sha256 before; ``_checksums``). Tensors
live in the files; nothing in a checkpoint is a pickle.

The manifest's own sha256 is in ``manifest.sha256`` (one line as ``sha256sum`` writes it,
so ``sha256sum -c manifest.sha256`` checks it too), written just before the manifest and
verified before the manifest is parsed. Format version 1 had no such file; its checkpoints
load without that check.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

import attrs
import cattrs
import orjson
import torch
from cattrs.gen import make_dict_unstructure_fn, override
from cattrs.preconf.orjson import make_converter

from accelfn.checkpoint._checksums import ALGORITHMS
from accelfn.errors import CheckpointError

#: 2: manifest.sha256 added; 3: records named by stable tags (``_tags``), not module paths;
#: 4: tensor files checked with xxh3_128, each file entry naming its algorithm (sha256 when
#: ``xxhash`` is not installed) (versions 1 to 3 still load)
FORMAT_VERSION = 4
#: 5: a sharded checkpoint (a ``sharded`` table, DCP files in ``dcp/``); unsharded ones stay at
#: FORMAT_VERSION, so that an older accelfn refuses only what it cannot read
SHARDED_FORMAT_VERSION = 5
MANIFEST = "manifest.json"
CHECKSUM = "manifest.sha256"
_SHA256 = re.compile(r"^([0-9a-f]{64})  " + re.escape(MANIFEST) + r"\n?$")


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


@attrs.frozen
class RankEntry:
    """What differs between ranks (the Snapshot fields of the same names), as encoded trees."""

    rng: Any
    transforms_state: Any
    grads: Any


@attrs.frozen
class ShardedTensor:
    """One tensor in a sharded checkpoint's DCP files: its global shape and dtype name."""

    shape: tuple[int, ...]
    dtype: str


@attrs.frozen
class ShardedTables:
    """Where the tensors in a sharded checkpoint's ``dcp/`` files belong (``_sharded``).

    Attributes:
        model: model ``state_dict`` name -> its tensor, stored under that name.
        aliases: a tied weight's other names -> the name it is stored under.
        optimizer: parameter name -> optimizer state key (``"exp_avg"``) -> its tensor,
            stored as ``optimizer/<parameter>/<key>``.
        grads: parameter name -> its open-window gradient, stored as ``grad/<parameter>``.
    """

    model: dict[str, ShardedTensor]
    aliases: dict[str, str]
    optimizer: dict[str, dict[str, ShardedTensor]]
    grads: dict[str, ShardedTensor]


@attrs.frozen
class Manifest:
    """Everything in a checkpoint but the tensors.

    After the format fields come the Snapshot's shared fields as trees encoded by
    ``accelfn.checkpoint._codec`` (tensors as references into the files), then each rank's entry and
    the tensor files with their checksums; a sharded checkpoint's ``sharded`` table says
    where the tensors in its DCP files belong (None in an unsharded one).
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
    sharded: ShardedTables | None = None


_converter = make_converter()
_converter.register_unstructure_hook(torch.dtype, str)
# a file entry names only the checksum it has; an unsharded checkpoint's manifest has no
# ``sharded`` key (it reads as None)
_converter.register_unstructure_hook(FileEntry, make_dict_unstructure_fn(FileEntry, _converter, _cattrs_omit_if_default=True))
_converter.register_unstructure_hook(
    Manifest, make_dict_unstructure_fn(Manifest, _converter, sharded=override(omit_if_default=True)))


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


def _write_durably(path: Path, data: bytes) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def write(directory: Path, manifest: Manifest) -> None:
    """Writes ``manifest.sha256``, then ``manifest.json``, into ``directory``, each durably
    and atomically (write, fsync, rename)."""
    data = dumps(manifest)
    _write_durably(directory / CHECKSUM, f"{hashlib.sha256(data).hexdigest()}  {MANIFEST}\n".encode())
    _write_durably(directory / MANIFEST, data)


def _expected_sha256(directory: Path) -> str | None:
    """The manifest's sha256 as ``manifest.sha256`` gives it, or None without that file."""
    path = directory / CHECKSUM
    try:
        text = path.read_text(encoding="ascii")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read the manifest's checksum ({e})") from None
    match = _SHA256.match(text)
    if match is None:
        raise CheckpointError(f"{path}: not a sha256 line for {MANIFEST} (\"<64 hex digits>  {MANIFEST}\"); "
                              "the file is corrupted")
    return match[1]


def _check(path: Path, manifest: Manifest) -> None:
    if manifest.world_size < 1 or manifest.world_size != len(manifest.ranks):
        raise CheckpointError(f"{path}: world_size {manifest.world_size} with {len(manifest.ranks)} rank "
                              "entries; the manifest is inconsistent")
    for name, entry in manifest.files.items():
        if sum(getattr(entry, algorithm) is not None for algorithm in ALGORITHMS) != 1:
            raise CheckpointError(f"{path}: files.{name} must have exactly one checksum "
                                  f"({' or '.join(ALGORITHMS)}); the manifest is inconsistent")
        if entry.rank is not None and not 0 <= entry.rank < manifest.world_size:
            raise CheckpointError(f"{path}: files.{name}.rank is {entry.rank}, outside the world of "
                                  f"{manifest.world_size}")


def read(directory: Path) -> Manifest:
    """The manifest of the checkpoint in ``directory``, verified against ``manifest.sha256``.

    Raises:
        CheckpointError: no manifest, an unreadable one, one whose sha256 differs from
            ``manifest.sha256`` or without that file (from format version 2 on), an
            inconsistent one, or a newer format version.
    """
    path = directory / MANIFEST
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the manifest ({e.strerror})") from None
    expected = _expected_sha256(directory)
    digest = hashlib.sha256(data).hexdigest()
    if expected is not None and digest != expected:
        raise CheckpointError(
            f"{path}: sha256 {digest} does not match {expected} in {CHECKSUM}; the manifest is "
            "corrupted or was changed after the checkpoint was written"
        )
    try:
        version = orjson.loads(data).get("format_version")
    except (orjson.JSONDecodeError, AttributeError):
        raise CheckpointError(f"{path}: not JSON; the manifest is corrupted") from None
    if isinstance(version, bool) or not isinstance(version, int) or version > SHARDED_FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format version {version!r}; this accelfn reads versions up to "
            f"{SHARDED_FORMAT_VERSION} (upgrade accelfn to load it)"
        )
    if expected is None and version >= 2:
        raise CheckpointError(f"{directory / CHECKSUM} is missing: a checkpoint of format version {version} "
                              f"has the sha256 of its {MANIFEST} in it; the checkpoint is incomplete")
    try:
        manifest = loads(data, Manifest)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    _check(path, manifest)
    return manifest
