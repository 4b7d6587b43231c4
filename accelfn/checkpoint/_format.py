"""The format of a checkpoint directory: a Snapshot encoded into ``manifest.json`` (whose
schema is ``_manifest``'s) and tensor files, read back and decoded.

A Snapshot's fields that every rank shares go into the manifest (the model's tensors to
``model.safetensors`` under their own names, tied weights once; optimizer, scheduler and
``extra`` tensors to ``state.safetensors``); the fields that differ per rank (RNG states,
transform states, open-window gradients) go into one ``RankEntry`` per rank, with that
rank's tensors in ``rank_<r>.safetensors``. A rank's part travels to the writer as bytes in
a uint8 tensor: a JSON header (its entry, its tensors' dtypes and shapes) followed by the
raw tensor bytes. The manifest's own sha256 is in ``manifest.sha256``, written just before
the manifest; the layout as a whole is described in the package docstring. A live state
(``pack_live``) travels in the same encoding, whole, to a replica group that heals from it.

Reading checks, in order: the manifest's sha256, its schema (``_manifest``), its consistency
(``consistency``), the decoding of each tree (``_codec.decode``), the Snapshot's field types
and ``_codec.RULES``. Writing checks what it is about to write by the same reader
(``problems``), before any file is written.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import attrs
import orjson
import torch

from accelfn._version import __version__
from accelfn.checkpoint import _atomic, _codec, _frozen, _tensorfiles
from accelfn.checkpoint._atomic import CHECKSUM, MANIFEST
from accelfn.checkpoint._codec import NDARRAY, TENSOR, Encoder, decode, describe
from accelfn.checkpoint._manifest import Manifest, RankEntry, ShardedTables, dumps, loads, unstructure, validated
from accelfn.checkpoint._tensorfiles import ALGORITHMS, FileEntry
from accelfn.checkpoint.snapshot import TRANSIENT, Snapshot, capture, put, verify
from accelfn.errors import CheckpointError
from accelfn.state import TrainState

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
#: 7: a sharded checkpoint whose frozen model tensors are in ``dcp-frozen/`` (``sharded.frozen``;
#: written only when the model has some, so that an older accelfn, which would miss them, refuses it)
FROZEN_SHARDS_FORMAT_VERSION = 7


def write(directory: Path, manifest: Manifest) -> None:
    """Writes ``manifest`` into ``directory`` (``_atomic.write_manifest``: its sha256, then it)."""
    _atomic.write_manifest(directory, dumps(manifest))


def consistency(manifest: Manifest) -> list[str]:
    """How the manifest's fields contradict one another (empty if they do not): a world size
    other than its number of rank entries, a file with no checksum or two, or of a rank
    outside the world."""
    found = []
    if manifest.world_size != len(manifest.ranks):
        found.append(f"world_size {manifest.world_size} with {len(manifest.ranks)} rank entries; the manifest "
                     "is inconsistent")
    for name, entry in manifest.files.items():
        if sum(getattr(entry, algorithm) is not None for algorithm in ALGORITHMS) != 1:
            found.append(f"files.{name} must have exactly one checksum ({' or '.join(ALGORITHMS)}); the manifest "
                         "is inconsistent")
        if entry.rank is not None and not entry.rank < manifest.world_size:
            found.append(f"files.{name}.rank is {entry.rank}, outside the world of {manifest.world_size}")
    sharded = manifest.sharded
    if sharded is not None and sharded.frozen is not None:
        if len(sharded.frozen.checksums) != manifest.world_size:
            found.append(f"sharded.frozen.checksums has {len(sharded.frozen.checksums)} entries for a world of "
                         f"{manifest.world_size} ranks; the manifest is inconsistent")
        both = sorted(set(sharded.frozen.model) & set(sharded.model))
        if both:
            found.append(f"sharded.model and sharded.frozen.model both place {both}; the manifest is inconsistent")
    return found


class InvalidValues(CheckpointError):
    """Values of a manifest that break its rules (``problems``, one a line)."""

    def __init__(self, problems: list[str]):
        super().__init__("\n  ".join(problems))
        self.problems = problems


def invalid(where: Path | str, problems: list[str]) -> CheckpointError:
    """The error of a checkpoint at ``where`` whose manifest holds ``problems``."""
    return CheckpointError(f"{where}: invalid values in {MANIFEST}:\n  " + "\n  ".join(problems))


def read(directory: Path) -> Manifest:
    """The manifest of the checkpoint in ``directory``, verified against ``manifest.sha256``
    and validated against its schema.

    Raises:
        CheckpointError: no manifest, an unreadable one, one whose sha256 differs from
            ``manifest.sha256`` or without that file (from format version 2 on), one that is
            not JSON, a newer format version, or one whose fields do not have the schema's
            types or contradict one another (every problem named, ``counters.step: 'x' (a
            str), must be an int >= 0``).
    """
    path = directory / MANIFEST
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the manifest ({e.strerror})") from None
    expected = _atomic.expected_sha256(directory)
    digest = hashlib.sha256(data).hexdigest()
    if expected is not None and digest != expected:
        raise CheckpointError(
            f"{path}: sha256 {digest} does not match {expected} in {CHECKSUM}; the manifest is "
            "corrupted or was changed after the checkpoint was written"
        )
    try:
        plain = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise CheckpointError(f"{path}: not JSON; the manifest is corrupted") from None
    version = plain.get("format_version") if isinstance(plain, dict) else None
    if isinstance(version, bool) or not isinstance(version, int) or version > FROZEN_SHARDS_FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format version {version!r}; this accelfn reads versions up to "
            f"{FROZEN_SHARDS_FORMAT_VERSION} (upgrade accelfn to load it)"
        )
    if expected is None and version >= 2:
        raise CheckpointError(f"{directory / CHECKSUM} is missing: a checkpoint of format version {version} "
                              f"has the sha256 of its {MANIFEST} in it; the checkpoint is incomplete")
    manifest, problems = validated(plain, Manifest)
    if problems:
        raise invalid(directory, problems)
    contradictions = consistency(manifest)
    if contradictions:
        raise CheckpointError(f"{path}: " + "; ".join(contradictions))
    return manifest


RankPart = tuple[RankEntry, dict[str, torch.Tensor]]
#: Snapshot fields that differ between ranks (in each RankEntry) and those every rank shares
#: (in the Manifest); the model's tensors go to their own table, under their own names
PER_RANK: tuple[str, ...] = ("rng", "transforms_state", "grads", "data_state")
SHARED: tuple[str, ...] = tuple(f.name for f in attrs.fields(Snapshot) if f.name not in PER_RANK)


def _rank_group(rank: int) -> str:
    return f"rank_{rank:05d}"


def rank_part(snap: Snapshot) -> RankPart:
    """This rank's entry and its tensors (open-window gradients, transform-state tensors)."""
    encoder = Encoder()
    trees = {name: encoder.encode(getattr(snap, name), name) for name in PER_RANK if name != "data_state"}
    try:
        trees["data_state"] = encoder.encode(snap.data_state, "data_state")
    except TypeError as e:
        raise TypeError(f"{e}. The data readers' state (a stream's position: the state_dict() of its "
                        "datasets.IterableDataset, torchdata StatefulDataLoader or IterableDataset) is stored as "
                        "JSON values and tensors, never pickled: make the dataset's state_dict() return those") from None
    entry = RankEntry(**trees, extra={name: encoder.encode(tree, f"extra.{name}") for name, tree in snap.extra.items()})
    return entry, encoder.tensors


