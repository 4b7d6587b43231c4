"""Preemption: on SIGTERM or SIGINT, finish the micro-batch, checkpoint, exit 128+signal.

Clusters announce preemption with SIGTERM and a grace period; Ctrl-C sends SIGINT. While
``run`` trains, both only set a flag. After each micro-batch ``run`` asks ``requested()``;
in a multi-process world the ranks agree (``distributed.Agreement``, one round late) so
that all of them stop after the same micro-batch, one micro-batch after the first rank saw
the signal. ``stop`` then writes a checkpoint, even in the middle of an accumulation
window, and exits with the
shell's status for death by that signal (143 for SIGTERM, 130 for SIGINT), which tells
``torchrun`` and schedulers that the job was interrupted, not finished.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

from accelfn.distributed import Agreement

if TYPE_CHECKING:
    from accelfn.backends.base import Backend
    from accelfn.checkpoint.checkpoints import Schedule
    from accelfn.state import TrainState

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
    """Turns SIGTERM/SIGINT into a checkpoint and a clean exit at a micro-batch boundary.

    A context manager: entering installs the handlers (in the main thread only; elsewhere
    signals cannot be handled and nothing is installed), leaving puts the previous ones
    back. A second SIGINT while the first is pending raises KeyboardInterrupt at once. A
    signal that arrives after the last micro-batch is delivered again, to the previous
    handler, when the context exits.

    Args:
        backend: the process context (its world size and collective timeout).
    """

    def __init__(self, backend: Backend):
        self._backend = backend
        self._received = 0
        self._agreed = 0
        self._stopping = False
        self._previous: dict[int, Any] = {}
        self._agreement = Agreement(backend.world_size, backend.env.timeout_s)

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        self._agreement.close(wait=exc_type is None or self._stopping)
        if exc_type is None and self._received and not self._stopping:
            signal.raise_signal(self._received)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self._received == signal.SIGINT:
            raise KeyboardInterrupt
        self._received = signum

    def requested(self) -> bool:
        """True once all ranks agree that a rank received a signal (call once per micro-batch,
        on every rank)."""
        agreed = self._agreement.propose(self._received)
        if agreed:
            self._agreed = agreed
        return bool(agreed)

    def stop(self, state: TrainState, schedule: Schedule | None) -> NoReturn:
        """Writes a checkpoint of ``state`` (if ``schedule``) and exits with 128+signal.

        Raises:
            SystemExit: always, with status 128 + the signal number.
        """
        self._stopping = True
        signum = self._agreed or self._received
        if schedule is not None:
            path = schedule.save(state)
            done = f"saved {path} (step {state.step}, micro-batch {state.micro_step})"
        else:
            done = "nothing saved (run(checkpoints=...) was not given)"
        name = signal.Signals(signum).name
        self._backend.print(f"accelfn: {name} received; {done}; exiting with status {128 + signum}",
                            file=sys.stderr, flush=True)
        agreed = SystemExit(128 + signum)
        agreed.agreed = True  # type: ignore[attr-defined]  # every rank exits at this micro-batch: they leave together
        raise agreed
