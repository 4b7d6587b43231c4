"""``save`` and ``load``: a Snapshot on disk, written and read collectively.

A checkpoint is a directory: ``manifest.json`` (orjson via cattrs: format and library
versions, counters, per-rank RNG and transform states, optimizer/scheduler skeletons, the
program's transforms, sha256 of every tensor file), ``manifest.sha256`` (the manifest's own)
and ``.safetensors`` tensor files. It is written atomically (``accelfn.checkpoint._atomic``), loaded
without unpickling anything, verified against its checksums, and checked value by value
against the state it is loaded into before anything in that state changes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import orjson
import torch

from accelfn import collectives
from accelfn.checkpoint import _atomic, _manifest, _serialize, _sharded
from accelfn.checkpoint import restoring as _restore
from accelfn.checkpoint import snapshots as _snapshot
from accelfn.checkpoint._context import ProcessContext, default_context
from accelfn.errors import CheckpointError, check_directory, to_path
from accelfn.state import TrainState

if TYPE_CHECKING:
    from accelfn.step import Step

__all__ = [
    "Collected", "ResumePosition", "collect", "is_checkpoint", "is_sharded", "load", "load_with_manifest", "not_found",
    "read_fitting", "save", "save_checkpoint", "to_path", "transforms_record", "write_collected",
]

#: ``run``'s say in where a resumed epoch continues: called with the checkpoint's epoch,
#: its ``epoch_micro_step`` and the world size that wrote it, once the checkpoint is
#: verified and before it is loaded; returns the micro-batch to continue at, or raises
ResumePosition = Callable[[int, int, int], int]


def transforms_record(program: Step | None) -> Any:
    if program is None:
        return None
    records = [{"type": type(t).__name__, **_manifest.unstructure(t)} for t in program.transforms]
    return orjson.loads(_manifest.dumps(records))  # as it reads back from a manifest


def save(state: TrainState, path: str | os.PathLike[str], *, backend: ProcessContext | None = None) -> Path:
    """Writes ``state`` as a checkpoint directory at ``path``, atomically.

    A collective in a multi-process world: call it on every rank, not inside ``if
    backend.is_main_process:``. Every rank's RNG and transform states (and,
    mid-accumulation-window, its gradients) are gathered to rank 0, which writes; the
    others wait for it. The ranks first check that all of them arrived, waiting a tenth of
    the collective timeout (60 s by default, ``accelfn launch --timeout-s``): a save called
    on rank 0 alone then fails with an error saying so, instead of hanging. An existing
    checkpoint at ``path`` is replaced only once the new one is complete, so a crash at any
    instant leaves the old or the new.

    A state whose model holds DTensor parameters (FSDP2, ``af.shard_params``) is saved
    sharded instead: every rank writes its own shards of the model, optimizer state and
    open-window gradients through ``torch.distributed.checkpoint``'s safetensors storage
    into ``path/dcp/``, and rank 0 the rest and the manifest (``accelfn.checkpoint._sharded``).

    Args:
        state: the state to save (nothing in it changes).
        path: the checkpoint directory to write.
        backend: the process context (a backend); by default the default process group
            of ``torch.distributed``, or a world of one process.

    Returns:
        Path: ``path``.

    Raises:
        TypeError: ``state`` is not a TrainState, or ``path`` not a path.
        CheckpointError: ``path`` exists and is neither a checkpoint nor an empty directory
            (nothing is ever deleted that accelfn did not write), rank 0 (or, sharded, any
            rank) failed to write, some rank did not call ``save`` (rank 0 names it), or a
            sharded state is saved while FSDP2 holds a window's gradients unsharded (before
            the reduce-scatter of its last micro-batch).
        ValueError: the optimizer updates a tensor that is not a parameter of the model;
            ``path`` is a file or lies under one (checked before anything is gathered).
        PermissionError: ``path`` cannot be created by this process.
        OSError: the file system refused (full disk, permissions); ``path`` is untouched.

    Example:
        >>> import tempfile, torch, accelfn as af
        >>> model = torch.nn.Linear(2, 1)
        >>> state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> path = af.save(state, tempfile.mkdtemp() + "/ckpt")
        >>> af.load(path, into=state).step
        0
    """
    checked = to_path("save", "path", path)
    check_directory(checked, f"save(path={str(path)!r})")
    return save_checkpoint(state, checked, backend, transforms=None, what="af.save")


def is_sharded(state: TrainState) -> bool:
    """True if ``state``'s model holds DTensor parameters (FSDP2, ``af.shard_params``): its
    checkpoints are written by every rank through ``torch.distributed.checkpoint``."""
    return _sharded.is_sharded(state)


def _arrived(backend: ProcessContext, what: str, path: Path | None = None) -> None:
    """Raises CheckpointError unless every rank called ``what`` for ``path`` (``collectives.arrive``)."""
    if backend.world_size > 1:
        try:
            collectives.arrive(what, detail="" if path is None else repr(str(path)))
        except collectives.ArrivalError as e:
            raise CheckpointError(str(e)) from None


@attrs.frozen
class Collected:
    """What rank 0 writes of a checkpoint: its snapshot, every rank's part, the program's
    transforms as plain data."""

    snap: _snapshot.Snapshot
    parts: list[_serialize.RankPart]
    transforms: Any


def collect(state: TrainState, backend: ProcessContext, transforms: Any, *,
            to_host: Callable[[torch.Tensor], torch.Tensor] | None = None,
            what: str = "Checkpoints.save", path: Path | None = None) -> Collected | None:
    """The training thread's half of a save (a collective): this rank's snapshot, and every
    rank's own part gathered to rank 0. Returns what rank 0 writes (None on other ranks).

    Args:
        state: the state to save.
        backend: the process context.
        transforms: the program's transforms as plain data (``transforms_record``), or None.
        to_host: copies each tensor to host memory (``background.HostBuffers``), so that
            the result no longer depends on ``state``; None leaves tensors aliasing the live
            ones, to be written at once.
        what: the API named when a rank does not call it (``collectives.arrive``).
        path: the checkpoint's path, which every rank must give alike.

    Raises:
        TypeError: ``state`` is not a TrainState.
        ValueError: the optimizer updates a tensor that is not a parameter of the model.
        CheckpointError: some rank did not call the save (it is a collective).
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"save() takes a TrainState first, got {type(state).__name__}")
    if is_sharded(state):
        raise CheckpointError("a sharded state (FSDP2 parameters) is saved by every rank through "
                              "torch.distributed.checkpoint, not collected to rank 0: use save_checkpoint")
    _arrived(backend, what, path)
    if to_host is None:
        snap = _snapshot.capture(state, copy=False)
    else:
        snap = _snapshot.capture(state, copy=True, to_host=to_host)
    part = _serialize.rank_part(snap)
    parts = [part] if backend.world_size == 1 else _serialize.gather_parts(backend, part)
    return Collected(snap, parts, transforms) if backend.is_main_process else None