def _refs(tree: Any) -> set[str]:
    """The tensor keys an encoded tree refers to."""
    if isinstance(tree, Mapping):
        if len(tree) == 1 and (TENSOR in tree or NDARRAY in tree):
            return {next(iter(tree.values()))}
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


def pack_part(part: RankPart) -> torch.Tensor:
    """A rank's part as bytes in a uint8 tensor (``pack_tensors``)."""
    entry, tensors = part
    return _tensorfiles.pack_tensors({"entry": unstructure(entry)}, tensors)


def unpack_part(data: torch.Tensor) -> RankPart:
    """The part ``pack_part`` packed."""
    header, tensors = _tensorfiles.unpack_tensors(data)
    return loads(orjson.dumps(header["entry"]), RankEntry), tensors


#: what a live state's header calls its encoding (``pack_live``); another one is refused rather than misread
LIVE_FORMAT = "accelfn-live-state-1"


def pack_live(state: TrainState) -> torch.Tensor:
    """Everything ``state`` is (its snapshot: model, optimizer, scheduler, ``extra``, counters
    and data position, transform states, open-window gradients, this process's RNG states)
    in a checkpoint's encoding (``_codec``) as bytes in a uint8 tensor (``pack_tensors``): the
    live state a replica group that heals under ``tolerate_faults`` copies. Nothing in
    ``state`` changes.

    Raises:
        TypeError: an ``extra`` object whose ``state_dict`` holds what a checkpoint cannot.
    """
    snap = capture(state, copy=False)
    encoder = Encoder()
    plain = {f.name: encoder.encode(getattr(snap, f.name), f.name) for f in attrs.fields(Snapshot)}
    return _tensorfiles.pack_tensors({"format": LIVE_FORMAT, "accelfn": __version__, "snapshot": plain},
                                     encoder.tensors)


