"""State trees (``state_dict``s, transform records) to plain JSON data plus a tensor table.

A state tree is what ``state_dict()`` returns: nested dicts, lists and tuples of tensors,
numbers, strings and None, plus accelfn's own frozen ``attrs`` records (the loss scale, the
accumulation window). ``Encoder.encode`` turns a tree into JSON-compatible data in which
every tensor is replaced by a reference ``{"__tensor__": key}`` into a table of tensors
(written to ``.safetensors`` files); ``decode`` is the inverse. JSON cannot tell a tuple
from a list, an int key from a str key, or write inf/NaN, so those are tagged. Nothing is
ever unpickled: a record is written under its stable tag from the closed registry below
and rebuilt only if the tag is there and each field has the type its annotation names.

The registry (``RECORDS``): a record in a state tree (the loss scale, the skip count, the
accumulation window, a rank's RNG states) is written as ``{"__record__": TAG, "fields":
{...}}``. The tag names the record, never the module that defines it, so moving code breaks
no checkpoint on disk: renaming a tag or reusing one for another record is a format change.
Checkpoints of format version 2 named records by module path; ``LEGACY_NAMES`` maps those
paths to today's tags, so they still load.

Loading checks a decoded tree before it replaces anything: ``field_problems`` against a
record's annotations, ``mismatches`` against the live value it is loaded over (an edited
``"lr": "fast"`` where the optimizer has a float).

The rules a decoded snapshot's own values meet (``RULES``, run by ``invalid_values``) are one
definition, applied by ``af.save`` to what it is about to write (before anything is written)
and by ``af.load`` to what it read (before anything changes), with the same messages: the
snapshot's field types, counters that are ints >= 0 with no fewer micro-batches than
updates, the stop record, RNG states the generators take, the optimizer state's structure,
a scheduler state with its type, and transform states under the name of the transform that
keeps each record (``STATES``). What a snapshot must be to fit one particular state is
``snapshot.check``; the manifest's own structure is ``_manifest``'s schema.
"""

from __future__ import annotations

import copy
import math
import types
import typing
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import attrs
import numpy as np
import torch

from accelfn.checkpoint import _rng
from accelfn.checkpoint._rng import RngState
from accelfn.errors import CheckpointError
from accelfn.state import TrainState
from accelfn.transforms import Layout, LossScale, Node, PowerSGDMemory, SkipCount, TreeWindow, Window

#: tag -> record class; the only records a checkpoint can hold
RECORDS: Mapping[str, type] = MappingProxyType({
    "loss_scale": LossScale,
    "skip_count": SkipCount,
    "accumulation_window": Window,
    "rng_state": RngState,
    "powersgd_state": PowerSGDMemory,
    "invariant_layout": Layout,
    "invariant_window": TreeWindow,
    "invariant_node": Node,
})
TAGS: Mapping[type, str] = MappingProxyType({cls: tag for tag, cls in RECORDS.items()})
#: the module paths format 2 wrote -> tag
LEGACY_NAMES: Mapping[str, str] = MappingProxyType({
    "accelfn._precision.LossScale": "loss_scale",
    "accelfn._precision.SkipCount": "skip_count",
    "accelfn.backends._interpreter.Window": "accumulation_window",
    "accelfn._rng.RngState": "rng_state",
})


def record_class(name: str) -> type | None:
    """The record class written as ``name`` (a tag, or a format-2 module path), or None."""
    return RECORDS.get(LEGACY_NAMES.get(name, name))


TENSOR, TUPLE, DICT, FLOAT, INT, BYTES, RECORD, NDARRAY, NUMPY = (
    "__tensor__", "__tuple__", "__dict__", "__float__", "__int__", "__bytes__", "__record__",
    "__ndarray__", "__numpy__",
)
_TAGS = frozenset({TENSOR, TUPLE, DICT, FLOAT, INT, BYTES, RECORD, NDARRAY, NUMPY})
_ATOMS = (str, bool, int, float, bytes, type(None))
_INT64 = 2**63


