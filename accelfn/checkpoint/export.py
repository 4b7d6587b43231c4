"""``save_model``: a state's model as consolidated weights in the Hugging Face layout.

For inference and for other tools, not for resuming (that is ``af.save``): the unwrapped
model's ``state_dict`` as full tensors in ``model.safetensors``, or, above
``max_shard_size``, in ``model-00001-of-0000N.safetensors`` files plus
``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {name:
file}}``), the layout ``transformers``' ``save_pretrained`` writes and ``from_pretrained``
reads (https://huggingface.co/docs/safetensors/, Accelerate's ``Accelerator.save_model``).

Tied weights are written under each of their names (safetensors keeps no shared storage,
so each name gets its own copy): ``safetensors.torch.load_file`` then
``load_state_dict(strict=True)`` finds every key of a freshly built model, and
``from_pretrained`` ties them again as the model's config says.

Nothing the user wrote is lost: every file an export writes carries a mark (``MARK`` in the
safetensors header's metadata, and in the index's ``metadata``), and an export replaces or
removes only marked files. A folder holding files of the layout's names without the mark
(another tool's export, the user's own, a checkpoint's ``model.safetensors``) is refused
before anything is written, and so is a checkpoint directory.

Under sharding (DTensor parameters) this is a collective: the tensors are gathered one by
one in ``state_dict`` order (``DTensor.full_tensor``, an all-gather, so every rank briefly
holds one full tensor), and rank 0 keeps them on the CPU only until the file they belong to
is written: no rank ever holds more than one file's worth (at most ``max_shard_size``, or
one tensor larger than that) besides its own shards. A pipelined model's stages (``af.pipeline``)
send rank 0 their tensors of one file at a time, in the whole model's order, likewise.

``load_model`` reads such weights (``save_model``'s, or a Hugging Face ``model.safetensors``
or sharded index) back into a state's model, sharded or split as it is: each rank reads only
the slices of its own shards (``safetensors.safe_open(...).get_slice``), so no rank ever
holds the whole model, as for a model built on the meta device and prepared.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
from pathlib import Path
from typing import Any

import orjson
import safetensors.torch
import torch

from accelfn import distributed
from accelfn._version import __version__
from accelfn.checkpoint import _adapters, _atomic, _pipelined
from accelfn.checkpoint._format import MANIFEST
from accelfn.checkpoint.snapshot import clean_name, unwrap
from accelfn.distributed import ProcessContext, is_dtensor
from accelfn.errors import CheckpointError, to_path
from accelfn.state import TrainState, require_state

__all__ = ["INDEX", "MARK", "WEIGHTS", "load_model", "parse_size", "save_model"]

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: the metadata key (value: accelfn's version) that marks the files ``save_model`` wrote
MARK = "accelfn.save_model"
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: Any) -> int:
    """Bytes in ``value``: an int, or a string such as ``"5GB"`` (10**9) or ``"512MiB"`` (2**20).

    Raises:
        TypeError: neither an int nor a str.
        ValueError: not a size, or not > 0.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"save_model(max_shard_size=...) takes bytes as an int or a str such as '5GB', got {value!r}")
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match is None:
            raise ValueError(f"save_model(max_shard_size={value!r}): not a size; write it as '10GB', '500MB' or "
                             "'2GiB' (B, KB, MB, GB, TB are powers of 1000; KiB, MiB, GiB, TiB of 1024)")
        value = int(float(match[1]) * _UNITS[match[2].lower()])
    if value <= 0:
        raise ValueError(f"save_model(max_shard_size={value!r}): must be > 0 bytes")
    return value


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _plan(tensors: list[tuple[str, torch.Tensor]], limit: int) -> list[list[str]]:
    """Names per file, in order: a file takes tensors until the next would pass ``limit``
    (a tensor larger than ``limit`` gets a file of its own)."""
    files: list[list[str]] = [[]]
    size = 0
    for name, t in tensors:
        if files[-1] and size + _nbytes(t) > limit:
            files.append([])
            size = 0
        files[-1].append(name)
        size += _nbytes(t)
    return files


def _is_layout(name: str) -> bool:
    return name in (WEIGHTS, INDEX, _adapters.ADAPTER_WEIGHTS) or _SHARD.match(name) is not None