def unpack_live(state: TrainState, data: torch.Tensor, *, source: str) -> TrainState:
    """The state ``pack_live`` packed, decoded (never unpickled) and checked as a load checks a
    checkpoint (the fields' types, ``snapshot.verify``: the values' rules and the fit to
    ``state``), then put into ``state`` (in place).

    Args:
        state: the receiving state (its model, optimizer, scheduler and ``extra`` objects are
            loaded; the returned record holds the sender's counters and transform states).
        data: ``pack_live``'s uint8 tensor.
        source: what sent it, for messages.

    Returns:
        TrainState: ``state`` as the sender's.

    Raises:
        CheckpointError: ``data`` is not a packed state of this accelfn, holds values no
            state could take, or does not fit ``state`` (every difference named); nothing
            was changed.
    """
    try:
        header, tensors = _tensorfiles.unpack_tensors(data)
        if header.get("format") != LIVE_FORMAT:
            raise CheckpointError(f"{source} is not in accelfn's live state format ({LIVE_FORMAT}): its header "
                                  f"says {header.get('format')!r}")
        plain: dict[str, Any] = header["snapshot"]
        fields = {f.name: decode(plain[f.name], tensors, f.name) for f in attrs.fields(Snapshot)}
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{source} does not decode as a state: {type(e).__name__}: {e}") from None
    if header.get("accelfn") != __version__:
        raise CheckpointError(f"{source} comes from accelfn {header.get('accelfn')}, and this process runs "
                              f"{__version__}: run the same accelfn in every replica group")
    found = _codec.field_types(Snapshot, fields, str)
    if found:  # before the Snapshot's converters meet a value they cannot take
        raise CheckpointError(f"invalid values in {source}:\n  " + "\n  ".join(found))
    snap = Snapshot(**fields)
    verify(state, snap, source=source)
    return put(state, snap, copy=False)


class LiveTransfer:
    """``distributed.fault_tolerance.StateTransfer``: ``pack_live`` and ``unpack_live``."""

    def pack(self, state: TrainState) -> torch.Tensor:
        return pack_live(state)

    def unpack(self, state: TrainState, data: torch.Tensor, *, source: str) -> TrainState:
        return unpack_live(state, data, source=source)


Groups = dict[str, tuple[Mapping[str, torch.Tensor], int | None]]


@attrs.frozen(eq=False)
class Encoded:
    """A checkpoint ready to write: its manifest (the files written already, a sharded
    checkpoint's DCP files, listed) and its tensor groups (group -> tensors, and the rank
    whose own they are, or None)."""

    manifest: Manifest
    groups: Groups
    frozen: Mapping[str, torch.Tensor] = MappingProxyType({})


