"""State trees (``state_dict``s, transform records) to plain JSON data plus a tensor table.

A state tree is what ``state_dict()`` returns: nested dicts, lists and tuples of tensors,
numbers, strings and None, plus accelfn's own frozen ``attrs`` records (the loss scale, the
accumulation window). ``Encoder.encode`` turns a tree into JSON-compatible data in which
every tensor is replaced by a reference ``{"__tensor__": key}`` into a table of tensors
(written to ``.safetensors`` files); ``decode`` is the inverse. JSON cannot tell a tuple
from a list, an int key from a str key, or write inf/NaN, so those are tagged. Nothing is
ever unpickled: a record is rebuilt only if its class is an ``attrs`` class of accelfn.
"""

from __future__ import annotations

import copy
import importlib
import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np
import torch

from accelfn._errors import CheckpointError

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
            self._storages.add(storage)
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
        if attrs.has(type(tree)):
            cls = type(tree)
            fields = {f.name: self.encode(getattr(tree, f.name), _join(prefix, f.name))
                      for f in attrs.fields(cls) if f.init}
            return {RECORD: f"{cls.__module__}.{cls.__qualname__}", "fields": fields}
        raise TypeError(
            f"cannot save {prefix!r}: a {type(tree).__module__}.{type(tree).__qualname__}; "
            "checkpoints hold tensors, numpy arrays, numbers, strings, bytes, None, and lists, "
            "tuples and dicts of them (make state_dict() return those)"
        )


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def decode(plain: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The tree ``plain`` encodes, its tensor references looked up in ``tensors``.

    Raises:
        CheckpointError: a reference to a tensor no file holds, an unknown tag, or a record
            class that is not accelfn's.
    """
    if isinstance(plain, list):
        return [decode(v, tensors) for v in plain]
    if not isinstance(plain, dict):
        return plain
    tag = next(iter(plain), None) if len(plain) in (1, 2) else None
    if tag == TENSOR:
        return _lookup(tensors, plain[TENSOR])
    if tag == TUPLE:
        return tuple(decode(v, tensors) for v in plain[TUPLE])
    if tag == DICT:
        return {decode(k, tensors): decode(v, tensors) for k, v in plain[DICT]}
    if tag == FLOAT:
        return float(plain[FLOAT])
    if tag == INT:
        return int(plain[INT])
    if tag == BYTES:
        return bytes.fromhex(plain[BYTES])
    if tag == NDARRAY:
        return _lookup(tensors, plain[NDARRAY]).numpy()
    if tag == NUMPY:
        dtype, value = plain[NUMPY]
        return np.dtype(dtype).type(decode(value, tensors))
    if tag == RECORD:
        cls = _record_class(plain[RECORD])
        fields = {k: decode(v, tensors) for k, v in plain["fields"].items()}
        try:
            return cls(**fields)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"cannot rebuild a {plain[RECORD]} from the fields {sorted(fields)}: {e}") from None
    return {k: decode(v, tensors) for k, v in plain.items()}


def _lookup(tensors: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    try:
        return tensors[key]
    except KeyError:
        raise CheckpointError(f"the manifest refers to tensor {key!r}, which no tensor file holds") from None


def _record_class(name: str) -> type:
    module, _, qualname = name.rpartition(".")
    if module != "accelfn" and not module.startswith("accelfn."):
        raise CheckpointError(f"the checkpoint holds a record of class {name!r}; only accelfn's records can be loaded")
    try:
        cls = getattr(importlib.import_module(module), qualname)
    except (ImportError, AttributeError):
        raise CheckpointError(f"the checkpoint holds a record of class {name!r}, which this accelfn "
                              "does not have") from None
    if not (isinstance(cls, type) and attrs.has(cls)):
        raise CheckpointError(f"{name!r} in the checkpoint is not an accelfn record")
    return cls
