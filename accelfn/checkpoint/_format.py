"""The format of a checkpoint directory: ``manifest.json``'s records through one cattrs
converter, and a Snapshot encoded into them (its tensors into tensor files) and decoded back.

A Snapshot's fields that every rank shares go into the manifest (the model's tensors to
``model.safetensors`` under their own names, tied weights once; optimizer, scheduler and
``extra`` tensors to ``state.safetensors``); the fields that differ per rank (RNG states,
transform states, open-window gradients) go into one ``RankEntry`` per rank, with that
rank's tensors in ``rank_<r>.safetensors``. A rank's part travels to the writer as bytes in
a uint8 tensor: a JSON header (its entry, its tensors' dtypes and shapes) followed by the
raw tensor bytes. The manifest's own sha256 is in ``manifest.sha256``, written just before
the manifest; the layout as a whole is described in the package docstring.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import types
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import attrs
import cattrs
import orjson
import torch
from cattrs.gen import make_dict_unstructure_fn, override
from cattrs.preconf.orjson import make_converter

from accelfn._version import __version__
from accelfn.checkpoint import _tensorfiles
from accelfn.checkpoint._codec import TENSOR, Encoder, decode
from accelfn.checkpoint._tensorfiles import ALGORITHMS, FileEntry
from accelfn.checkpoint.snapshot import TRANSIENT, Snapshot
from accelfn.errors import CheckpointError

if TYPE_CHECKING:
    from accelfn.step import Step, TransformBase

#: 2: manifest.sha256 added; 3: records named by stable tags (``_codec.RECORDS``), not module paths;
#: 4: tensor files checked with xxh3_128, each file entry naming its algorithm (sha256 when
#: ``xxhash`` is not installed) (versions 1 to 3 still load)
FORMAT_VERSION = 4
#: 5: a sharded checkpoint (a ``sharded`` table, DCP files in ``dcp/``); unsharded ones stay at
#: FORMAT_VERSION, so that an older accelfn refuses only what it cannot read
SHARDED_FORMAT_VERSION = 5
#: 6: a sharded checkpoint whose ``sharded.extra`` table places DTensors of ``extra`` states in
#: its DCP files (written only when there are some, so that an older accelfn, which would
#: load None in their place, refuses it instead)
EXTRA_DTENSORS_FORMAT_VERSION = 6
MANIFEST = "manifest.json"
CHECKSUM = "manifest.sha256"
_SHA256 = re.compile(r"^([0-9a-f]{64})  " + re.escape(MANIFEST) + r"\n?$")


@attrs.frozen
class RankEntry:
    """What differs between ranks (the Snapshot fields of the same names), as encoded trees.

    ``extra``: this rank's state of each ``extra`` object whose state differs between the
    ranks (a per-rank stream position, an EMA of this rank's shards), by name; None (no
    key) when every rank's equals rank 0's, which the manifest's ``extra`` holds.
    """

    rng: Any
    transforms_state: Any
    grads: Any
    extra: Any = None


@attrs.frozen
class ShardedTensor:
    """One tensor in a sharded checkpoint's DCP files: its global shape and dtype name."""

    shape: tuple[int, ...]
    dtype: str


@attrs.frozen
class ExtraTensor:
    """A DTensor of an ``extra`` state in a sharded checkpoint's DCP files: the ``extra``
    entry's name, where in its ``state_dict`` it is (mapping keys and list indices, from
    the root), its global shape and dtype name."""

    name: str
    path: Any
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
        extra: DCP key (``extra/<name>/<path>``) -> a DTensor of an ``extra`` state, which the
            manifest's tree holds as None (empty, and no key, in checkpoints without any:
            older manifests read the same).
    """

    model: dict[str, ShardedTensor]
    aliases: dict[str, str]
    optimizer: dict[str, dict[str, ShardedTensor]]
    grads: dict[str, ShardedTensor]
    extra: dict[str, ExtraTensor] = attrs.field(factory=dict)


@attrs.frozen
class Manifest:
    """Everything in a checkpoint but the tensors.

    After the format fields come the Snapshot's shared fields as trees encoded by
    ``accelfn.checkpoint._codec`` (tensors as references into the files), then each rank's entry and
    the tensor files with their checksums; a sharded checkpoint's ``sharded`` table says
    where the tensors in its DCP files belong (None in an unsharded one); ``stopped`` why a
    hook's ``af.Stop`` ended the run (None, and no key, when none did: manifests written
    before it existed read the same).
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
    stopped: Any = None