def write_collected(path: Path, collected: Collected) -> None:
    """Rank 0's half of a save: writes ``collected`` as the checkpoint ``path``, atomically.

    Raises:
        CheckpointError, OSError: as ``save``.
    """
    _atomic.write_directory(path, lambda d: _serialize.write(d, collected.snap, collected.parts, collected.transforms))


def save_checkpoint(state: TrainState, path: Path, backend: ProcessContext | None, transforms: Any,
                    what: str = "Checkpoints.save") -> Path:
    """``save`` without checking ``path``; ``what`` is the API named when a rank does not call it."""
    backend = default_context(backend)
    if is_sharded(state):
        _arrived(backend, what, path)
        return _sharded.save(state, path, backend, transforms)
    collected = collect(state, backend, transforms, what=what, path=path)
    world_size = backend.world_size
    failure: BaseException | None = None
    if collected is not None:
        try:
            write_collected(path, collected)
        except BaseException as e:  # re-raised below, after telling the other ranks
            failure = e
    if world_size > 1:
        written = backend.broadcast(torch.tensor([int(failure is None)], dtype=torch.int64))
        # A gloo worker thread may drop its reference to ``written`` just after the call
        # returned; were the script to exit at that instant, freeing the tensor would need
        # the GIL during interpreter shutdown and abort the process (std::terminate). A
        # barrier (no Python tensor in it) while ``written`` is held lets that happen first.
        backend.barrier()
        if failure is None and not int(written.item()):
            raise CheckpointError(f"rank 0 failed to write the checkpoint {path}; its error says why")
    if failure is not None:
        raise failure
    return path


def is_checkpoint(path: Path) -> bool:
    """True if ``path`` holds a complete checkpoint (or one whose replacement was interrupted
    after it was complete)."""
    return _atomic.resolve(path) is not None


def not_found(path: Path) -> str:
    if path.is_dir():
        return (f"{path} is not a complete accelfn checkpoint (it has no manifest.json): "
                "a save that was interrupted, or not a checkpoint")
    return f"no checkpoint at {path}"


