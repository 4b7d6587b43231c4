"""Checkpoints written in the background while training goes on.

The design follows orbax's ``AsyncCheckpointer`` and torchtitan's asynchronous mode: the
training thread only copies the state to host memory; a background thread writes it. The
loop's schedule (``accelfn.loop._schedule``) drives it:

* **In the training thread**: wait for the previous save (``BackgroundSaves.wait``; so at
  most one host copy is in flight, and saves complete in order), copy every tensor of the
  state into host buffers (``HostBuffers``: allocated at the first save and reused after,
  pinned on CUDA so the device-to-host copies run asynchronously, then synchronized), and
  in a multi-process world gather every rank's own part to rank 0 (``io.collect``). The
  gather is a collective, so it stays here: the background thread runs no collective, and
  none of its work can interleave with training's collectives.
* **In the background thread** (``BackgroundSaves.start``, rank 0 only): the files are
  written and hashed, fsynced, the manifest written last, the directory renamed into
  place, old checkpoints deleted (``Checkpoints.write``), exactly as a synchronous save
  does, so a crash at any instant leaves the previous checkpoint or the new one, and
  ``latest()`` never sees a partial one. The thread runs at a lower scheduling priority
  (Linux), so that where it competes with training for CPU cores, training wins.
* **Errors are never lost**: a failed write is kept and raised in the training thread
  after the next optimizer update (``failed``; in a multi-process world the ranks agree on
  it, one update late, without blocking, and all raise at the same update), by the next
  save, or when ``run`` ends (``wait``), naming the checkpoint and the cause.
* **Exit**: ``run`` waits for the save in flight when it ends, before a preemption's final
  checkpoint, and when an error ends it; the thread is not a daemon, so the interpreter
  also waits for it at exit. A process killed outright abandons the save; the atomic write
  leaves the previous checkpoint intact.

Sharded states (``shard_params``, DCP) take the same design: every rank stages its own
shards to host memory in the training thread (``torch.distributed.checkpoint``'s
``async_save`` does this with its stager), then writes its own files in the background.
Unlike the consolidated path, DCP's save plans with collectives, so its background part
needs a process group of its own (gloo), never the training group; the commit of the
metadata (the manifest's counterpart) and the agreement on errors stay as here.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from accelfn.checkpoint._context import ProcessContext
from accelfn.errors import CheckpointError

#: how much lower the writing threads' scheduling priority is than training's (Linux nice)
BACKGROUND_NICENESS = 10


class HostBuffers:
    """Host copies of a state's tensors, reused from one checkpoint to the next.

    Called once per tensor, in the same order at every checkpoint (the snapshot's
    traversal); a tensor whose shape or dtype changed gets a new buffer. Buffers for CUDA
    tensors are pinned and filled asynchronously; ``synchronize`` waits for the copies.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._next = 0
        self._devices: set[torch.device] = set()

    def begin(self) -> None:
        """Starts a new checkpoint's copies (buffers are reused in call order)."""
        self._next = 0
        self._devices = set()

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        i, self._next = self._next, self._next + 1
        pin = t.is_cuda and torch.cuda.is_available()
        if i < len(self._buffers):
            buffer = self._buffers[i]
            if buffer.shape != t.shape or buffer.dtype != t.dtype:
                buffer = self._buffers[i] = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
        else:
            buffer = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            self._buffers.append(buffer)
        buffer.copy_(t.detach(), non_blocking=pin)
        if pin:
            self._devices.add(t.device)
        return buffer

    def synchronize(self) -> None:
        """Waits until every copy since ``begin`` is complete."""
        for device in self._devices:
            torch.cuda.synchronize(device)

    @property
    def num_bytes(self) -> int:
        """The host memory the buffers hold."""
        return sum(b.numel() * b.element_size() for b in self._buffers)


class BackgroundSaves:
    """One run's background checkpoint writes: at most one in flight, errors kept until raised.

    Args:
        backend: the process context; rank 0 writes, every rank takes part in ``wait``.
    """

    def __init__(self, backend: ProcessContext):
        self._backend = backend
        self.buffers = HostBuffers()
        self._thread: threading.Thread | None = None
        self._path: Path | None = None
        self._error: BaseException | None = None

    def start(self, path: Path, write: Callable[[], None]) -> None:
        """Runs ``write`` (rank 0's writing of ``path``) in a new background thread; the
        previous save must have been waited for (``wait``)."""
        assert self._thread is None, "a background save is still in flight"
        self._path, self._error = path, None
        self._thread = threading.Thread(target=self._run, args=(write,), name=f"accelfn-save-{path.name}",
                                        daemon=False)
        self._thread.start()

    def _run(self, write: Callable[[], None]) -> None:
        # Linux schedules threads by their own nice value (inherited by the threads this one
        # starts): the write yields the CPU to training where both compete for it
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICENESS)
        try:
            write()
        except BaseException as e:  # kept, and raised in the training thread
            self._error = e

    def in_flight(self) -> bool:
        """True while a background write is running."""
        return self._thread is not None and self._thread.is_alive()

    def failed(self) -> bool:
        """True if the save in flight has finished with an error (this rank's own view)."""
        return self._thread is not None and not self._thread.is_alive() and self._error is not None

    def wait(self, *, agree: bool = True) -> None:
        """Waits for the save in flight to finish and raises its error, on every rank.

        Args:
            agree: tell every rank the outcome (a collective: call it on every rank); with
                False (an error is already ending the run), only this rank's save is waited
                for and a failure is printed instead of raised.

        Raises:
            CheckpointError: the background write failed (on rank 0 with its cause chained;
                on the other ranks, naming rank 0).
        """
        thread, path, error = self._thread, self._path, None
        if thread is not None:
            thread.join()
            error = self._error
            self._thread, self._error = None, None
        if not agree:
            if error is not None:
                print(f"accelfn: writing the checkpoint {path} in the background failed: {_cause(error)}",
                      file=sys.stderr, flush=True)
            return
        backend = self._backend
        if backend.world_size > 1:
            failed = torch.tensor([int(error is not None), -1 if path is None else _step(path)], dtype=torch.int64)
            failed = backend.broadcast(failed)
            if error is None and int(failed[0]):
                raise CheckpointError(f"rank 0 failed to write the checkpoint of step {int(failed[1])} in the "
                                      "background; its error says why")
        if error is not None:
            raise CheckpointError(f"writing the checkpoint {path} in the background failed: {_cause(error)}") from error


def _cause(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _step(path: Path) -> int:
    digits = path.name.rpartition("_")[2]
    return int(digits) if digits.isdigit() else -1