_converter = make_converter()
_converter.register_unstructure_hook(torch.dtype, str)
# a transform's function option (replicate's comm_hook) as its module.qualname
_converter.register_unstructure_hook(types.FunctionType, lambda f: f"{f.__module__}.{f.__qualname__}")
# a file entry names only the checksum it has; an unsharded checkpoint's manifest has no
# ``sharded`` key (it reads as None)
_converter.register_unstructure_hook(FileEntry, make_dict_unstructure_fn(FileEntry, _converter, _cattrs_omit_if_default=True))
_converter.register_unstructure_hook(
    ShardedTables, make_dict_unstructure_fn(ShardedTables, _converter, extra=override(omit_if_default=True)))
_converter.register_unstructure_hook(
    RankEntry, make_dict_unstructure_fn(RankEntry, _converter, extra=override(omit_if_default=True)))
_converter.register_unstructure_hook(
    Manifest, make_dict_unstructure_fn(Manifest, _converter, sharded=override(omit_if_default=True),
                                       stopped=override(omit_if_default=True)))


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
    if isinstance(version, bool) or not isinstance(version, int) or version > EXTRA_DTENSORS_FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format version {version!r}; this accelfn reads versions up to "
            f"{EXTRA_DTENSORS_FORMAT_VERSION} (upgrade accelfn to load it)"
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


RankPart = tuple[RankEntry, dict[str, torch.Tensor]]
#: Snapshot fields that differ between ranks (in each RankEntry) and those every rank shares
#: (in the Manifest); the model's tensors go to their own table, under their own names
PER_RANK: tuple[str, ...] = ("rng", "transforms_state", "grads")
SHARED: tuple[str, ...] = tuple(f.name for f in attrs.fields(Snapshot) if f.name not in PER_RANK)


def _rank_group(rank: int) -> str:
    return f"rank_{rank:05d}"


def rank_part(snap: Snapshot) -> RankPart:
    """This rank's entry and its tensors (open-window gradients, transform-state tensors)."""
    encoder = Encoder()
    entry = RankEntry(**{name: encoder.encode(getattr(snap, name), name) for name in PER_RANK},
                      extra={name: encoder.encode(tree, f"extra.{name}") for name, tree in snap.extra.items()})
    return entry, encoder.tensors


def _refs(tree: Any) -> set[str]:
    """The tensor keys an encoded tree refers to."""
    if isinstance(tree, Mapping):
        if set(tree) == {TENSOR}:
            return {tree[TENSOR]}
        return set().union(*(_refs(v) for v in tree.values())) if tree else set()
    if isinstance(tree, (list, tuple)):
        return set().union(*(_refs(v) for v in tree)) if tree else set()
    return set()


def _same(a: tuple[Any, dict[str, torch.Tensor]], b: tuple[Any, dict[str, torch.Tensor]]) -> bool:
    (tree_a, tensors_a), (tree_b, tensors_b) = a, b
    if tree_a != tree_b:
        return False
    return all(tensors_a[k].dtype == tensors_b[k].dtype and tensors_a[k].shape == tensors_b[k].shape
               and torch.equal(tensors_a[k], tensors_b[k]) for k in _refs(tree_a))


def per_rank_extra(parts: list[RankPart]) -> list[RankPart]:
    """Every rank's part with only the ``extra`` states that differ between ranks kept (and
    their tensors): an entry equal on every rank is rank 0's, which the manifest's shared
    ``extra`` holds."""
    if not parts or parts[0][0].extra is None:
        return parts
    names = list(parts[0][0].extra)
    differ = {name for name in names if any(
        entry.extra is None or name not in entry.extra
        or not _same((parts[0][0].extra[name], parts[0][1]), (entry.extra[name], tensors))
        for entry, tensors in parts[1:])}
    out = []
    for entry, tensors in parts:
        own = entry.extra or {}
        dropped = set().union(*(_refs(tree) for name, tree in own.items() if name not in differ)) if own else set()
        kept = {name: own[name] for name in own if name in differ}
        out.append((attrs.evolve(entry, extra=kept or None), {k: v for k, v in tensors.items() if k not in dropped}))
    return out


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