def encode(snap: Snapshot, parts: list[RankPart], transforms: Any, *, sharded: ShardedTables | None = None,
           files: Mapping[str, FileEntry] = MappingProxyType({}), frozen: frozenset[str] = frozenset()) -> Encoded:
    """``snap`` with every rank's part as a manifest and tensor groups (nothing written);
    the model's tensors named in ``frozen`` (parameters that do not require gradients) kept
    apart, for files of their own (``_frozen``)."""
    parts = per_rank_extra(parts)
    encoders = {"model": Encoder(), "state": Encoder()}
    trees = {name: encoders[_table(name)].encode(getattr(snap, name), "" if name == "model" else name)
             for name in SHARED}
    groups: Groups = {table: (encoder.tensors, None) for table, encoder in encoders.items()}
    model, frozen_tensors = _frozen.split(encoders["model"].tensors, frozen)
    groups["model"] = (model, None)
    for rank, (_, tensors) in enumerate(parts):
        groups[_rank_group(rank)] = (tensors, rank)
    return Encoded(Manifest(
        format_version=(FORMAT_VERSION if sharded is None else FROZEN_SHARDS_FORMAT_VERSION if sharded.frozen
                        else EXTRA_DTENSORS_FORMAT_VERSION if sharded.extra else SHARDED_FORMAT_VERSION),
        accelfn_version=__version__,
        torch_version=torch.__version__,
        world_size=len(parts),
        transforms=transforms,
        ranks=tuple(entry for entry, _ in parts),
        files=dict(files),
        sharded=sharded,
        **trees,
    ), groups, frozen_tensors)


def problems(encoded: Encoded) -> list[str]:
    """What ``af.load`` would refuse in ``encoded`` on any rank, whatever state it loads into
    (empty if nothing): the manifest's schema and consistency, the decoding of every tree and
    the Snapshot's rules, checked by the reader load runs (``validated``, ``decode_snapshot``),
    on the manifest as JSON and the tensors in memory."""
    plain = orjson.loads(dumps(encoded.manifest))
    manifest, found = validated(plain, Manifest)
    if manifest is None:
        return found
    found = consistency(manifest)
    tables = {group: tensors for group, (tensors, _) in encoded.groups.items()}
    if encoded.frozen:  # the model's table, as a load reads it from both kinds of files
        tables[_frozen.GROUP] = {**tables.get(_frozen.GROUP, {}), **encoded.frozen}
    for rank in range(manifest.world_size):
        try:
            snap = decode_snapshot(manifest, tables, rank=rank)
        except InvalidValues as e:
            found += e.problems
            continue
        except CheckpointError as e:
            found.append(str(e))
            continue
        found += _codec.invalid_values(snap, names=field_names(rank))
    return list(dict.fromkeys(found))  # a shared field's problem once, not once per rank


def write_encoded(directory: Path, encoded: Encoded, files: Mapping[str, FileEntry] = MappingProxyType({}), *,
                  earlier: Path | None = None) -> None:
    """Writes ``encoded`` into ``directory``: tensor files, then the manifest, which also
    lists ``files`` written already (a sharded checkpoint's DCP files). The frozen model
    tensors' files are hard links to those of the checkpoint ``earlier`` where it holds
    the same bytes (``_frozen``). Check ``problems(encoded)`` first: nothing here checks it."""
    written = _tensorfiles.write(directory, encoded.groups)
    frozen, _ = _frozen.write(directory, encoded.frozen, _earlier_files(earlier))
    write(directory, attrs.evolve(encoded.manifest, files={**encoded.manifest.files, **files, **written, **frozen}))


def _earlier_files(earlier: Path | None) -> tuple[Path, Mapping[str, FileEntry]] | None:
    """The checkpoint ``earlier`` and its manifest's files, or None where there is none or its
    manifest does not read (its frozen files are then not reused)."""
    if earlier is None:
        return None
    try:
        return earlier, read(earlier).files
    except CheckpointError:
        return None


