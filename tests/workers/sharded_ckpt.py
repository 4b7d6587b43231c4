"""Worker for tests/checkpoint/test_sharded.py: trains, saves, loads and exports sharded states.

Usage: accelfn launch --nproc-per-node N sharded_ckpt.py MODE --out FILE [options]

``train``: runs ``helpers.sharding.program`` for 2 epochs (``--max-steps`` fewer) with
``--checkpoints DIR --every-steps K --keep N`` (``--asynchronous``: background saves) and ``--resume``; ``--sigterm RANK:CALL``
makes rank RANK send itself SIGTERM in its CALL-th loss call, once (a marker file next to
``--out`` remembers it across restarts). ``load``: loads ``--load
CKPT`` with ``pickle.load``/``pickle.loads``/``torch.load`` patched to raise, then optionally
saves it again to ``--save``; a CheckpointError is written to ``--out`` as ``error<rank>.txt``
instead. ``export``: trains 2 updates of a tied model, then ``af.save_model`` to ``--export``.
``fail``: loads ``--load`` and saves it back over itself while rank 1's safetensors
writer raises OSError("No space left on device"); each rank writes its CheckpointError to
``error<rank>.txt`` next to ``--out``.
``snapshot``: trains 2 updates, takes ``af.snapshot``, trains 2 more, ``af.restore``s it and
trains the last 2 again; rank 0 writes ``at_snapshot/...``, ``restored/...``, ``first/...``
(the full state after the first 4 updates) and ``again/...`` (after the restored run's 4).
``window``: a hand-written FSDP2 accumulation window of 2 micro-batches, the first without
reduce-scatter (``set_requires_gradient_sync(False)``), then an update; run whole, and
interrupted after the first micro-batch by ``af.save`` to ``--save`` and ``af.load`` into a
freshly built state; rank 0 writes both full states, ``whole/...`` and ``resumed/...``.
Rank 0 writes the full model and optimizer state it ends with to ``--out`` (safetensors).
"""

from __future__ import annotations

import argparse
import os
import pickle
import signal
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

import accelfn as af
from tests.helpers.sharding import build, full_state, loader, loss_fn, program


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("something was unpickled while loading a checkpoint")


def _preempted(when: str, rank: int, marker: Path) -> Any:
    """``loss_fn`` that sends SIGTERM to this process in rank ``R``'s ``C``-th call (``when``
    is ``"R:C"``), unless ``marker`` exists (it is created then)."""
    target_rank, target_call = map(int, when.split(":"))
    calls = [0]

    def preempted_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        calls[0] += 1
        if (rank, calls[0]) == (target_rank, target_call) and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGTERM)
        return loss_fn(model, batch)

    return preempted_loss


def _disk_full(*args: Any, **kwargs: Any) -> bytes:
    raise OSError(28, "No space left on device")


def _micro_batch(state: af.TrainState, batch: Any, *, sync: bool) -> None:
    state.model.set_requires_gradient_sync(sync)
    loss_fn(state.model, batch).backward()


def _update(state: af.TrainState) -> None:
    state.optimizer.step()
    state.optimizer.zero_grad()


def _window(path: Path, backend: Any) -> dict[str, torch.Tensor]:
    """Full states after a 2-micro-batch window run whole and run with a save/load after
    its first micro-batch (each rank reads its own batches)."""
    batches = list(loader())
    first, second = batches[backend.rank], batches[2 + backend.rank]
    whole = build(sharded=True)
    _micro_batch(whole, first, sync=False)
    _micro_batch(whole, second, sync=True)
    _update(whole)
    interrupted = build(sharded=True)
    _micro_batch(interrupted, first, sync=False)
    af.save(interrupted, path, backend=backend)
    resumed = af.load(path, into=build(sharded=True), backend=backend)
    _micro_batch(resumed, second, sync=True)
    _update(resumed)
    return ({f"whole/{k}": v for k, v in full_state(whole).items()}
            | {f"resumed/{k}": v for k, v in full_state(resumed).items()})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "load", "export", "window", "fail", "snapshot"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--unsharded", action="store_true")
    parser.add_argument("--checkpoints", type=Path)
    parser.add_argument("--every-steps", type=int)
    parser.add_argument("--keep", type=int)
    parser.add_argument("--asynchronous", action="store_true")
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--resume")
    parser.add_argument("--load", type=Path)
    parser.add_argument("--save", type=Path)
    parser.add_argument("--export", type=Path)
    parser.add_argument("--sigterm")
    args = parser.parse_args()
    backend = af.backends.auto()
    state = build(sharded=not args.unsharded, tied=args.mode == "export")
    if args.mode == "train":
        checkpoints = (af.Checkpoints(args.checkpoints, every_steps=args.every_steps, keep=args.keep,
                                      asynchronous=args.asynchronous) if args.checkpoints else None)
        step = program(sharded=not args.unsharded)
        if args.sigterm:
            step = af.Step(_preempted(args.sigterm, backend.rank, args.out.parent / "sigterm-sent"), step.transforms)
        state = af.run(step, state, loader(), backend=backend, epochs=2, max_steps=args.max_steps,
                       checkpoints=checkpoints, resume=args.resume, progress=False)
    elif args.mode == "load":
        pickle.load = pickle.loads = torch.load = _refuse  # type: ignore[assignment]
        try:
            state = af.load(args.load, into=state, backend=backend)
        except af.CheckpointError as e:
            (args.out.parent / f"error{backend.rank}.txt").write_text(str(e))
            return
        if args.save is not None:
            af.save(state, args.save, backend=backend)
    elif args.mode == "fail":
        state = af.load(args.load, into=state, backend=backend)
        if backend.rank == 1:
            safetensors.torch.save = _disk_full  # what DCP's safetensors writer calls
        try:
            af.save(state, args.load, backend=backend)
        except af.CheckpointError as e:
            (args.out.parent / f"error{backend.rank}.txt").write_text(str(e))
        return
    elif args.mode == "export":
        state = af.run(program(sharded=not args.unsharded), state, loader(), backend=backend, epochs=1, max_steps=2,
                       progress=False)
        af.save_model(state, args.export, max_shard_size=300, backend=backend)
    elif args.mode == "snapshot":
        step = program(sharded=True)
        state = af.run(step, state, loader(), backend=backend, epochs=1, max_steps=2, progress=False)
        snap = af.snapshot(state)
        tensors = {f"at_snapshot/{k}": v for k, v in full_state(state).items()}
        state = af.run(step, state, loader(), backend=backend, epochs=1, max_steps=4, progress=False)
        tensors |= {f"first/{k}": v for k, v in full_state(state).items()}
        state = af.restore(state, snap)
        tensors |= {f"restored/{k}": v for k, v in full_state(state).items()}
        state = af.run(step, state, loader(), backend=backend, epochs=1, max_steps=4, progress=False)
        tensors |= {f"again/{k}": v for k, v in full_state(state).items()}
        if backend.is_main_process:
            safetensors.torch.save_file(tensors, args.out)
        return
    else:
        tensors = _window(args.save, backend)
        if backend.is_main_process:
            safetensors.torch.save_file(tensors, args.out)
        return
    tensors = full_state(state)
    if backend.is_main_process:
        safetensors.torch.save_file(tensors, args.out)


if __name__ == "__main__":
    main()
