"""Corrupted checkpoints by the hundred, seeded: each is refused with a CheckpointError before
anything in the state changes, or loads exactly what was saved.

One small checkpoint (a 6-16-3 model, its first layer frozen, so that its tensors are in
``frozen.safetensors``, mid-accumulation-window under fp16: AdamW moments and
scalar steps, a cosine schedule, the loss scale and skip count, the open window and its
gradients, ``extra`` objects with a list, a tuple, a tensor and a numpy array) is saved once;
each mutation rewrites one or two of its files in place and puts them back after the load
(a load of it takes milliseconds, so hundreds take seconds). The mutations: bit flips and
truncations of any file; truncations, header bit flips and header edits of the tensor files
(shapes, dtypes, names, a tensor dropped) and edits of ``manifest.json`` (a value of another
kind, a key missing or unknown, counters out of range, records and tagged values malformed,
a tensor reference to another tensor), each with its checksums recomputed so that it passes
the checksum checks and meets the validation behind them.

What is not a mutation here, since a checkpoint so edited is a valid one, however unlikely:
a value changed for another of its kind (an ``lr`` of 0.5), a parameter without optimizer
state or gradient, a state entry of a transform not in the checkpoint, None in a torch or
user state (None fits any value there: torch's options take None for "default"), a list of
a user's ``extra`` state of another length (a history grows), a one-element tensor of an open
window reshaped to another shape of one element (a loss of shape ``(1,)`` is a loss).
"""

from __future__ import annotations

import random
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import orjson
import pytest
import torch

import accelfn as af
from accelfn.checkpoint._codec import RECORDS
from accelfn.errors import CheckpointError
from tests.helpers.corrupt import Files, Mutation, header_edits, signed
from tests.helpers.states import build, everything, loader, program, same_tree


class Moments:
    """An ``extra`` object with a tensor, a numpy array, a tuple and a scalar tensor in its state."""

    def __init__(self) -> None:
        self.mean, self.counts, self.shape, self.seen = torch.arange(6.0).reshape(2, 3), np.arange(3), (2, 3.5, "x"), 0

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "counts": self.counts, "shape": self.shape, "seen": torch.tensor(self.seen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean, self.counts, self.shape, self.seen = state["mean"], state["counts"], state["shape"], int(state["seen"])


def _state(seed: int) -> af.TrainState:
    state = build(seed, extra=True)
    state.model.fc1.requires_grad_(False)  # a frozen layer (a LoRA's base): its own frozen.safetensors
    return state.replace(extra={**state.extra, "moments": Moments()})


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, af.Snapshot]:
    """The checkpoint, saved mid-window after 5 micro-batches of an fp16 program, and its snapshot."""
    cpu, step = af.backends.CPU(af.backends.LaunchEnv()), program(af.with_precision("fp16"))
    state, step_fn = cpu.prepare(step, _state(0))
    for batch, last in list(cpu.batches(loader(), step, 0))[:5]:
        state, _ = step_fn(state, batch, flush=last)
    state.extra["counter"].seen, state.extra["counter"].history = 7, [0.5, 2.0]
    state.extra["moments"].seen = 3
    path = af.save(state, tmp_path_factory.mktemp("fuzz") / "ckpt")
    return path, af.snapshot(state)


def _tensor_files(files: Files) -> list[str]:
    return sorted(name for name in files if name.endswith(".safetensors"))


def _one_of_a_window(key: str) -> bool:
    """A tensor of the open window: of one element, whose shape does not matter."""
    return key.startswith("transforms_state.window.")


def _flips(rng: random.Random, files: Files, n: int) -> Iterator[Mutation]:
    """A bit flipped anywhere in any file: the checksums say so."""
    for _ in range(n):
        name = rng.choice(sorted(files))
        data, i = bytearray(files[name]), rng.randrange(len(files[name]))
        data[i] ^= 1 << rng.randrange(8)
        yield f"bit flip at {name}[{i}]", {name: bytes(data)}


def _truncations(rng: random.Random, files: Files, n: int, *, sign: bool) -> Iterator[Mutation]:
    """A file cut short; with ``sign``, a tensor file or the manifest, checksums recomputed."""
    names = _tensor_files(files) + ["manifest.json"] if sign else sorted(files)
    for _ in range(n):
        name = rng.choice(names)
        k = rng.randrange(len(files[name]))
        cut = {name: files[name][:k]}
        yield f"{name} cut to {k} bytes{', signed' if sign else ''}", signed(files, cut) if sign else cut


def _header_flips(rng: random.Random, files: Files, n: int) -> Iterator[Mutation]:
    """A bit flipped in a tensor file's length or JSON header, checksums recomputed."""
    for _ in range(n):
        name = rng.choice(_tensor_files(files))
        data = bytearray(files[name])
        i = rng.randrange(8 + struct.unpack_from("<Q", data)[0])
        data[i] ^= 1 << rng.randrange(8)
        yield f"header bit flip at {name}[{i}], signed", signed(files, {name: bytes(data)})