def refuse(path: Path, found: list[str]) -> None:
    """Raises for a checkpoint at ``path`` that would hold ``found`` (``problems``), if any.

    Raises:
        CheckpointError: naming every problem, and that nothing was written.
    """
    if found:
        raise CheckpointError(f"{path}: not written: af.load would refuse a checkpoint of this state, which holds "
                              f"invalid values:\n  " + "\n  ".join(found))


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
    (by default all the manifest lists) verified as they are read (``decode_snapshot``).

    Raises:
        CheckpointError: a missing, truncated or corrupted file, or as ``decode_snapshot``.
    """
    own_section = section(manifest, rank)
    listed = manifest.files if files is None else files
    tables = _tensorfiles.read(directory, {name: e for name, e in listed.items()
                                           if e.rank is None or e.rank == own_section})
    try:
        return decode_snapshot(manifest, tables, rank=rank)
    except InvalidValues as e:
        raise invalid(directory, e.problems) from None
    except CheckpointError as e:
        raise CheckpointError(f"{directory / MANIFEST}: {e}") from None


def decode_snapshot(manifest: Manifest, tables: Mapping[str, Mapping[str, torch.Tensor]], *, rank: int) -> Snapshot:
    """The snapshot of ``rank`` the manifest describes, its tensors looked up in ``tables``
    (group -> key -> tensor); its values' rules are checked by ``snapshot.verify``, not here.

    Rank ``r`` takes rank ``r``'s RNG and transform states, or rank 0's when the checkpoint
    was written by fewer processes. Tensors stay those of ``tables`` (mapped to the files, when
    read): the snapshot is put in place by copying (``snapshot.put(copy=True)``).

    Raises:
        InvalidValues: decoded fields of other types than the Snapshot's.
        CheckpointError: a value of the manifest that does not decode (the message names the
            field, such as ``ranks[0].transforms_state.loss_scale.scale``).
    """
    own_section = section(manifest, rank)
    own = tables.get(_rank_group(own_section), {})
    entry = manifest.ranks[own_section]
    paths = field_names(own_section)
    fields = {name: decode(getattr(manifest, name), tables.get(_table(name), {}), paths[name]) for name in SHARED}
    fields |= {name: decode(getattr(entry, name), own, paths[name]) for name in PER_RANK}
    found = _codec.field_types(Snapshot, fields, paths.__getitem__)
    if entry.extra:  # this rank's own states of the entries that differ between ranks
        where = f"ranks[{own_section}].extra"
        own_extra = decode(entry.extra, own, where)
        if isinstance(own_extra, Mapping) and isinstance(fields["extra"], Mapping):
            fields["extra"] = {**fields["extra"], **own_extra}
        else:
            found.append(f"{where}: {describe(own_extra)}, must be a mapping")
    if found:  # before the Snapshot's converters meet a value they cannot take
        raise InvalidValues(found)
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
    return orjson.loads(dumps(records, default=_described))  # as it reads back from a manifest


def _described(value: Any) -> Any:
    """An option that is code (``shard_params(units=...)``'s predicate or classes,
    ``tensor_parallel``'s plan function or ParallelStyle objects) as a description: its name
    (a sorted list of names for a set). Only read to say what differs at a resume, never loaded."""
    if isinstance(value, (set, frozenset)):
        return sorted(str(_described(v)) for v in value)
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        return value.__qualname__
    return type(value).__name__


def same_program(saved: Any, now: Any) -> bool:
    """Whether two transforms records (``transforms_record``) describe the same run: equal, or
    equal but for ``accumulate`` when both hold ``invariant()``, under which each world size
    accumulates its share of one global batch (the resume checks that batch: ``Layout``)."""
    if saved == now:
        return True
    if not (isinstance(saved, list) and isinstance(now, list)):
        return False

    def kinds(records: list[Any]) -> set[Any]:
        return {r.get("type") for r in records if isinstance(r, dict)}

    if "Invariant" not in kinds(saved) or "Invariant" not in kinds(now):
        return False

    def without_accumulate(records: list[Any]) -> list[Any]:
        return [r for r in records if not (isinstance(r, dict) and r.get("type") == "Accumulate")]

    return without_accumulate(saved) == without_accumulate(now)


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