def _marked(path: Path) -> bool:
    """True for a weights file or index that ``save_model`` wrote (``MARK`` in its metadata)."""
    try:
        with open(path, "rb") as f:
            if path.name == INDEX:
                metadata = orjson.loads(f.read()).get("metadata")
            else:  # safetensors: an 8-byte little-endian header length, then the JSON header
                (length,) = struct.unpack("<Q", f.read(8))
                if length > 100 * 2**20:
                    return False
                metadata = orjson.loads(f.read(length)).get("__metadata__")
    except (OSError, ValueError, struct.error, AttributeError):  # orjson.JSONDecodeError is a ValueError
        return False
    return isinstance(metadata, dict) and MARK in metadata


def _check_target(directory: Path) -> None:
    """Raises before anything is written unless ``save_model`` may write into ``directory``."""
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"save_model(): {directory} is a file, not a folder; pass a folder")
    if not directory.exists():
        return
    if (directory / MANIFEST).exists():
        raise CheckpointError(
            f"save_model(): {directory} is an accelfn checkpoint (it holds {MANIFEST}); exporting into it would "
            f"replace the checkpoint's own {WEIGHTS}, and it would no longer load. Export to a folder of its "
            f"own, e.g. {directory.parent / 'export'}")
    foreign = sorted(e.name for e in os.scandir(directory) if _is_layout(e.name) and not _marked(Path(e.path)))
    if foreign:
        raise CheckpointError(
            f"save_model(): {directory} holds {', '.join(foreign)}, which save_model did not write (another tool's "
            "export, or files of your own); save_model replaces only the files of its own exports: move them "
            "away, or export to another folder")