def copy_tree(tree: Any, tensor_fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``tree`` with every tensor replaced by ``tensor_fn(tensor)`` and every container copied.

    Records are rebuilt field by field (``attrs.evolve``); other objects are deep-copied.
    """
    if isinstance(tree, torch.Tensor):
        return tensor_fn(tree)
    if isinstance(tree, _ATOMS):
        return tree
    if isinstance(tree, Mapping):
        return {k: copy_tree(v, tensor_fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [copy_tree(v, tensor_fn) for v in tree]
    if isinstance(tree, tuple):
        items = [copy_tree(v, tensor_fn) for v in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else tuple(items)
    if attrs.has(type(tree)):
        return attrs.evolve(tree, **{f.name: copy_tree(getattr(tree, f.name), tensor_fn)
                                     for f in attrs.fields(type(tree)) if f.init})
    return copy.deepcopy(tree)


def view_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes ``t`` the same tensor as another: storage, offset, shape, strides, dtype
    (None for an empty tensor, or one without addressable storage, such as XLA's)."""
    if not t.numel():
        return None
    try:
        pointer = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return (t.device, pointer, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class Encoder:
    """Encodes trees into plain data, collecting their tensors in ``tensors``.

    The same tensor (same storage, offset, shape, strides and dtype) met twice, as tied
    weights are, is stored once and referenced twice. Tensors that share memory in any
    other way are stored as separate copies, since a ``.safetensors`` file cannot hold
    overlapping tensors.
    """

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._keys: dict[tuple[Any, ...], str] = {}
        self._storages: set[tuple[Any, ...]] = set()

    def tensor(self, t: torch.Tensor, key: str) -> str:
        """Adds ``t`` under ``key`` (or under the key of the same view added earlier)."""
        if t.layout != torch.strided or t.is_meta or t.is_quantized:
            raise ValueError(f"cannot save tensor {key!r}: {t.layout} {t.dtype} tensors on "
                             f"{t.device} are not supported; make it a dense tensor")
        t = t.detach()
        view = view_key(t)
        if view is not None and view in self._keys:
            return self._keys[view]
        storage = view[:2] if view is not None else None
        shares = storage is not None and storage in self._storages
        stored = t.clone(memory_format=torch.contiguous_format) if shares else t.contiguous()
        if view is not None:
            self._storages.add(view[:2])
            self._keys[view] = key if key not in self.tensors else f"{key}~{len(self.tensors)}"
            key = self._keys[view]
        elif key in self.tensors:
            key = f"{key}~{len(self.tensors)}"
        self.tensors[key] = stored
        return key

    def encode(self, tree: Any, prefix: str) -> Any:
        """Plain JSON data for ``tree``; its tensors are added under keys from ``prefix``
        (``prefix.key.0`` for ``tree["key"][0]``; with an empty prefix, ``key.0``).

        Raises:
            TypeError: a value that is none of the supported kinds (the message names it).
        """
        if isinstance(tree, torch.Tensor):
            return {TENSOR: self.tensor(tree, prefix)}
        if isinstance(tree, bool) or tree is None or isinstance(tree, str):
            return tree
        if isinstance(tree, int):
            return tree if -_INT64 <= tree < _INT64 else {INT: str(tree)}
        if isinstance(tree, float):
            return tree if math.isfinite(tree) else {FLOAT: repr(tree)}
        if isinstance(tree, bytes):
            return {BYTES: tree.hex()}
        if isinstance(tree, Mapping):
            if all(isinstance(k, str) for k in tree) and not _TAGS.intersection(tree):
                return {k: self.encode(v, _join(prefix, k)) for k, v in tree.items()}
            return {DICT: [[self.encode(k, _join(prefix, "key")), self.encode(v, _join(prefix, k))]
                           for k, v in tree.items()]}
        if isinstance(tree, list):
            return [self.encode(v, _join(prefix, i)) for i, v in enumerate(tree)]
        if isinstance(tree, tuple):
            return {TUPLE: [self.encode(v, _join(prefix, i)) for i, v in enumerate(tree)]}
        if isinstance(tree, np.ndarray):
            return {NDARRAY: self.tensor(torch.from_numpy(np.ascontiguousarray(tree)), prefix)}
        if isinstance(tree, np.generic):
            return {NUMPY: [tree.dtype.str, self.encode(tree.item(), prefix)]}
        if type(tree) in TAGS:
            cls = type(tree)
            fields = {f.name: self.encode(getattr(tree, f.name), _join(prefix, f.name))
                      for f in attrs.fields(cls) if f.init}
            return {RECORD: TAGS[cls], "fields": fields}
        raise TypeError(
            f"cannot save {prefix!r}: a {type(tree).__module__}.{type(tree).__qualname__}; "
            "checkpoints hold tensors, numpy arrays, numbers, strings, bytes, None, and lists, "
            "tuples and dicts of them (make state_dict() return those)"
        )


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _child(path: str, key: Any) -> str:
    """The path of ``tree[key]`` in messages: ``a.b`` for a str key, ``a[0]`` for another."""
    return _join(path, key) if isinstance(key, str) else f"{path}[{key!r}]"


def decode(plain: Any, tensors: Mapping[str, torch.Tensor], path: str = "") -> Any:
    """The tree ``plain`` encodes, its tensor references looked up in ``tensors``.

    Records are rebuilt only once each field has the type its annotation names
    (:func:`field_problems`).

    Args:
        plain: JSON data written by :meth:`Encoder.encode`.
        tensors: the tensor table its references point into.
        path: where ``plain`` sits (``"optimizer"``, ``"ranks[0].rng"``), for messages.

    Raises:
        CheckpointError: naming the path of the value: a reference to a tensor no file
            holds, a malformed tagged value, a record class that is not accelfn's, or a
            record field of the wrong type.
    """
    if isinstance(plain, list):
        if _scalars(plain):  # a JSON scalar decodes to itself (an RNG state is 600+ of them)
            return list(plain)
        return [decode(v, tensors, f"{path}[{i}]") for i, v in enumerate(plain)]
    if not isinstance(plain, dict):
        return plain
    tag = next(iter(plain), None) if len(plain) in (1, 2) else None
    if tag not in _TAGS:
        return {k: decode(v, tensors, _join(path, k)) for k, v in plain.items()}
    try:
        return _decode_tagged(tag, plain, tensors, path)
    except (TypeError, ValueError, KeyError, IndexError, OverflowError) as e:
        raise CheckpointError(f"{path or 'the root'}: a malformed {tag} value {_short(plain)} ({e})") from None


def _decode_tagged(tag: str, plain: dict[str, Any], tensors: Mapping[str, torch.Tensor], path: str) -> Any:
    if tag == TENSOR:
        return _lookup(tensors, plain[TENSOR], path)
    if tag == TUPLE:
        items = plain[TUPLE]
        if _scalars(items):
            return tuple(items)
        return tuple(decode(v, tensors, f"{path}[{i}]") for i, v in enumerate(items))
    if tag == DICT:
        items = [(decode(k, tensors, path), v) for k, v in plain[DICT]]
        return {k: decode(v, tensors, _child(path, k)) for k, v in items}
    if tag == FLOAT:
        return float(plain[FLOAT])
    if tag == INT:
        return int(plain[INT])
    if tag == BYTES:
        return bytes.fromhex(plain[BYTES])
    if tag == NDARRAY:
        return _lookup(tensors, plain[NDARRAY], path).numpy()
    if tag == NUMPY:
        dtype, value = plain[NUMPY]
        return np.dtype(dtype).type(decode(value, tensors, path))
    cls = _record_class(plain[RECORD], path)
    if not isinstance(plain["fields"], dict):
        raise TypeError("its fields are not a mapping")
    fields = {k: decode(v, tensors, _join(path, k)) for k, v in plain["fields"].items()}
    problems = field_problems(cls, fields, {name: _join(path, name) for name in fields})
    if problems:
        raise CheckpointError("; ".join(problems))
    try:
        return cls(**fields)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from None


def _scalars(items: list[Any]) -> bool:
    """True if no item of ``items`` (JSON data) is a list or an object."""
    return not any(isinstance(v, (list, dict)) for v in items)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def describe(value: Any) -> str:
    """``value`` in a message: short, with its type (``'fast' (a str)``, ``a float32 tensor of shape (3,)``)."""
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    if isinstance(value, np.ndarray):
        return f"a {value.dtype} array of shape {value.shape}"
    if isinstance(value, Mapping):
        return "a mapping"
    name = type(value).__name__
    return f"{_short(value)} ({'an' if name[0] in 'aeiou' else 'a'} {name})"


def _type_name(kind: Any) -> str:
    if isinstance(kind, type):
        return kind.__name__
    return str(kind).replace("typing.", "").replace("collections.abc.", "").replace("NoneType", "None")


def conforms(value: Any, kind: Any) -> bool:
    """True if ``value`` has the type annotation ``kind``: classes, ``X | Y``, ``tuple[X, ...]``,
    ``tuple[X, Y]`` (a list is taken for a tuple: JSON has no tuples), ``Mapping[K, V]``;
    ``float`` takes an int, ``int`` never takes a bool; other annotations are taken as met."""
    if kind is Any:
        return True
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, option) for option in args)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            if args[0] is int:  # the common long case (RNG states), without a call per item
                return all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            return all(conforms(v, args[0]) for v in value)
        return len(value) == len(args) and all(conforms(v, a) for v, a in zip(value, args))
    if origin in (Mapping, dict) or kind in (Mapping, dict):
        key, item = args or (Any, Any)
        return isinstance(value, Mapping) and all(conforms(k, key) and conforms(v, item) for k, v in value.items())
    return isinstance(value, kind) if isinstance(kind, type) else True