def load(path: str | os.PathLike[str], *, into: TrainState, backend: ProcessContext | None = None) -> TrainState:
    """Restores the checkpoint at ``path`` into ``into`` (in place) and returns the state.

    Nothing is unpickled: tensors come from ``.safetensors`` files, everything else from
    JSON. Every file's sha256 is verified (the manifest's against ``manifest.sha256``), the
    manifest's values are checked (counters are ints >= 0, RNG states fit their generators),
    and the checkpoint is checked against ``into`` (every missing, unexpected or mismatched
    key, shape and dtype, and every value of another kind than the one it replaces, such as
    a str learning rate, is reported) before anything in ``into`` changes. Tensors are read
    to the CPU, then copied to the state's device. Each rank restores its own RNG and
    transform states (rank 0's when the checkpoint was written by fewer processes).

    A sharded checkpoint (saved from DTensor parameters) loads at any world size into a
    sharded or an unsharded state, each rank reading only the parts of the files its
    tensors need; an unsharded checkpoint loads into a sharded state too (each rank cuts
    its shards out of the full tensors).

    Args:
        path: a checkpoint directory written by ``af.save`` or ``af.Checkpoints``.
        into: a state built like the saved one (same model architecture, optimizer type
            and parameter groups, scheduler type, ``extra`` names).
        backend: the process context (as for ``save``).

    Returns:
        TrainState: ``into`` with the checkpoint's tensors, counters and transform states.

    Raises:
        TypeError: ``into`` is not a TrainState, or ``path`` not a path.
        CheckpointError: no complete checkpoint at ``path``; a missing, truncated or
            corrupted file (named); an invalid value in the manifest (the field named); a
            newer format; a mismatch with ``into``; or a checkpoint saved
            mid-accumulation-window loaded by another number of processes.
    """
    state, _ = load_with_manifest(to_path("load", "path", path), into, backend)
    return state


def load_with_manifest(path: Path, into: TrainState, backend: ProcessContext | None,
                       position: ResumePosition | None = None) -> tuple[TrainState, _manifest.Manifest]:
    """``load``, also returning the checkpoint's manifest; ``position`` (``run``'s) may move
    the resumed epoch's start once the checkpoint is verified, before anything changes."""
    if not isinstance(into, TrainState):
        raise TypeError(f"load(into=...) takes a TrainState, got {type(into).__name__}")
    backend = default_context(backend)
    directory, manifest = _open(path)
    if manifest.sharded is not None:
        return _sharded.load(directory, manifest, into, backend, position), manifest
    snap = _fitting(directory, manifest, into, backend)
    if position is not None:
        counters = snap.counters
        start = position(counters["epoch"], counters["epoch_micro_step"], manifest.world_size)
        snap = attrs.evolve(snap, counters={**counters, "epoch_micro_step": start})
    if is_sharded(into):
        return _sharded.put_unsharded(into, snap), manifest
    return _restore.put(into, snap, copy=True), manifest  # its tensors are mapped to the files


def read_fitting(path: Path, into: TrainState,
                 backend: ProcessContext | None) -> tuple[_snapshot.Snapshot | None, _manifest.Manifest]:
    """The checkpoint at ``path`` as this rank's snapshot, verified and checked against
    ``into``, which does not change (``load`` without putting anything in place). Of a
    sharded checkpoint only the manifest is read and checked (its DCP files are checked as
    they load): the snapshot is then None.

    Raises:
        CheckpointError: as ``load``.
    """
    backend = default_context(backend)
    directory, manifest = _open(path)
    if manifest.sharded is not None:
        return None, manifest
    return _fitting(directory, manifest, into, backend), manifest


def _open(path: Path) -> tuple[Path, _manifest.Manifest]:
    directory = _atomic.resolve(path)
    if directory is None:
        raise CheckpointError(not_found(path))
    return directory, _manifest.read(directory)


def _fitting(directory: Path, manifest: _manifest.Manifest, into: TrainState,
             backend: ProcessContext) -> _snapshot.Snapshot:
    snap = _serialize.read(directory, manifest, rank=backend.rank, world_size=backend.world_size)
    try:
        names = _serialize.field_names(_serialize.section(manifest, backend.rank))
        _restore.verify(into, snap, source=_manifest.MANIFEST, names=names)
    except CheckpointError as e:
        raise CheckpointError(f"{directory}: {e}") from None
    return snap