def _write_file(path: Path, data: bytes | None, tensors: dict[str, torch.Tensor] | None) -> None:
    part = path.with_name(f".{path.name}.part")
    if tensors is not None:
        safetensors.torch.save_file(tensors, part, metadata={"format": "pt", MARK: __version__})
    else:
        part.write_bytes(data or b"")
    with open(part, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(part, path)


def save_model(state: TrainState, directory: str | os.PathLike[str], *, max_shard_size: int | str = "10GB",
               adapters: str | None = None, backend: ProcessContext | None = None) -> Path:
    """Writes ``state``'s model as consolidated safetensors weights in the Hugging Face layout.

    ``directory/model.safetensors``, or ``model-00001-of-0000N.safetensors``, ... and
    ``model.safetensors.index.json`` when the weights pass ``max_shard_size``. Keys are the
    unwrapped model's ``state_dict`` names (no ``module.``/``_orig_mod.``); tied weights are
    written under each name. Each file is written to a temporary name, fsynced and renamed;
    the index comes last; files of an earlier export with other names are then removed
    (only files an export wrote: each carries ``MARK`` in its metadata). A
    collective in a multi-process world (call it on every rank): rank 0 writes; sharded
    (DTensor) tensors are gathered one at a time, so rank 0 holds at most one file's worth.

    Args:
        state: the state whose model to export (nothing in it changes).
        directory: the folder to write (created when needed).
        max_shard_size: the most bytes of tensors per file: an int, or a str such as
            ``"5GB"`` (powers of 1000) or ``"4GiB"`` (powers of 1024); the default is
            Accelerate's ``save_model``'s.
        adapters: for a ``peft.PeftModel`` (LoRA, ...; its active adapter): None writes the
            model as it is, under peft's wrapped names; ``"peft"`` the adapter alone in PEFT's
            own layout (``adapter_model.safetensors`` + ``adapter_config.json``, what
            ``PeftModel.from_pretrained(base, directory)`` reads); ``"merged"`` the base
            model with the adapter merged into its weights, under the base model's own names,
            plus its ``config.json`` for a ``transformers`` model (what
            ``AutoModelForCausalLM.from_pretrained(directory)`` reads). Both go through peft's
            own functions (``get_peft_model_state_dict``; ``merge_and_unload`` on a CPU copy:
            the state is not touched); rank 0 holds the whole merged model in CPU memory.
            Export the two into separate folders (``from_pretrained`` takes a folder with an
            ``adapter_config.json`` for an adapter). Sharded and tensor-parallel models
            (DTensors) are gathered first; their merged copy is built from the base model's
            class and config (a ``transformers`` model). An adapter is written as one file,
            whatever ``max_shard_size``; a merged model is split by it.
        backend: the process context (as for ``af.save``).

    Returns:
        Path: ``directory``.

    Raises:
        TypeError: ``state`` is not a TrainState, ``directory`` not a path, or a
            ``max_shard_size`` of another type.
        ValueError: a ``max_shard_size`` that is not a size > 0; ``adapters`` not None,
            ``"peft"`` or ``"merged"``, or given for a model that is not a ``peft.PeftModel``,
            or ``"merged"`` for a sharded model that is not a ``transformers`` model.
        ImportError: ``adapters`` given without peft installed.
        NotImplementedError: ``adapters`` for a pipelined model (``af.pipeline``).
        CheckpointError: ``directory`` is a file or an accelfn checkpoint, or holds files of
            the layout's names that no export wrote (nothing is written then); rank 0 failed
            to write; some rank did
            not call ``save_model`` (for this ``directory``) within a tenth of the collective
            timeout (``distributed.arrive``): call it on every rank, not inside
            ``if backend.is_main_process:``.
        OSError: the file system refused.

    Example:
        >>> import tempfile, torch, accelfn as af, safetensors.torch
        >>> model = torch.nn.Linear(2, 1)
        >>> state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> path = af.save_model(state, tempfile.mkdtemp())
        >>> sorted(safetensors.torch.load_file(path / "model.safetensors"))
        ['bias', 'weight']
    """
    require_state("af.save_model(state, directory)", state)
    directory = to_path("save_model", "directory", directory)
    limit = parse_size(max_shard_size)
    backend = backend if backend is not None else ProcessContext.default()
    if backend.world_size > 1:
        try:
            distributed.arrive("af.save_model", detail=repr(str(directory)))
        except distributed.ArrivalError as e:
            raise CheckpointError(str(e)) from None
    main = backend.is_main_process
    distributed.sync_buffers(state.model, backend.collective_device)  # replicas' buffers: rank 0's
    if adapters is not None:
        return _save_adapters(state, directory, adapters, limit, backend)
    tensors = [(clean_name(k), v) for k, v in unwrap(state.model).state_dict().items()]
    own = dict(tensors)
    layout = _pipelined.stage_layout(unwrap(state.model))
    if layout is not None:  # a pipelined model: the whole model's files, planned alike on every rank
        tensors = _pipelined.whole_model(tensors, layout, backend)
    files = _plan(tensors, limit)
    names = [WEIGHTS] if len(files) == 1 else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                                              for i in range(len(files))]
    by_name = dict(tensors)
    failure: BaseException | None = None
    if main:
        try:
            _check_target(directory)
            directory.mkdir(parents=True, exist_ok=True)
        except BaseException as e:  # re-raised below, after telling the other ranks
            failure = e
    _outcome(backend, failure, f"save_model(): rank 0 cannot write to {directory}")
    for filename, keys in zip(names, files):
        if layout is not None:  # each stage sends rank 0 its tensors of this file
            shard = _pipelined.file_part(own, keys, layout)
        else:
            shard = {}
            for key in keys:  # every rank takes part in each gather, even after rank 0 failed
                t = by_name[key]
                full = t.full_tensor() if is_dtensor(t) else t
                if main and failure is None:
                    shard[key] = full.detach().to("cpu", copy=True).contiguous()
                del full
        if main and failure is None:
            try:
                _write_file(directory / filename, None, shard)
            except BaseException as e:
                failure = e
    if main and failure is None:
        try:
            _finish(directory, names, files, sum(_nbytes(t) for _, t in tensors))
        except BaseException as e:
            failure = e
    _outcome(backend, failure, f"save_model(): rank 0 failed to write {directory}; its error says why")
    return directory


def _gathered(tensors: list[tuple[str, torch.Tensor]], keep: bool) -> dict[str, torch.Tensor]:
    """``tensors`` as full CPU tensors (DTensors gathered one by one, in order: a collective,
    every rank calls it alike), kept where ``keep`` (rank 0), else dropped at once."""
    found = {}
    for key, t in tensors:
        full = t.full_tensor() if is_dtensor(t) else t
        if keep:
            found[key] = full.detach().to("cpu", copy=True).contiguous()
        del full
    return found


