"""A Snapshot to and from a checkpoint directory's files, and each rank's part on the wire.

Files: ``model.safetensors`` (the unwrapped model's tensors under their own names, tied
weights once), ``state.safetensors`` (optimizer, scheduler and ``extra`` tensors),
``rank_00000.safetensors``, ... (tensors that differ per rank: open-window gradients and
transform-state tensors; written only when there are any), then ``manifest.sha256`` and
``manifest.json`` last.

What differs per rank (RNG states, transform states, open-window gradients) travels to the
writer as bytes in a uint8 tensor over the backend's own collectives: a JSON header (the
rank's entry and its tensors' dtypes and shapes) followed by the raw tensor bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import attrs
import orjson
import torch

from accelfn._version import __version__
from accelfn.checkpoint import _manifest, _tensorfiles
from accelfn.checkpoint._codec import Encoder, decode, field_problems
from accelfn.checkpoint._context import ProcessContext
from accelfn.checkpoint._manifest import FileEntry, Manifest, RankEntry, ShardedTables
from accelfn.checkpoint.snapshots import TRANSIENT, Snapshot
from accelfn.errors import CheckpointError

RankPart = tuple[RankEntry, dict[str, torch.Tensor]]
#: Snapshot fields that differ between ranks (in each RankEntry) and those every rank shares
#: (in the Manifest); the model's tensors go to their own table, under their own names
PER_RANK: tuple[str, ...] = tuple(f.name for f in attrs.fields(RankEntry))
SHARED: tuple[str, ...] = tuple(f.name for f in attrs.fields(Snapshot) if f.name not in PER_RANK)


def _rank_group(rank: int) -> str:
    return f"rank_{rank:05d}"


def rank_part(snap: Snapshot) -> RankPart:
    """This rank's entry and its tensors (open-window gradients, transform-state tensors)."""
    encoder = Encoder()
    entry = RankEntry(**{name: encoder.encode(getattr(snap, name), name) for name in PER_RANK})
    return entry, encoder.tensors


def _pack(part: RankPart) -> torch.Tensor:
    entry, tensors = part
    flat = [t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()]
    header = orjson.dumps({
        "entry": _manifest.unstructure(entry),
        "tensors": [[key, str(t.dtype).removeprefix("torch."), list(t.shape)] for key, t in tensors.items()],
    })
    head = torch.frombuffer(bytearray(struct.pack("<Q", len(header)) + header), dtype=torch.uint8)
    return torch.cat([head, *flat])


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown tensor dtype {name!r} from another rank")
    return dtype


def _unpack(data: torch.Tensor) -> RankPart:
    raw = data.numpy().tobytes()
    (length,) = struct.unpack_from("<Q", raw)
    header = orjson.loads(raw[8:8 + length])
    entry = _manifest.loads(orjson.dumps(header["entry"]), RankEntry)
    tensors, offset = {}, 8 + length
    for key, dtype_name, shape in header["tensors"]:
        dtype = _dtype(dtype_name)
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        tensors[key] = data[offset:offset + nbytes].clone().view(dtype).reshape(shape)
        offset += nbytes
    return entry, tensors


def gather_parts(backend: ProcessContext, part: RankPart) -> list[RankPart]:
    """Every rank's part, in rank order (a collective: call it on every rank)."""
    payload = _pack(part)
    lengths = backend.gather(torch.tensor([payload.numel()], dtype=torch.int64)).cpu().tolist()
    data = backend.gather(payload).cpu()
    parts, offset = [], 0
    for n in lengths:
        parts.append(_unpack(data[offset:offset + n]))
        offset += n
    return parts