def pack_part(part: RankPart) -> torch.Tensor:
    """A rank's part as bytes in a uint8 tensor (``pack_tensors``)."""
    entry, tensors = part
    return pack_tensors({"entry": unstructure(entry)}, tensors)


def unpack_part(data: torch.Tensor) -> RankPart:
    """The part ``pack_part`` packed."""
    header, tensors = unpack_tensors(data)
    return loads(orjson.dumps(header["entry"]), RankEntry), tensors


def write_snapshot(directory: Path, snap: Snapshot, parts: list[RankPart], transforms: Any, *,
                   sharded: ShardedTables | None = None, files: Mapping[str, FileEntry] = MappingProxyType({})) -> None:
    """Writes ``snap`` (with every rank's part) into ``directory``: tensor files, then the
    manifest, which also lists ``files`` written already (a sharded checkpoint's DCP files,
    whose tensors ``sharded`` places)."""
    parts = per_rank_extra(parts)
    encoders = {"model": Encoder(), "state": Encoder()}
    trees = {name: encoders[_table(name)].encode(getattr(snap, name), "" if name == "model" else name)
             for name in SHARED}
    groups: dict[str, tuple[Mapping[str, torch.Tensor], int | None]] = {
        table: (encoder.tensors, None) for table, encoder in encoders.items()
    }
    for rank, (_, tensors) in enumerate(parts):
        groups[_rank_group(rank)] = (tensors, rank)
    written = _tensorfiles.write(directory, groups)
    write(directory, Manifest(
        format_version=(FORMAT_VERSION if sharded is None else EXTRA_DTENSORS_FORMAT_VERSION if sharded.extra
                        else SHARDED_FORMAT_VERSION),
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


def opens_window(manifest: Manifest) -> bool:
    """True if the checkpoint was saved mid-accumulation-window (gradients not yet applied,
    per rank): some rank's entry holds gradients or a window, or its DCP files do."""
    return (manifest.sharded is not None and bool(manifest.sharded.grads)) or any(
        bool(entry.grads) or isinstance(entry.transforms_state, dict)
        and any(key in TRANSIENT for key in entry.transforms_state) for entry in manifest.ranks)


def only_tree_windows(manifest: Manifest) -> bool:
    """True if every open window of the checkpoint is ``invariant()``'s tree of subtrees
    (no per-process gradients, sharded or not): such a window can be redistributed over
    another world size."""
    return (manifest.sharded is None or not manifest.sharded.grads) and not any(
        bool(entry.grads) or isinstance(entry.transforms_state, dict)
        and any(key in TRANSIENT and key != "tree_window" for key in entry.transforms_state) for entry in manifest.ranks)


def rank_entries(directory: Path, manifest: Manifest, key: str,
                 files: Mapping[str, FileEntry] | None = None) -> list[Any]:
    """Every saved rank's ``transforms_state[key]`` (None where a rank has none), decoded."""
    listed = manifest.files if files is None else files
    values: list[Any] = []
    for rank, entry in enumerate(manifest.ranks):
        state = entry.transforms_state
        if not isinstance(state, dict) or key not in state:
            values.append(None)
            continue
        tables = _tensorfiles.read(directory, {name: e for name, e in listed.items() if e.rank == rank})
        try:
            values.append(decode(state[key], tables.get(_rank_group(rank), {}), f"ranks[{rank}].transforms_state.{key}"))
        except CheckpointError as e:
            raise CheckpointError(f"{directory / MANIFEST}: {e}") from None
    return values


def section(manifest: Manifest, rank: int) -> int:
    """The rank whose entry ``rank`` restores: its own, or rank 0's when the checkpoint was
    written by fewer processes."""
    return rank if rank < manifest.world_size else 0


def field_names(section: int) -> dict[str, str]:
    """Where each Snapshot field of rank ``section`` is in the manifest: ``"optimizer"``,
    ``"ranks[1].rng"``, ..."""
    return {name: name for name in SHARED} | {name: f"ranks[{section}].{name}" for name in PER_RANK}


def read_snapshot(directory: Path, manifest: Manifest, *, rank: int,
                  files: Mapping[str, FileEntry] | None = None) -> Snapshot:
    """The snapshot of ``rank`` from the checkpoint in ``directory``, its tensor ``files``
    (by default all the manifest lists) verified as they are read; its values are checked
    by ``snapshot.verify``, not here.

    Rank ``r`` takes rank ``r``'s RNG and transform states, or rank 0's when the checkpoint
    was written by fewer processes. The tensors stay mapped to the files: the snapshot is
    put in place by copying (``snapshot.put(copy=True)``), into the state's own tensors
    where it has them.

    Raises:
        CheckpointError: a missing, truncated or corrupted file, or a value of the manifest
            that does not decode (the message names the field, such as
            ``ranks[0].transforms_state.loss_scale.scale``).
    """
    own_section = section(manifest, rank)
    listed = manifest.files if files is None else files
    tables = _tensorfiles.read(directory, {name: e for name, e in listed.items()
                                           if e.rank is None or e.rank == own_section})
    own = tables.get(_rank_group(own_section), {})
    entry = manifest.ranks[own_section]
    paths = field_names(own_section)
    try:
        fields = {name: decode(getattr(manifest, name), tables.get(_table(name), {}), paths[name]) for name in SHARED}
        fields |= {name: decode(getattr(entry, name), own, paths[name]) for name in PER_RANK}
        if entry.extra:  # this rank's own states of the entries that differ between ranks
            fields["extra"] = {**fields["extra"], **decode(entry.extra, own, f"ranks[{own_section}].extra")}
    except CheckpointError as e:
        raise CheckpointError(f"{directory / MANIFEST}: {e}") from None
    return Snapshot(**fields)


def _recorded(program: Step) -> list[TransformBase]:
    """The transforms of ``program`` that change what it computes (``changes_results``): a
    checkpoint records those; one that only changes what is kept (``checkpoint_activations``:
    the same values, bit for bit) is left out, so checkpoints with and without it are alike."""
    return [t for t in program.transforms if t.changes_results]


def transforms_record(program: Step | None) -> Any:
    """The program's transforms as the manifest holds them (plain data: each transform's
    type name and options; those that change results only), or None."""
    if program is None:
        return None
    records = [{"type": type(t).__name__, **{k: _described(getattr(t, k)) if isinstance(getattr(t, k), frozenset) else v
                                             for k, v in unstructure(t).items()}} for t in _recorded(program)]
    return orjson.loads(_converter.dumps(records, default=_described))  # as it reads back from a manifest


def _described(value: Any) -> Any:
    """An option that is code (``shard_params(units=...)``'s predicate or classes,
    ``tensor_parallel``'s plan function or ParallelStyle objects) as a description: its name
    (a sorted list of names for a set). Only read to say what differs at a resume, never loaded."""
    if isinstance(value, (set, frozenset)):
        return sorted(str(_described(v)) for v in value)
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        return value.__qualname__
    return type(value).__name__


def saved_transforms(saved: Any, program: Step | None) -> Any:
    """The manifest's transforms record ``saved`` with the options it lacks filled in at the
    defaults of ``program``'s transforms of the same type and place: an option added to a
    transform since (``shard_data(split_batches=...)``) reads as its default, which is what
    the program that wrote the checkpoint ran with."""
    if not isinstance(saved, list) or program is None or len(saved) != len(_recorded(program)):
        return saved
    filled = []
    for record, transform in zip(saved, _recorded(program)):
        if isinstance(record, dict) and record.get("type") == type(transform).__name__:
            defaults = {f.name: f.default for f in attrs.fields(type(transform))  # type: ignore[arg-type]  # transforms are attrs classes
                        if f.name not in record and f.default is not attrs.NOTHING
                        and not isinstance(f.default, attrs.Factory)}  # type: ignore[arg-type]  # attrs.Factory is a class
            record = {**orjson.loads(dumps(defaults)), **record}
        filled.append(record)
    return filled