#: a value of each kind ``mismatches`` and the schema tell apart (None fits anything in a state tree)
KINDS = {"int": 7, "float": 2.5, "str": "x", "bool": True, "list": [1], "dict": {"a": 1}}


def _kind(value: Any) -> str:
    if isinstance(value, dict) and set(value) & {"__tensor__", "__ndarray__"}:
        return "tensor"
    if isinstance(value, dict) and "__tuple__" in value:
        return "tuple"
    if isinstance(value, bool):
        return "bool"
    return {int: "int", float: "float", str: "str", list: "list", dict: "dict"}.get(type(value), "other")


def _other_kinds(value: Any, *, numbers: bool = False) -> list[Any]:
    """Values that decode to kinds other than ``value``'s: an int and a float are one kind, a
    number, where ``numbers``; a list and a tuple are sequences; a number fits a tensor of one
    element, so none replaces a tensor."""
    same = {_kind(value)}
    if numbers and same & {"int", "float"}:
        same = {"int", "float"}
    same |= {"tuple": {"list"}, "tensor": {"int", "float"}}.get(_kind(value), set())
    return [v for k, v in KINDS.items() if k not in same]


def _unfilled_group_keys(group: dict[str, Any]) -> list[str]:
    """The keys of an AdamW param group that torch's ``load_state_dict`` leaves out when the
    saved group lacks them (its ``__setstate__`` fills in the others)."""
    missing = []
    for key in (k for k in group if k != "params"):
        new = torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
        new.__setstate__({**new.__getstate__(), "param_groups": [
            {**{k: v for k, v in group.items() if k not in (key, "params")}, "params": new.param_groups[0]["params"]}]})
        if key not in new.param_groups[0]:
            missing.append(key)
    return missing


def _edits(manifest: dict[str, Any]) -> list[tuple[tuple[Any, ...], str, Any]]:
    """Every edit of the manifest a load must refuse: ``(path, "set"|"delete"|"add", value)``."""
    edits: list[tuple[tuple[Any, ...], str, Any]] = []

    def kinds(path: tuple[Any, ...], value: Any, *, numbers: bool = False) -> None:
        edits.extend((path, "set", v) for v in _other_kinds(value, numbers=numbers))

    for key, value in manifest.items():  # the schema's fields: another kind, missing, one unknown
        edits.append(((key,), "delete", None))
        kinds((key,), value, numbers=True)
    edits += [((), "add", "zz"), (("ranks", 0), "add", "zz")]
    counters = manifest["counters"]
    for key in counters:
        edits += [(("counters", key), "set", v) for v in (-1, 2.0, "3", True, None)]
        edits.append((("counters", key), "delete", None))
    edits += [(("counters",), "add", "zz"), (("counters", "micro_step"), "set", counters["step"] - 1)]
    rank = manifest["ranks"][0]
    for key in rank:
        edits.append((("ranks", 0, key), "delete", None))
        kinds(("ranks", 0, key), rank[key])
    for name, entry in manifest["files"].items():
        edits += [(("files", name, key), "set", v) for key in entry for v in _other_kinds(entry[key])]
        edits += [(("files", name, "num_bytes"), "set", -1), (("files", name, "rank"), "set", 5), (("files", name), "add", "zz")]
    edits += [(("world_size",), "set", 0), (("world_size",), "set", 2), (("format_version",), "set", 0)]
    for key, record in rank["transforms_state"].items():  # records: fields missing, unknown, of other kinds
        where = ("ranks", 0, "transforms_state", key)
        edits += [(where + ("fields",), "add", "zz"), (where + ("__record__",), "set", "no_such_record")]
        required = {f.name for f in attrs.fields(RECORDS[record["__record__"]]) if f.default is attrs.NOTHING}
        for field, value in record["fields"].items():
            if field in required:  # a field with a default is one an older checkpoint may lack
                edits.append((where + ("fields", field), "delete", None))
            kinds(where + ("fields", field), value, numbers=True)
    edits += [(("ranks", 0, "transforms_state", "zz"), "set", 1), (("ranks", 0, "transforms_state", "skips"), "set", 0)]
    rng = rank["rng"]["fields"]
    edits += [(("ranks", 0, "rng", "fields", "torch_cpu"), "set", "00"),
              (("ranks", 0, "rng", "fields", "numpy", "__tuple__", 1, "__tuple__", 5), "delete", None),
              (("ranks", 0, "rng", "fields", "python", "__tuple__", 1, "__tuple__", 3), "set", "x"),
              (("ranks", 0, "rng", "fields", "numpy", "__tuple__", 2), "set", 10**6)]
    edits += [(("ranks", 0, "rng", "fields", key), "delete", None) for key in rng]
    refs = sorted((("model", k), v["__tensor__"]) for k, v in manifest["model"].items())
    for i, (path, key) in enumerate(refs):  # a reference to a missing tensor, and to another of another shape
        edits += [(path, "set", {"__tensor__": "no_such_tensor"}), (path, "set", {"__tensor__": refs[i - 1][1]})]
    group = manifest["optimizer"]["param_groups"][0]
    for key, value in group.items():
        if value is not None:  # torch's None: its default, whatever it is
            kinds(("optimizer", "param_groups", 0, key), value, numbers=True)
    edits += [(("optimizer", "param_groups", 0, key), "delete", None) for key in _unfilled_group_keys(group)]
    edits += [(("optimizer", "param_groups", 0, "eps"), "set", {"__float__": "abc"}),
              (("optimizer", "param_groups", 0, "betas"), "set", {"__tuple__": 3}),
              (("optimizer", "param_groups", 0, "lr"), "set", -1.0)]
    for index, entry in manifest["optimizer"]["state"]["__dict__"]:
        position = manifest["optimizer"]["state"]["__dict__"].index([index, entry])
        for key in entry:  # (a number for a tensor of one element is what older torch saved as step)
            where = ("optimizer", "state", "__dict__", position, 1, key)
            edits += [(where, "delete", None), (where, "set", "x"), (where, "set", [1])]
            edits += [(where, "set", 1.5)] if key != "step" else []
    edits.append((("optimizer", "state", "__dict__", 0, 0), "set", 9))
    scheduler = manifest["scheduler"]
    for key, value in scheduler.items():
        kinds(("scheduler", key), value, numbers=True)
        if not key.startswith("_"):
            edits.append((("scheduler", key), "delete", None))
    for name, tree in manifest["extra"].items():  # a user's state: what its load_state_dict reads
        edits += [(("extra", name), "set", v) for v in (7, "x", [1])] + [(("extra", name), "delete", None)]
        for key, value in tree.items():
            edits.append((("extra", name, key), "delete", None))
            kinds(("extra", name, key), value, numbers=True)
    edits.append((("optimizer_params", "__tuple__", 0, "__tuple__", 0), "set", "no_such_parameter"))
    edits.append((("stopped",), "set", {"step": -1, "reason": "x"}))
    return edits


