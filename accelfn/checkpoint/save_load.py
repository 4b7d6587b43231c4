"""``save`` and ``load``: one flow for sharded and unsharded checkpoints, collective, atomic.

A save captures the state's snapshot, gathers what differs per rank to rank 0, and has rank 0
write the directory atomically (under sharding every rank writes its own shards into it
first); rank 0's outcome is then told to every rank. A load is two phases: ``open_checkpoint``
resolves the directory, verifies its files and checks the checkpoint against the state it
will go into, changing nothing; ``Opened.put`` then puts it in place. Between the two, the
caller may choose where the resumed epoch continues (``run`` does, from the counters).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import torch

from accelfn import distributed
from accelfn.checkpoint import _atomic, _format, _frozen, _pipelined, _sharded
from accelfn.checkpoint._format import RankPart
from accelfn.checkpoint._manifest import Manifest
from accelfn.checkpoint._tensorfiles import FileEntry
from accelfn.checkpoint.snapshot import Snapshot, capture, is_sharded, put, unwrap, verify
from accelfn.distributed import ProcessContext, is_dtensor
from accelfn.errors import CheckpointError, check_directory, to_path
from accelfn.state import TrainState, require_state
from accelfn.transforms.invariant import Layout, redistribute

if TYPE_CHECKING:
    from accelfn.step import Step

_T = TypeVar("_T")

__all__ = ["Collected", "Opened", "collect", "find_checkpoint", "is_sharded", "load", "open_checkpoint", "save",
           "write", "writes_sharded"]


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
    sharded: every rank writes its own shards of the model, optimizer state and open-window
    gradients through ``torch.distributed.checkpoint``'s safetensors storage into
    ``path/dcp/``, and rank 0 the rest and the manifest; DTensors in ``extra`` states (an EMA
    of the sharded parameters) are written with them. A pipelined state (``af.pipeline``) is
    saved the same way: every rank writes its own stages' tensors (replicas of a stage
    once), under the whole model's names, and rank 0 the manifest of the whole model; no
    rank receives another's tensors. The directory's layout is described in
    ``accelfn.checkpoint``'s docstring and docs/06.

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
            rank) failed to write, some rank did not call ``save`` (rank 0 names it),
            another process is writing in ``path``'s parent directory (its write lock), or an
            ``extra`` state holds a DTensor while the model is not sharded.
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
    _check_state(state, "af.save")
    checked = to_path("save", "path", path)
    check_directory(checked, f"save(path={str(path)!r})")
    return write(state, checked, backend, what="af.save")


def writes_sharded(state: TrainState) -> bool:
    """True if ``state`` is saved sharded, every rank writing its own tensors through DCP: its
    model holds DTensor parameters, or it is pipelined (each rank holds its stages only)."""
    return is_sharded(state) or _pipelined.stage_layout(unwrap(state.model)) is not None


def _context(backend: ProcessContext | None) -> ProcessContext:
    return backend if backend is not None else ProcessContext.default()


def _check_state(state: Any, what: str) -> None:
    require_state(f"{what}(state, ...)", state)


def _sharded_in_extra(tree: Any, path: str) -> str | None:
    """Where in ``tree`` (an ``extra`` object's ``state_dict``) a DTensor is, or None."""
    if is_dtensor(tree):
        return path
    items = tree.items() if isinstance(tree, Mapping) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    for key, value in items:
        found = _sharded_in_extra(value, f"{path}[{key!r}]")
        if found is not None:
            return found
    return None


def _check_extra(state: TrainState) -> None:
    """Raises before any collective if an ``extra`` state of an unsharded state holds a
    DTensor: only the sharded path (DCP) writes DTensors, and gathering them here would be a
    collective the ranks' ``extra`` trees need not agree on.

    Raises:
        CheckpointError: naming where the DTensor is and what to keep instead.
    """
    for name, obj in state.extra.items():
        where = _sharded_in_extra(obj.state_dict(), f"extra[{name!r}].state_dict()")
        if where is not None:
            raise CheckpointError(
                f"{where} is a DTensor (a tensor sharded over ranks), but the model is not sharded: checkpoints "
                "carry DTensors in TrainState.extra only when the model's parameters are DTensors too "
                "(af.shard_params), through the sharded checkpoint's files. Keep full tensors instead "
                "(t.full_tensor()), or this rank's shard as a plain tensor (t.to_local().clone()): an extra state "
                "that differs between ranks is saved for every rank and comes back on each rank as its own"
            )


def _arrived(backend: ProcessContext, what: str, path: Path | None = None) -> None:
    """Raises CheckpointError unless every rank called ``what`` for ``path`` (``distributed.arrive``)."""
    if backend.world_size > 1:
        try:
            distributed.arrive(what, detail="" if path is None else repr(str(path)))
        except distributed.ArrivalError as e:
            raise CheckpointError(str(e)) from None


def _gather_parts(backend: ProcessContext, part: RankPart) -> list[RankPart]:
    """Every rank's part, in rank order (a collective: call it on every rank)."""
    if backend.world_size == 1:
        return [part]
    payload = _format.pack_part(part)
    lengths = backend.gather(torch.tensor([payload.numel()], dtype=torch.int64)).cpu().tolist()
    data = backend.gather(payload).cpu()
    parts, offset = [], 0
    for n in lengths:
        parts.append(_format.unpack_part(data[offset:offset + n]))
        offset += n
    return parts


@attrs.frozen(eq=False)
class Collected:
    """What rank 0 writes of an unsharded checkpoint: its snapshot, every rank's part, the
    program's transforms as plain data. ``write`` may run in another thread (no collective)."""

    snap: Snapshot
    parts: list[RankPart]
    transforms: Any
    frozen: frozenset[str] = frozenset()

    def write(self, path: Path, *, earlier: Path | None = None) -> None:
        """Writes the checkpoint ``path`` atomically, once it is checked by the rules a load
        applies (``_format.problems``): nothing is written if a load would refuse it. The
        model's ``frozen`` tensors go into files of their own, hard links to the checkpoint
        ``earlier``'s where it holds the same bytes (``_frozen``).

        Raises:
            CheckpointError, OSError: as ``save``.
        """
        encoded = _format.encode(self.snap, self.parts, self.transforms, frozen=self.frozen)
        _format.refuse(path, _format.problems(encoded))
        _atomic.write_directory(path, lambda d: _format.write_encoded(d, encoded, earlier=earlier))


def collect(state: TrainState, backend: ProcessContext, program: Step | None, *,
            to_host: Callable[[torch.Tensor], torch.Tensor] | None = None,
            what: str = "Checkpoints.save", path: Path | None = None) -> Collected | None:
    """The collective half of an unsharded save: this rank's snapshot, every rank's own part
    gathered to rank 0. Returns what rank 0 writes (None on the other ranks).

    Args:
        state: the state to save (not sharded: a sharded state is written by every rank).
        backend: the process context.
        program: the program whose transforms the manifest records, or None.
        to_host: copies each tensor to host memory (``checkpoints.HostBuffers``), so that
            the result no longer depends on ``state``; None leaves tensors aliasing the live
            ones, to be written at once.
        what: the API named when a rank does not call it (``distributed.arrive``).
        path: the checkpoint's path, which every rank must give alike.

    Raises:
        TypeError: ``state`` is not a TrainState.
        ValueError: the optimizer updates a tensor that is not a parameter of the model.
        CheckpointError: some rank did not call the save (it is a collective).
    """
    _check_state(state, what)
    assert not writes_sharded(state), "a sharded or pipelined state is saved by every rank (write)"
    _check_extra(state)
    _arrived(backend, what, path)
    distributed.sync_buffers(state.model, backend.collective_device)  # the one model: rank 0's buffers
    snap = capture(state, copy=False) if to_host is None else capture(state, copy=True, to_host=to_host)
    parts = _gather_parts(backend, _format.rank_part(snap))
    if not backend.is_main_process:
        return None
    return Collected(snap, parts, _format.transforms_record(program), _frozen.names(unwrap(state.model)))


def write(state: TrainState, path: Path, backend: ProcessContext | None, *, program: Step | None = None,
          what: str = "Checkpoints.save", earlier: Path | None = None) -> Path:
    """``save`` of a checked ``path``, sharded or not (a collective); ``program``'s transforms
    are recorded in the manifest; ``what`` is the API named when a rank does not call it;
    the frozen model tensors are hard links to the checkpoint ``earlier``'s where it holds
    the same bytes (given on rank 0; ``_frozen``).

    Raises:
        As ``save``.
    """
    _check_state(state, what)
    backend = _context(backend)
    if not writes_sharded(state):
        collected = collect(state, backend, program, what=what, path=path)
        failure: BaseException | None = None
        if collected is not None:
            try:
                collected.write(path, earlier=earlier)
            except BaseException as e:  # re-raised below, after telling the other ranks
                failure = e
    else:
        if not is_sharded(state):  # pipelined: DTensors in extra states are refused as unsharded
            _check_extra(state)
        _arrived(backend, what, path)
        distributed.sync_buffers(state.model, backend.collective_device)
        failure = _write_sharded(state, path, backend, _format.transforms_record(program), earlier)
    distributed.outcome_of_rank_0(
        failure, lambda: CheckpointError(f"rank 0 failed to write the checkpoint {path}; its error says why"),
        device=backend.collective_device)
    return path


def _write_sharded(state: TrainState, path: Path, backend: ProcessContext, transforms: Any,
                   earlier: Path | None) -> BaseException | None:
    """Every rank writes its shards into rank 0's temporary directory (the frozen model
    tensors into ``dcp-frozen/``, linked to ``earlier``'s where they are the same); rank 0
    then the rest and the manifest, and renames the directory into place. Returns this
    rank's failure."""
    model = unwrap(state.model)
    snap = capture(state, copy=False)
    layout = _pipelined.stage_layout(model)
    frozen: dict[str, torch.Tensor] = {}
    reuse = None
    if layout is None:
        shell, flat, tables = _sharded.split(snap, model)
        # FSDP2's unsharded window gradients are this rank's own: they go with its RNG states
        shell = attrs.evolve(shell, grads=_sharded.hidden_gradients(model))
        flat, frozen, tables = _frozen.split_sharded(flat, tables, _frozen.names(model))
        if frozen:  # the same names on every rank: all of them exchange, or none
            tables, reuse = _frozen.plan(backend, tables, frozen, _previous(earlier) if backend.rank == 0 else None)
    else:  # a pipelined model: each rank writes its stages' tensors, rank 0 the joined tables
        shell, flat, tables = _sharded.split(attrs.evolve(_pipelined.stage_shell(snap, layout), grads={}), model)
        shell, tables = _pipelined.merged(shell, tables, layout, backend)
        shell = attrs.evolve(shell, grads=snap.grads)  # a window's gradients: this rank's own, unreduced
    parts = _gather_parts(backend, _format.rank_part(shell))
    if not backend.is_main_process:
        directory = _sharded.announce(backend, path, None)
        if directory is None:
            return CheckpointError(f"{path}: the checkpoint was not written: rank 0 could not start")
        try:
            _sharded.write_shards(backend, path, directory, flat)
            if frozen:
                _write_frozen(backend, path, directory, frozen, reuse)
        except CheckpointError as e:
            return e
        return None
    announced = False

    def fill(directory: Path) -> None:
        nonlocal announced
        announced = True
        _sharded.announce(backend, path, directory)
        files = _sharded.write_shards(backend, path, directory, flat)
        if frozen:
            files |= _write_frozen(backend, path, directory, frozen, reuse)
        _format.write_encoded(directory, encoded, files)

    try:
        encoded = _format.encode(shell, parts, transforms, sharded=tables)
        _format.refuse(path, _format.problems(encoded))  # before any rank writes a shard
        _atomic.write_directory(path, fill)
    except BaseException as e:  # told to the other ranks by the caller
        if not announced:
            _sharded.announce(backend, path, None)
        return e
    return None


def _previous(earlier: Path | None) -> tuple[Path, Manifest] | None:
    """The checkpoint ``earlier`` and its manifest, or None where there is none or its manifest
    does not read (its frozen files are then not reused)."""
    if earlier is None:
        return None
    try:
        return earlier, _format.read(earlier)
    except CheckpointError:
        return None


def _write_frozen(backend: ProcessContext, path: Path, directory: Path, frozen: dict[str, torch.Tensor],
                  reuse: _frozen.Reuse | None) -> dict[str, FileEntry]:
    """The frozen tensors of a sharded state into ``directory/dcp-frozen`` (a collective):
    linked to ``reuse``'s files, or written by DCP (``_frozen.write_sharded``)."""
    return _frozen.write_sharded(backend, directory, reuse, lambda: _sharded.write_shards(
        backend, path, directory, frozen, folder_name=_sharded.FROZEN_DIR, group=_sharded.FROZEN_GROUP))


def find_checkpoint(path: Path) -> Path:
    """The complete checkpoint directory ``path`` stands for (``path`` itself, or its
    finished replacement after a crash mid-replace); changes nothing.

    Raises:
        CheckpointError: no complete checkpoint at ``path`` (the message says whether
            ``path`` is a directory without a manifest).
    """
    directory = _atomic.resolve(path)
    if directory is not None:
        return directory
    if path.is_dir():
        raise CheckpointError(f"{path} is not a complete accelfn checkpoint (it has no manifest.json): "
                              "a save that was interrupted, or not a checkpoint")
    raise CheckpointError(f"no checkpoint at {path}")


@attrs.frozen(eq=False)
class Opened:
    """A checkpoint verified and checked against the state it goes into, not yet put there.

    Attributes:
        path: the directory it was read from.
        manifest: its manifest.
        snap: this rank's snapshot (of a sharded checkpoint: all but the tensors in its DCP
            files, which ``put`` reads).
        into: the state it fits.
        backend: the process context it was opened in.
    """

    path: Path
    manifest: Manifest
    snap: Snapshot
    into: TrainState
    backend: ProcessContext

    @property
    def counters(self) -> Mapping[str, int]:
        """The saved counters: ``step``, ``micro_step``, ``epoch``, ``epoch_micro_step``."""
        return self.snap.counters

    @property
    def world_size(self) -> int:
        """The number of processes that wrote the checkpoint."""
        return self.manifest.world_size

    @property
    def data_world_size(self) -> int:
        """The number of data shards the run that wrote the checkpoint read: its world size, or,
        under ``tensor_parallel(size=t)``, ``context_parallel(size=c)`` or ``pipeline(size=p)`` (as its
        manifest records the program), the world size over the product of their sizes (the ranks of
        one model copy read one shard together)."""
        records = self.manifest.transforms if isinstance(self.manifest.transforms, list) else []
        sizes = [r.get("size") for r in records
                 if isinstance(r, dict) and r.get("type") in ("TensorParallel", "ContextParallel", "Pipeline")]
        model = math.prod(size for size in sizes if isinstance(size, int) and size > 0)
        return max(self.manifest.world_size // model, 1)

    def other_program(self, program: Step | None) -> str | None:
        """What differs when the checkpoint was written by a program with other transforms
        than ``program`` (then a resumed run differs from an uninterrupted one), else None.
        Under ``invariant()`` on both sides, ``accumulate``'s count is not compared: it is
        the world size's share of the global batch, which ``invariant()`` checks itself."""
        now = _format.transforms_record(program)
        saved = _format.saved_transforms(self.manifest.transforms, program)
        if saved is None or now is None or _format.same_program(saved, now):
            return None
        return f"{self.path} was written by a program with the transforms {saved}; this program has {now}"

    def put(self, *, epoch_micro_step: int | None = None) -> TrainState:
        """Puts the checkpoint into the state it was opened for (a collective for a sharded
        checkpoint) and returns the restored state.

        Args:
            epoch_micro_step: where in the saved epoch to continue (micro-batches), when not
                at the saved position (``run`` resuming on another number of processes).

        Raises:
            CheckpointError: DCP failed reading a sharded checkpoint's verified files.
        """
        snap = self.snap
        if epoch_micro_step is not None:
            snap = attrs.evolve(snap, counters={**snap.counters, "epoch_micro_step": epoch_micro_step})
        tables = self.manifest.sharded
        if tables is not None:
            return _sharded.load_into(self.into, self.path, snap, tables, self.backend)
        if is_sharded(self.into):
            return _sharded.put_unsharded(self.into, snap)
        return put(self.into, snap, copy=True)  # its tensors are mapped to the files


def open_checkpoint(path: Path, *, into: TrainState, backend: ProcessContext | None = None) -> Opened:
    """The checkpoint at ``path``, verified and checked against ``into``; nothing changes yet.

    The same for every kind of checkpoint: the manifest is read and checked against its
    sha256; a checkpoint saved mid-accumulation-window refuses another world size (its
    window's gradients are per process); every tensor file's size and checksum is verified
    (the ranks share a sharded checkpoint's DCP files); the snapshot of this rank is decoded
    and checked against ``into``. A collective: when a check fails on any rank, every rank
    raises, so that none goes on into the collectives of ``put``.

    Raises:
        TypeError: ``into`` is not a TrainState.
        CheckpointError: as ``load``.
    """
    require_state("af.load(path, into=...)", into)
    backend = _context(backend)
    directory, manifest = _agreed(backend, lambda: _manifest(path, backend))
    files = manifest.files
    if manifest.sharded is not None:  # a collective that raises on every rank alike
        _sharded.check_files(backend, directory, files, manifest.sharded)
        files = _sharded.manifest_files(files)
        if _pipelined.stage_layout(unwrap(into.model)) is not None:  # DCP reads this rank's stages only
            manifest = attrs.evolve(manifest, sharded=_pipelined.kept_tables(manifest.sharded, into))
    snap = _agreed(backend, lambda: _snapshot(directory, manifest, files, into, backend))
    return Opened(directory, manifest, snap, into, backend)


def _agreed(backend: ProcessContext, check: Callable[[], _T]) -> _T:
    """``check()``, whose CheckpointError on any rank is raised on every rank."""
    result, failure = None, None
    try:
        result = check()
    except CheckpointError as e:
        failure = e
    if backend.world_size > 1:
        failed = distributed.failures(None if failure is None else str(failure), device=backend.collective_device)
        if failed and failure is None:
            raise CheckpointError(failed[0])
    if failure is not None:
        raise failure
    return result  # type: ignore[return-value]  # set when check() returned


def _manifest(path: Path, backend: ProcessContext) -> tuple[Path, Manifest]:
    directory = find_checkpoint(path)
    manifest = _format.read(directory)
    if (backend.world_size != manifest.world_size and _format.opens_window(manifest)
            and not _format.only_tree_windows(manifest)):
        raise CheckpointError(
            f"{directory} was saved by {_processes(manifest.world_size)} in the middle of an accumulation window, "
            f"whose gradients are per process; resume it with {_processes(manifest.world_size)} "
            f"(this world has {backend.world_size})")
    return directory, manifest


def _processes(n: int) -> str:
    return f"{n} process{'es' if n != 1 else ''}"


def _snapshot(directory: Path, manifest: Manifest, files: Mapping[str, FileEntry], into: TrainState,
              backend: ProcessContext) -> Snapshot:
    snap = _format.read_snapshot(directory, manifest, rank=backend.rank, files=files)
    if _pipelined.stage_layout(unwrap(into.model)) is not None:  # a pipelined state: its stages' part
        snap = _pipelined.kept(snap, into)
    checked = snap if manifest.sharded is None else _sharded.placeholders(snap, manifest.sharded)
    try:
        verify(into, checked, source=_format.MANIFEST, names=_format.field_names(_format.section(manifest, backend.rank)))
    except CheckpointError as e:
        raise CheckpointError(f"{directory}: {e}") from None
    layout = snap.transforms_state.get("invariant")
    if isinstance(layout, Layout) and manifest.world_size != backend.world_size:
        snap = _regroup(directory, manifest, files, snap, layout, backend)
    return snap


def _regroup(directory: Path, manifest: Manifest, files: Mapping[str, FileEntry], snap: Snapshot, layout: Layout,
             backend: ProcessContext) -> Snapshot:
    """An ``invariant()`` snapshot of ``manifest.world_size`` processes for this rank of
    another world size: its counters in this world's micro-batches (the same global
    micro-batch), and its share of the open window's subtrees, read from every saved rank."""
    if layout.micro_batches_per_update % backend.world_size:
        raise CheckpointError(
            f"{directory} was saved under invariant() with {layout.micro_batches_per_update} micro-batches per update "
            f"(processes x accumulate), which does not divide over {backend.world_size} processes")
    counters = snap.counters
    position, total = counters["epoch_micro_step"], counters["micro_step"]
    windows = _format.rank_entries(directory, manifest, "tree_window", files)
    try:
        window, start = redistribute(windows, layout=layout, saved_position=position,
                                     saved_world_size=manifest.world_size, rank=backend.rank,
                                     world_size=backend.world_size)
    except ValueError as e:
        raise CheckpointError(f"{directory}: {e}") from None
    earlier = (total - position) * manifest.world_size // backend.world_size  # whole windows only
    states = {k: v for k, v in snap.transforms_state.items() if k != "tree_window"}
    if window is not None:
        states["tree_window"] = window
    return attrs.evolve(snap, counters={**counters, "epoch_micro_step": start, "micro_step": earlier + start},
                        transforms_state=states)


def load(path: str | os.PathLike[str], *, into: TrainState, backend: ProcessContext | None = None) -> TrainState:
    """Restores the checkpoint at ``path`` into ``into`` (in place) and returns the state.

    Nothing is unpickled: tensors come from ``.safetensors`` files, everything else from
    JSON. Every file's checksum is verified (XXH3-128; sha256 for checkpoints of format 3
    and earlier; the manifest's against ``manifest.sha256``), the manifest's values are
    checked (counters are ints >= 0, RNG states fit their generators), and the checkpoint
    is checked against ``into`` (every missing, unexpected or mismatched key, shape and
    dtype, and every value of another kind than the one it replaces, such as a str learning
    rate, is reported) before anything in ``into`` changes. Tensors are read to the CPU,
    then copied to the state's device. Each rank restores its own RNG and transform states
    (rank 0's when the checkpoint was written by fewer processes).

    A sharded checkpoint (saved from DTensor parameters) loads at any world size into a
    sharded or an unsharded state, each rank reading only the parts of the files its
    tensors need; an unsharded checkpoint loads into a sharded state too (each rank cuts
    its shards out of the full tensors). DTensors a sharded checkpoint holds of ``extra``
    states are read into tensors laid out like ``into``'s (its ``extra`` object's own
    DTensor there, else the model parameters' mesh and placements, or full tensors when
    ``into`` is not sharded) before the object's ``load_state_dict`` gets them.

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
            mid-accumulation-window loaded by another number of processes; some rank did
            not call ``load`` (of this ``path``) within a tenth of the collective timeout: a
            collective, call it on every rank (``distributed.arrive``).
    """
    checked = to_path("load", "path", path)
    context = _context(backend)
    _arrived(context, "af.load", checked)
    return open_checkpoint(checked, into=into, backend=context).put()