def field_problems(cls: type, fields: Mapping[str, Any], paths: Mapping[str, str]) -> list[str]:
    """``path: value, must be <annotation>`` for each of ``fields`` (values for the attrs
    class ``cls``) that does not have its field's type; ``paths`` names each field."""
    try:
        kinds = {f.name: f.type for f in attrs.fields(attrs.resolve_types(cls))}
    except NameError:  # an annotation this module cannot see: the class checks its own fields
        return []
    return [f"{paths.get(name, name)}: {describe(value)}, must be {_type_name(kinds[name])}"
            for name, value in fields.items() if name in kinds and not conforms(value, kinds[name])]


def _kind(value: Any) -> str | None:
    """The kind of value ``mismatches`` compares; None for None and for other objects."""
    if value is None:
        return None
    for kind, classes in (("bool", bool), ("number", (int, float, np.number)), ("str", str), ("bytes", bytes),
                          ("tensor", (torch.Tensor, np.ndarray)), ("mapping", Mapping), ("sequence", (list, tuple))):
        if isinstance(value, classes):
            return kind
    return "record" if attrs.has(type(value)) else None


def _scalar(value: Any) -> bool:
    """True for a number or a one-element tensor or array."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return not isinstance(value, np.ndarray) or value.size == 1


def mismatches(saved: Any, live: Any, path: str, source: str, *, complete: bool = False,
               lengths: bool = True, none_fits: bool = True) -> list[str]:
    """Where the tree ``saved`` (from ``source``) cannot replace ``live``, the value it is
    loaded over: values of other kinds (a str where a number is, a bool where a str is),
    tensors and arrays of other shapes or dtypes, records of other classes. None fits
    anything either way, a number and a one-element tensor fit each other, mappings are
    compared at their common keys, sequences of the same length item by item, and one of
    another length does not fit (the lists in torch's optimizer and scheduler states keep
    their lengths as they train, but for LBFGS's history, and LBFGS needs a closure no
    accelfn step passes). Objects of other types are not compared.

    With ``complete``, a mapping must have every key the live one has (what a
    ``load_state_dict`` reads); without ``lengths``, sequences of another length are not
    compared (a user's ``extra`` state, whose history may grow); without ``none_fits``, None
    fits only None (against the state an optimizer would hold, ``snapshot._probed_state``).
    """
    a, b = _kind(saved), _kind(live)
    if not none_fits and (saved is None) != (live is None):
        return [f"{path}: {describe(saved)} in {source}, {describe(live)} here"]
    if a is None or b is None:
        return []
    if a != b:
        if {a, b} == {"number", "tensor"} and _scalar(saved) and _scalar(live):
            return []
        return [f"{path}: {describe(saved)} in {source}, {describe(live)} here"]
    if a == "tensor":
        if tuple(saved.shape) != tuple(live.shape):
            return [f"{path}: {describe(saved)} in {source}, {describe(live)} here"]
        if isinstance(saved, torch.Tensor) == isinstance(live, torch.Tensor) and saved.dtype != live.dtype:
            return [f"{path}: dtype {saved.dtype} in {source}, {live.dtype} here"]
    if a == "mapping":
        missing = [f"{_child(path, k)}: missing from {source} ({describe(live[k])} here)"
                   for k in live if k not in saved] if complete else []
        return missing + [p for k in saved if k in live for p in mismatches(
            saved[k], live[k], _child(path, k), source, complete=complete, lengths=lengths, none_fits=none_fits)]
    if a == "sequence":
        if len(saved) != len(live):
            return [] if not lengths else [
                f"{path}: {describe(saved)} in {source}, {describe(live)} here ({len(saved)} items, not {len(live)})"]
        return [p for i, (x, y) in enumerate(zip(saved, live)) for p in mismatches(
            x, y, f"{path}[{i}]", source, complete=complete, lengths=lengths, none_fits=none_fits)]
    if a == "record":
        if type(saved) is not type(live):
            return [f"{path}: a {type(saved).__name__} in {source}, a {type(live).__name__} here"]
        return [p for f in attrs.fields(type(saved)) if f.init
                for p in mismatches(getattr(saved, f.name), getattr(live, f.name), _join(path, f.name), source,
                                    complete=complete, lengths=lengths, none_fits=none_fits)]
    return []


def _lookup(tensors: Mapping[str, torch.Tensor], key: str, path: str) -> torch.Tensor:
    if not isinstance(key, str) or key not in tensors:
        raise CheckpointError(f"{path}: refers to tensor {key!r}, which no tensor file holds")
    return tensors[key]


def _record_class(name: str, path: str) -> type:
    cls = record_class(name) if isinstance(name, str) else None
    if cls is None:
        raise CheckpointError(f"{path}: a record tagged {name!r}, which this accelfn does not have (it reads "
                              f"{', '.join(map(repr, RECORDS))})")
    return cls


#: TrainState fields a snapshot holds in parts of their own; every other field is a counter
_PARTS = frozenset({"model", "optimizer", "scheduler", "transforms_state", "extra", "stopped", "data_state"})
COUNTERS: tuple[str, ...] = tuple(f.name for f in attrs.fields(TrainState) if f.name not in _PARTS)
#: ``TrainState.transforms_state``'s keys and the record each holds (the transform that keeps
#: it): loss scale and skip count (``with_precision``, ``skip_nonfinite``), the open
#: accumulation window (``accumulate``), ``invariant()``'s layout and open window,
#: ``replicate``'s PowerSGD memory
STATES: Mapping[str, type] = MappingProxyType({
    "loss_scale": LossScale,
    "skips": SkipCount,
    "window": Window,
    "tree_window": TreeWindow,
    "invariant": Layout,
    "comm_hook": PowerSGDMemory,
})

Names = Callable[[str], str]


class Rule(NamedTuple):
    """A named check: every problem of a snapshot's values (``name(field)`` names a field in
    messages, ``counters`` or ``ranks[1].rng``)."""

    name: str
    check: Callable[[Any, Names], list[str]]


def _types(snap: Any, name: Names) -> list[str]:
    fields = {f.name: getattr(snap, f.name) for f in attrs.fields(type(snap))}
    return field_types(type(snap), fields, name)


def field_types(cls: type, fields: Mapping[str, Any], name: Names) -> list[str]:
    """``path: value, must be <annotation>`` for each of ``fields`` that does not have the type
    the attrs class ``cls`` gives it (a snapshot's fields, checked before it is built)."""
    return field_problems(cls, fields, {key: name(key) for key in fields})


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _counters(snap: Any, name: Names) -> list[str]:
    counters, where = snap.counters, name("counters")
    found = [f"{where}.{key}: {describe(value)}, must be an int >= 0"
             for key, value in counters.items() if not _is_count(value)]
    if set(counters) != set(COUNTERS):
        found.append(f"{where}: {sorted(counters)}, must be {sorted(COUNTERS)}")
    return found


def _micro_step(snap: Any, name: Names) -> list[str]:
    counters, where = snap.counters, name("counters")
    if not all(_is_count(counters.get(key)) for key in ("step", "micro_step")):
        return []  # the counters rule names them
    if counters["micro_step"] < counters["step"]:
        return [f"{where}.micro_step: {counters['micro_step']}, below {where}.step ({counters['step']}); "
                "every optimizer update consumes at least one micro-batch"]
    return []


def _stopped(snap: Any, name: Names) -> list[str]:
    stopped = snap.stopped
    if stopped is None or (set(stopped) == {"step", "reason"} and isinstance(stopped["reason"], str)
                           and _is_count(stopped["step"])):
        return []
    return [f"{name('stopped')}: {describe(stopped)}, must be None or {{'step': <int >= 0>, 'reason': <str>}}"]


def _rng_states(snap: Any, name: Names) -> list[str]:
    return [f"{name('rng')}.{problem}" for problem in _rng.problems(snap.rng)]


def _is_sequence(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def _optimizer(snap: Any, name: Names) -> list[str]:
    state, groups = snap.optimizer.get("state"), snap.optimizer.get("param_groups")
    if (isinstance(state, Mapping) and all(isinstance(v, Mapping) for v in state.values())
            and _is_sequence(groups) and all(
                isinstance(g, Mapping) and _is_sequence(g.get("params"))
                and all(isinstance(i, int) and not isinstance(i, bool) for i in g["params"]) for g in groups)):
        return []
    return [f"{name('optimizer')}: not a state_dict of a torch optimizer (a mapping of 'state' to a mapping of "
            "each parameter's index to a mapping, and 'param_groups' to a list of mappings, each with a list "
            "of parameter indices under 'params')"]


def _scheduler(snap: Any, name: Names) -> list[str]:
    if (snap.scheduler is None) != (snap.scheduler_type is None):
        return [f"{name('scheduler')}: {describe(snap.scheduler)} for a scheduler of type {snap.scheduler_type}"]
    return []


def _transforms_state(snap: Any, name: Names) -> list[str]:
    where, found = name("transforms_state"), []
    for key, value in snap.transforms_state.items():
        cls = STATES.get(key)
        if cls is None:
            found.append(f"{where}.{key}: no transform keeps a state of this name (this accelfn's are "
                         f"{', '.join(STATES)})")
        elif type(value) is not cls:
            found.append(f"{where}.{key}: {describe(value)}, must be a {cls.__name__} record")
        elif isinstance(value, Window):
            found += _window(value, f"{where}.{key}")
    return found


def _one_number(value: Any) -> bool:
    """A number, or a tensor of one element (a count, a metric's sum)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _window(window: Window, where: str) -> list[str]:
    """An open accumulation window's counts and sums are numbers or tensors of one element
    (losses and metrics are scalars), its loss sum a floating-point one, its sample count an
    int >= 0."""
    found = [f"{where}.{name}: {describe(value)}, must be a number or a tensor of one element"
             for name, value in (("reference", window.reference), ("count", window.count), ("unit", window.unit),
                                 *((f"metric_sums.{k}", v) for k, v in window.metric_sums.items()))
             if not _one_number(value)]
    loss = window.loss_sum
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
        found.append(f"{where}.loss_sum: {describe(loss)}, must be a floating-point tensor of one element")
    if not _is_count(window.num_samples):
        found.append(f"{where}.num_samples: {describe(window.num_samples)}, must be an int >= 0")
    return found


#: every rule, in the order they run; ``types`` first, the others only once it passed
RULES: tuple[Rule, ...] = (
    Rule("types", _types),
    Rule("counters", _counters),
    Rule("micro_step", _micro_step),
    Rule("stopped", _stopped),
    Rule("rng", _rng_states),
    Rule("optimizer", _optimizer),
    Rule("scheduler", _scheduler),
    Rule("transforms_state", _transforms_state),
)


def invalid_values(snap: Any, *, names: Mapping[str, str] = MappingProxyType({})) -> list[str]:
    """Every value of the snapshot ``snap`` that no state could take (empty if none), by
    ``RULES``: fields of the wrong types, counters that are not ints >= 0 (or fewer
    micro-batches than updates), a malformed stop record, RNG states the generators refuse,
    an optimizer state without the structure torch's ``load_state_dict`` reads, a scheduler
    state without its type, transform states under no transform's name or of another record.
    ``names`` says how a Snapshot field is named in messages (``"ranks[1].rng"``; itself by
    default)."""
    def name(field: str) -> str:
        return names.get(field, field)

    first, *rest = RULES
    found = first.check(snap, name)
    if found:
        return found
    return [problem for rule in rest for problem in rule.check(snap, name)]