def _edited(manifest: dict[str, Any], path: tuple[Any, ...], how: str, value: Any) -> dict[str, Any]:
    edited = orjson.loads(orjson.dumps(manifest))
    node = edited
    for key in path[:-1] if how != "add" else path:
        node = node[key]
    if how == "add":
        node[value] = 1
    elif how == "delete":
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return edited


def _manifest_edits(rng: random.Random, files: Files, n: int) -> Iterator[Mutation]:
    """``n`` of the manifest edits (``_edits``), drawn without replacement, the checksum recomputed."""
    manifest = orjson.loads(files["manifest.json"])
    for path, how, value in rng.sample(_edits(manifest), n):
        changed = {"manifest.json": orjson.dumps(_edited(manifest, path, how, value))}
        yield f"manifest {'.'.join(map(str, path))} {how} {value!r}", signed(files, changed)


def _mutations(files: Files) -> list[Mutation]:
    rng = random.Random(2024)
    return [*_flips(rng, files, 60), *_truncations(rng, files, 30, sign=False),
            *_truncations(rng, files, 30, sign=True), *_header_flips(rng, files, 40),
            *header_edits(rng, files, _tensor_files(files), 60, _one_of_a_window), *_manifest_edits(rng, files, 140)]


def test_hundreds_of_corrupted_checkpoints_are_refused_and_change_nothing(saved) -> None:
    """360 seeded corruptions of one checkpoint (bit flips and truncations of any file; tensor
    file headers and manifest.json edited with their checksums recomputed): each load raises a
    CheckpointError and leaves the state it was loading into, and the global generators,
    exactly as they were, or loads exactly the saved state; none loads anything else."""
    path, snap = saved
    files = {p.name: p.read_bytes() for p in path.iterdir()}
    mutations = _mutations(files)
    assert len(mutations) >= 300 and len({what for what, _ in mutations}) > 250
    target = _state(99)
    before = everything(target)
    raised, loaded, wrong = 0, 0, []
    for what, changed in mutations:
        for name, data in changed.items():
            (path / name).write_bytes(data)
        try:
            state = af.load(path, into=target)
        except CheckpointError:
            raised += 1
            if not same_tree(everything(target), before):
                wrong.append(f"{what}: the failed load changed the state")
                target = _state(99)
                before = everything(target)
        except Exception as e:  # what this test is about: nothing but CheckpointError
            wrong.append(f"{what}: {type(e).__name__}: {e}")
            target = _state(99)
            before = everything(target)
        else:
            loaded += 1
            now = af.snapshot(state)
            if not all(same_tree(getattr(now, f), getattr(snap, f)) for f in ("model", "optimizer", "scheduler",
                                                                               "extra", "counters", "transforms_state",
                                                                               "grads", "stopped")):
                wrong.append(f"{what}: loaded a state other than the saved one")
            target = _state(99)
            before = everything(target)
        finally:
            for name in changed:
                (path / name).write_bytes(files[name])
    assert not wrong, "\n".join(wrong)
    assert raised > 0.95 * len(mutations), (raised, loaded)