def _save_adapters(state: TrainState, directory: Path, adapters: str, limit: int, backend: ProcessContext) -> Path:
    """``save_model`` of a peft model's adapter (``adapters="peft"``) or of the model with it
    merged (``"merged"``); see ``_adapters``."""
    model = unwrap(state.model)
    if _pipelined.stage_layout(model) is not None:
        raise NotImplementedError(f"save_model(adapters={adapters!r}) does not export a pipelined model "
                                  "(af.pipeline); export it with adapters=None, or train the adapters unpipelined")
    name = _adapters.check(model, adapters)
    main = backend.is_main_process
    failure: BaseException | None = None
    if main:
        try:
            _check_target(directory)
            directory.mkdir(parents=True, exist_ok=True)
        except BaseException as e:  # re-raised below, after telling the other ranks
            failure = e
    _outcome(backend, failure, f"save_model(): rank 0 cannot write to {directory}")
    if adapters == "peft":
        tensors = _gathered(_adapters.adapter_tensors(model, name), keep=main)
    else:
        full = _gathered([(clean_name(k), v) for k, v in model.state_dict().items()], keep=main)
    if main:
        try:
            if adapters == "peft":
                _write_file(directory / _adapters.ADAPTER_WEIGHTS, None, tensors)
                _adapters.write_adapter_config(directory, model, name, lambda path, data: _write_file(path, data, None))
                _finish(directory, [_adapters.ADAPTER_WEIGHTS], [list(tensors)], 0)
            else:
                merged, config = _adapters.merged(model, full, name)
                del full
                _write_weights(directory, merged, limit)
                if config is not None and hasattr(config, "to_json_string"):
                    _write_file(directory / _adapters.CONFIG, config.to_json_string().encode(), None)
        except BaseException as e:
            failure = e
    _outcome(backend, failure, f"save_model(): rank 0 failed to write {directory}; its error says why")
    return directory


def _write_weights(directory: Path, tensors: list[tuple[str, torch.Tensor]], limit: int) -> None:
    """Writes CPU ``tensors`` in the layout of ``save_model`` (one process, no collective)."""
    files = _plan(tensors, limit)
    names = [WEIGHTS] if len(files) == 1 else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                                              for i in range(len(files))]
    by_name = dict(tensors)
    for filename, keys in zip(names, files):
        _write_file(directory / filename, None, {key: by_name[key].contiguous() for key in keys})
    _finish(directory, names, files, sum(_nbytes(t) for _, t in tensors))


def _finish(directory: Path, names: list[str], files: list[list[str]], total_bytes: int) -> None:
    """Writes the index (for more than one file), then removes an earlier export's other files."""
    if len(files) > 1:
        weight_map = {key: filename for filename, keys in zip(names, files) for key in keys}
        index = {"metadata": {"total_size": total_bytes, MARK: __version__}, "weight_map": weight_map}
        _write_file(directory / INDEX, orjson.dumps(index, option=orjson.OPT_INDENT_2), None)
    written = {*names, INDEX} if len(files) > 1 else set(names)
    for entry in os.scandir(directory):  # an earlier export's files (marked: save_model wrote them)
        if _is_layout(entry.name) and entry.name not in written and _marked(Path(entry.path)):
            os.remove(entry.path)
            if entry.name == _adapters.ADAPTER_WEIGHTS:  # its config too: from_pretrained would read it
                with contextlib.suppress(FileNotFoundError):
                    os.remove(directory / _adapters.ADAPTER_CONFIG)
    _atomic.fsync_dir(directory)


def _outcome(backend: ProcessContext, failure: BaseException | None, message: str) -> None:
    """Rank 0's outcome on every rank: its ``failure`` raised there, ``message`` elsewhere."""
    distributed.outcome_of_rank_0(failure, lambda: CheckpointError(message), device=backend.collective_device)


