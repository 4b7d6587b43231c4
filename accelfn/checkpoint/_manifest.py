"""The schema of ``manifest.json``: its records, and the one cattrs converter that writes them
and reads them back, validating every field on the way in.

The converter is strict where JSON is loose: an int is an int (not a bool, not ``"5"``, not
``5.0``), a str a str, a count an int >= 0, a world size an int >= 1, a shape a list of ints
>= 0, a dtype one torch knows; a required key must be there and an unknown key must not
(``forbid_extra_keys``: a key this accelfn does not know has a meaning it cannot honour; a
newer accelfn that adds one raises the format version). The fields that hold state trees
(the model's, the optimizer's, ``extra``, a rank's transform states) are JSON objects here;
what is inside them is checked as they are decoded (``_codec.decode``), against the
Snapshot's field types, and by ``_codec.RULES``.

Every problem is reported at once, in the words of the rest of the checkpoint's messages:
``counters.step: 'x' (a str), must be an int >= 0``, ``ranks[0].grads: missing``,
``files.model.safetensors: unexpected keys: 'zz'``.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Any

import attrs
import cattrs
import orjson
import torch
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override
from cattrs.preconf.orjson import OrjsonConverter, make_converter

from accelfn.checkpoint._codec import describe
from accelfn.checkpoint._tensorfiles import ALGORITHMS, FileEntry
from accelfn.errors import CheckpointError


@attrs.frozen
class RankEntry:
    """What differs between ranks (the Snapshot fields of the same names), as encoded trees.

    ``extra``: this rank's state of each ``extra`` object whose state differs between the
    ranks (a per-rank stream position, an EMA of this rank's shards), by name; None (no
    key) when every rank's equals rank 0's, which the manifest's ``extra`` holds.
    ``data_state``: this rank's data readers' saved state (a stream's position,
    ``TrainState.data_state``); None (no key) when it has none, as in manifests written
    before it existed.
    """

    rng: dict[str, Any]
    transforms_state: dict[str, Any]
    grads: dict[str, Any]
    extra: dict[str, Any] | None = None
    data_state: dict[str, Any] | None = None


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
    path: list[Any]
    shape: tuple[int, ...]
    dtype: str


@attrs.frozen
class FrozenShards:
    """The frozen model tensors of a sharded checkpoint (parameters that do not require
    gradients: a LoRA's base), in its ``dcp-frozen/`` files, written once per run
    (``_frozen``).

    Attributes:
        model: model ``state_dict`` name -> its tensor (global shape and dtype), stored
            under that name in ``dcp-frozen/``.
        algorithm: the checksum of ``checksums`` (one of ``_tensorfiles.ALGORITHMS``).
        checksums: per rank, in rank order, the hex checksum of that rank's local frozen
            shards (their keys, offsets, shapes, dtypes and bytes): a later checkpoint whose
            ranks find the same links these files instead of writing them.
    """

    model: dict[str, ShardedTensor]
    algorithm: str
    checksums: tuple[str, ...]


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
        frozen: the frozen model tensors, kept apart from ``model`` in ``dcp-frozen/``
            (None, and no key, where the model has none: older manifests read the same).
    """

    model: dict[str, ShardedTensor]
    aliases: dict[str, str]
    optimizer: dict[str, dict[str, ShardedTensor]]
    grads: dict[str, ShardedTensor]
    extra: dict[str, ExtraTensor] = attrs.field(factory=dict)
    frozen: FrozenShards | None = None


@attrs.frozen
class Manifest:
    """Everything in a checkpoint but the tensors.

    After the format fields come the Snapshot's shared fields as trees encoded by
    ``accelfn.checkpoint._codec`` (tensors as references into the files; ``counters`` plain
    ints >= 0), then each rank's entry and the tensor files with their checksums; a sharded
    checkpoint's ``sharded`` table says where the tensors in its DCP files belong (None in
    an unsharded one); ``stopped`` why a hook's ``af.Stop`` ended the run (None, and no key,
    when none did: manifests written before it existed read the same). ``transforms`` (the
    program's transforms as plain data, or None) is only read to say what differs at a resume.
    """

    format_version: int
    accelfn_version: str
    torch_version: str
    world_size: int
    transforms: list[dict[str, Any]] | None
    counters: dict[str, int]
    model: dict[str, Any]
    optimizer_type: Any
    optimizer_params: Any
    optimizer: dict[str, Any]
    scheduler_type: Any
    scheduler: Any
    extra: dict[str, Any]
    ranks: tuple[RankEntry, ...]
    files: dict[str, FileEntry]
    sharded: ShardedTables | None = None
    stopped: Any = None


class Invalid(ValueError):
    """A value of the wrong type or range, found by a structure hook: the value, what it must
    be, and its keys below the field the hook structures (empty for the field itself)."""

    def __init__(self, value: Any, expected: str, where: tuple[Any, ...] = ()):
        super().__init__(f"{describe(value)}, must be {expected}")
        self.value, self.expected, self.where = value, expected, where


Hook = Callable[[Any, Any], Any]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _checked(test: Callable[[Any], bool], expected: str) -> Hook:
    """A structure hook passing a value ``test`` accepts, refusing others as not ``expected``."""
    def hook(value: Any, _: Any) -> Any:
        if not test(value):
            raise Invalid(value, expected)
        return value

    return hook


def _each(container: type, item: Hook, expected: str, into: Callable[[Any], Any] = lambda v: v) -> Hook:
    """A structure hook for a ``container`` (dict or list) each of whose items passes ``item``."""
    def hook(value: Any, _: Any) -> Any:
        if not isinstance(value, container):
            raise Invalid(value, expected)
        checked: Any = value
        items = checked.items() if isinstance(checked, dict) else enumerate(checked)
        for key, v in items:
            try:
                item(v, None)
            except Invalid as e:
                raise Invalid(v, e.expected, (key,)) from None
        return into(value)

    return hook


_COUNT = _checked(lambda v: _is_int(v) and v >= 0, "an int >= 0")
_POSITIVE = _checked(lambda v: _is_int(v) and v >= 1, "an int >= 1")
_SHAPE = _each(list, _COUNT, "a list of ints >= 0 (a shape)", tuple)
_DTYPE = _checked(lambda v: isinstance(v, str) and isinstance(getattr(torch, v, None), torch.dtype),
                  "the name of a torch dtype ('float32')")
_ALGORITHM = _checked(lambda v: v in ALGORITHMS, f"a checksum algorithm ({' or '.join(map(repr, ALGORITHMS))})")
_HEX = _checked(lambda v: isinstance(v, str) and bool(v) and all(c in "0123456789abcdef" for c in v),
                "a hex checksum (a str of 0-9, a-f)")
_KEYS = _each(list, _checked(lambda v: _is_int(v) or isinstance(v, str), "a str or an int"),
              "a list of mapping keys and list indices")


def _make() -> OrjsonConverter:
    converter = make_converter(forbid_extra_keys=True)
    converter.register_unstructure_hook(torch.dtype, str)
    # a transform's function option (replicate's comm_hook) as its module.qualname
    converter.register_unstructure_hook(types.FunctionType, lambda f: f"{f.__module__}.{f.__qualname__}")
    converter.register_structure_hook(str, _checked(lambda v: isinstance(v, str), "a str"))
    converter.register_structure_hook(bool, _checked(lambda v: isinstance(v, bool), "a bool"))
    converter.register_structure_hook(int, _checked(_is_int, "an int"))
    converter.register_structure_hook(float, _checked(lambda v: _is_int(v) or isinstance(v, float), "a number"))
    # a file entry names only the checksum it has; an unsharded checkpoint's manifest has no
    # ``sharded`` key (it reads as None), a rank entry without states of its own no ``extra``
    omitted = {FileEntry: ("rank", "xxh3_128", "sha256"), ShardedTables: ("extra", "frozen"), RankEntry: ("extra", "data_state"),
               Manifest: ("sharded", "stopped")}
    for cls, names in omitted.items():
        omit: dict[str, Any] = {name: override(omit_if_default=True) for name in names}
        converter.register_unstructure_hook(cls, make_dict_unstructure_fn(cls, converter, **omit))
    tensor = {"shape": override(struct_hook=_SHAPE), "dtype": override(struct_hook=_DTYPE)}
    structure: dict[type, dict[str, Any]] = {
        FileEntry: {"num_bytes": override(struct_hook=_COUNT),
                    "rank": override(struct_hook=lambda v, _: None if v is None else _COUNT(v, _))},
        ShardedTensor: tensor, ExtraTensor: {**tensor, "path": override(struct_hook=_KEYS)},
        Manifest: {"format_version": override(struct_hook=_POSITIVE), "world_size": override(struct_hook=_POSITIVE),
                   "counters": override(struct_hook=_each(dict, _COUNT, "a mapping of names to ints >= 0"))},
        RankEntry: {}, ShardedTables: {},
        FrozenShards: {"algorithm": override(struct_hook=_ALGORITHM),
                       "checksums": override(struct_hook=_each(list, _HEX, "a list of hex checksums", tuple))},
    }
    for cls, overrides in structure.items():
        converter.register_structure_hook(cls, make_dict_structure_fn(
            cls, converter, _cattrs_forbid_extra_keys=True, **overrides))
    return converter


_converter = _make()


def unstructure(value: Any) -> Any:
    """Plain data for a record (``torch.dtype`` as its name), e.g. a transform."""
    return _converter.unstructure(value)


def dumps(value: Any, default: Callable[[Any], Any] | None = None) -> bytes:
    """JSON bytes of a record (orjson); ``default`` as orjson's, for other objects."""
    return _converter.dumps(value, default=default) if default is not None else _converter.dumps(value)


def _step(path: str, key: Any) -> str:
    """The path of ``key`` below ``path`` in messages: ``a.b`` for a str key, ``a[0]`` for another."""
    if isinstance(key, str):
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]"