def write(directory: Path, snap: Snapshot, parts: list[RankPart], transforms: Any, *,
          sharded: ShardedTables | None = None, files: Mapping[str, FileEntry] = MappingProxyType({})) -> None:
    """Writes ``snap`` (with every rank's part) into ``directory``: tensor files, then the
    manifest, which also lists ``files`` written already (a sharded checkpoint's DCP files,
    whose tensors ``sharded`` places)."""
    encoders = {"model": Encoder(), "state": Encoder()}
    trees = {name: encoders[_table(name)].encode(getattr(snap, name), "" if name == "model" else name)
             for name in SHARED}
    groups: dict[str, tuple[Mapping[str, torch.Tensor], int | None]] = {
        table: (encoder.tensors, None) for table, encoder in encoders.items()
    }
    for rank, (_, tensors) in enumerate(parts):
        groups[_rank_group(rank)] = (tensors, rank)
    written = _tensorfiles.write(directory, groups)
    _manifest.write(directory, Manifest(
        format_version=_manifest.FORMAT_VERSION if sharded is None else _manifest.SHARDED_FORMAT_VERSION,
        accelfn_version=__version__,
        torch_version=torch.__version__,
        world_size=len(parts),
        transforms=transforms,
        ranks=tuple(entry for entry, _ in parts),
        files={**files, **written},
        sharded=sharded,
        **trees,
    ))


def _table(name: str) -> str:
    """The tensor table of a shared Snapshot field: the model's own, or the other states'."""
    return "model" if name == "model" else "state"


def opens_window(entry: RankEntry) -> bool:
    """True if the rank saved mid-accumulation-window (gradients not yet applied)."""
    return bool(entry.grads) or isinstance(entry.transforms_state, dict) and any(
        key in TRANSIENT for key in entry.transforms_state)


def section(manifest: Manifest, rank: int) -> int:
    """The rank whose entry ``rank`` restores: its own, or rank 0's when the checkpoint was
    written by fewer processes."""
    return rank if rank < manifest.world_size else 0


def field_names(section: int) -> dict[str, str]:
    """Where each Snapshot field of rank ``section`` is in the manifest: ``"optimizer"``,
    ``"ranks[1].rng"``, ..."""
    return {name: name for name in SHARED} | {name: f"ranks[{section}].{name}" for name in PER_RANK}


def read(directory: Path, manifest: Manifest, *, rank: int, world_size: int) -> Snapshot:
    """The snapshot of ``rank`` in a world of ``world_size`` from the checkpoint in ``directory``.

    Rank ``r`` takes rank ``r``'s RNG and transform states, or rank 0's when the checkpoint
    was written by fewer processes.

    Raises:
        CheckpointError: a missing, truncated or corrupted file, a value of the manifest
            that does not decode (the message names the field, such as
            ``ranks[0].transforms_state.loss_scale.scale``), or a world size other than the
            writer's for a checkpoint saved mid-accumulation-window.
    """
    if world_size != manifest.world_size and any(opens_window(e) for e in manifest.ranks):
        raise CheckpointError(
            f"{directory} was saved by {manifest.world_size} processes in the middle of an "
            f"accumulation window, whose gradients are per process; resume it with "
            f"{manifest.world_size} processes (this world has {world_size})"
        )
    own_section = section(manifest, rank)
    files = {name: e for name, e in manifest.files.items() if e.rank is None or e.rank == own_section}
    # the tensors stay mapped to the files: the snapshot is put in place by copying
    # (``restore.put(copy=True)``), into the state's own tensors where it has them
    tables = _tensorfiles.read(directory, files)
    own = tables.get(_rank_group(own_section), {})
    entry = manifest.ranks[own_section]
    paths = field_names(own_section)
    try:
        fields = {name: decode(getattr(manifest, name), tables.get(_table(name), {}), paths[name]) for name in SHARED}
        fields |= {name: decode(getattr(entry, name), own, paths[name]) for name in PER_RANK}
    except CheckpointError as e:
        raise CheckpointError(f"{directory / _manifest.MANIFEST}: {e}") from None
    invalid = field_problems(Snapshot, fields, paths)
    if invalid:
        raise CheckpointError(f"{directory / _manifest.MANIFEST}: invalid values:\n  " + "\n  ".join(invalid))
    return Snapshot(**fields)