def _weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the file holding it, from ``directory``'s index or its ``model.safetensors``
    (``directory`` may also be that file itself).

    Raises:
        CheckpointError: neither file exists.
    """
    if directory.is_file():
        with safetensors.safe_open(str(directory), framework="pt") as f:
            return {k: directory for k in f.keys()}  # noqa: SIM118  # safe_open has no __iter__
    if (directory / INDEX).is_file():
        index = orjson.loads((directory / INDEX).read_bytes())
        return {k: directory / v for k, v in index["weight_map"].items()}
    if (directory / WEIGHTS).is_file():
        return _weight_files(directory / WEIGHTS)
    raise CheckpointError(f"load_model(): {directory} holds neither {WEIGHTS} nor {INDEX}; pass the folder "
                          "save_model (or save_pretrained) wrote, or the .safetensors file itself")


def _local_part(f: Any, key: str, target: torch.Tensor) -> torch.Tensor:
    """This rank's part of tensor ``key`` of the open file ``f``, shaped as ``target``'s local part:
    a slice read straight from the file for ``Shard``/``Replicate`` layouts, else (FSDP2's strided
    layout over a tensor-parallel split) the whole tensor read and cut (``distribute_tensor``)."""
    if not is_dtensor(target):
        return f.get_tensor(key)
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if all(type(p) in (Shard, Replicate) for p in target.placements):
        shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
        return f.get_slice(key)[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
    whole = f.get_tensor(key).to(target.to_local().device)  # a CUDA mesh cuts CUDA tensors
    return distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None).to_local()


def load_model(state: TrainState, directory: str | os.PathLike[str]) -> TrainState:
    """Loads weights in the Hugging Face layout into ``state``'s model, strictly, in place.

    ``directory`` is what ``save_model`` or ``save_pretrained`` wrote (``model.safetensors``,
    or ``model.safetensors.index.json`` and its files), or a ``.safetensors`` file. The model may
    be prepared already (sharded by ``shard_params``, split by ``tensor_parallel``, both, or
    built on the meta device and materialized by ``prepare``): each rank then reads only the
    slices of its own shards. Tied parameters are read once, under any of their names.
    Non-persistent buffers (in no ``state_dict``: a rotary embedding's ``inv_freq``) are read
    when a file holds them and otherwise keep the model's own values. No collective: each
    rank reads on its own. The optimizer state is not touched.

    Args:
        state: the state whose model to fill.
        directory: the folder (or file) to read.

    Returns:
        TrainState: ``state`` (its model's tensors hold the loaded values).

    Raises:
        TypeError: ``state`` is not a TrainState, ``directory`` not a path.
        CheckpointError: no weights at ``directory``; a parameter or persistent buffer of the
            model missing from the files, or a tensor in them that the model does not have
            (both listed), or one of another shape.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"load_model() takes a TrainState first, got {type(state).__name__}")
    directory = to_path("load_model", "directory", directory)
    where = _weight_files(directory)
    model = unwrap(state.model)
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(clean_name(name))
        tensors[id(t)] = t
    # a non-persistent buffer (a rotary embedding's inv_freq) is in no state_dict, so in no file
    # save_pretrained or save_model writes: read when a file has it (older exports), never asked for
    transient = {id(t) for module in model.modules() for n, t in module._buffers.items()
                 if t is not None and n in module._non_persistent_buffers_set}
    missing = [ns[0] for key, ns in names.items() if key not in transient and not any(n in where for n in ns)]
    known = {n for ns in names.values() for n in ns}
    unexpected = sorted(set(where) - known)
    if missing or unexpected:
        raise CheckpointError(f"load_model(): the weights at {directory} do not match the model: missing "
                              f"{missing or 'none'}, unexpected {unexpected or 'none'}")
    with torch.no_grad():
        for key, ns in names.items():
            if not any(n in where for n in ns):  # a non-persistent buffer no file holds: the model's own
                continue
            target, name = tensors[key], next(n for n in ns if n in where)
            with safetensors.safe_open(str(where[name]), framework="pt") as f:
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(target.shape):
                    raise CheckpointError(f"load_model(): {name} has shape {shape} in {where[name].name}, the "
                                          f"model's is {tuple(target.shape)}")
                part = _local_part(f, name, target)
            local = target.to_local() if is_dtensor(target) else target
            local.copy_(part)
    return state