def _expected(kind: Any) -> str:
    """A type annotation in words: ``a mapping``, ``a list``, ``a str or None``."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return " or ".join(_expected(a) for a in typing.get_args(kind))
    base = typing.get_origin(kind) or kind
    if attrs.has(base):
        return f"a mapping ({base.__name__})"
    names = {dict: "a mapping", list: "a list", tuple: "a list", type(None): "None", str: "a str", int: "an int",
             float: "a number", bool: "a bool"}
    return names.get(base, str(kind))


def _messages(error: cattrs.BaseValidationError, data: Any) -> list[str]:
    """Each problem of a failed structuring of ``data`` (the JSON it was given), as
    ``path: what is there, must be what``."""
    found: list[str] = []

    def walk(e: BaseException, path: str, keys: tuple[Any, ...], kind: Any) -> None:
        if isinstance(e, cattrs.ForbiddenExtraKeysError):
            found.append(f"{path or 'the manifest'}: unexpected keys: {', '.join(map(repr, sorted(e.extra_fields)))}")
            return
        if isinstance(e, cattrs.BaseValidationError):
            for sub in e.exceptions:
                note = next((n for n in getattr(sub, "__notes__", ())
                             if isinstance(n, (cattrs.AttributeValidationNote, cattrs.IterableValidationNote))), None)
                if isinstance(note, cattrs.AttributeValidationNote):
                    walk(sub, _step(path, note.name), (*keys, note.name), note.type)
                elif isinstance(note, cattrs.IterableValidationNote):
                    walk(sub, _step(path, note.index), (*keys, note.index), note.type)
                else:
                    walk(sub, path, keys, kind)
            return
        if isinstance(e, Invalid):
            for key in e.where:
                path = _step(path, key)
            found.append(f"{path}: {e}")
            return
        value = data
        for key in keys:
            present: Any = value if isinstance(value, dict) else range(len(value)) if isinstance(value, list) else ()
            if key not in present:
                found.append(f"{path}: missing")
                return
            value = value[key]
        found.append(f"{path}: {describe(value)}, must be {_expected(kind)}")

    walk(error, "", (), None)
    return found


def validated(plain: Any, cls: type) -> tuple[Any, list[str]]:
    """The record of type ``cls`` in the JSON value ``plain`` and no problems, or None and
    every problem (``counters.step: 'x' (a str), must be an int >= 0``)."""
    if not isinstance(plain, dict):
        return None, [f"{describe(plain)}, must be a mapping ({cls.__name__})"]
    try:
        return _converter.structure(plain, cls), []
    except cattrs.BaseValidationError as e:
        return None, _messages(e, plain)


def loads(data: bytes, cls: type) -> Any:
    """The record of type ``cls`` in JSON ``data``, every field validated.

    Raises:
        CheckpointError: the data is not JSON, or does not have the record's structure
            (every problem named).
    """
    try:
        plain = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise CheckpointError(f"not a valid accelfn {cls.__name__}: not JSON ({e})") from None
    record, found = validated(plain, cls)
    if found:
        raise CheckpointError(f"not a valid accelfn {cls.__name__}: " + "; ".join(found))
    return record
