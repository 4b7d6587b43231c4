"""Ray Train: ``run``'s metrics and checkpoints reported to Ray, and Ray's checkpoint to resume from.

Under Ray Train's ``TorchTrainer`` each worker runs ``train_loop_per_worker`` in a process
of its own, with the gloo (or NCCL) process group already formed: ``af.run`` finds it and
trains as usual. ``ray.train.report`` is a barrier that every worker must reach, so
:class:`RayTrain` is a tracker that ``run`` calls on every rank (``every_rank = True``) at
the same log points and checkpoints, with the same values (reduced over the ranks).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from accelfn.tracking._config import require


class RayTrain:
    """Reports ``run``'s metrics and checkpoints to Ray Train from inside ``train_loop_per_worker``.

    At each log point (every ``run(log_every=...)`` updates) every rank calls
    ``ray.train.report(metrics)`` with the metrics ``run`` logs (already averaged over the
    ranks, so the same on every rank) plus ``"step"`` (``state.step``); a hook's values are
    reported at its step, merged with that step's metrics. After each checkpoint that
    ``run(checkpoints=af.Checkpoints(...))`` writes, every rank reports again, with the last
    metrics and, on rank 0, ``ray.train.Checkpoint.from_directory(<the checkpoint>)`` (other
    ranks pass None), named as accelfn names it (``step_00000012``): Ray copies it to its
    storage (``RunConfig(storage_path=...)``) and ``Result.checkpoint`` is the last one.
    Rank 0's directory must hold the whole checkpoint, which it does on one node or a
    shared file system (a ``shard_params`` checkpoint is written by every rank into one
    directory). A checkpoint is reported once it is complete on disk: with
    ``af.Checkpoints(asynchronous=True)``, at the first update after its background write
    has ended (all ranks agree on that update, one update late), or when the run ends, with
    the metrics of its own step if they are the last logged, else only ``"step"``.

    :meth:`resume` gives the checkpoint Ray hands a restarted worker group
    (``ray.train.get_checkpoint()``, after a failure that ``FailureConfig(max_failures=N)``
    allows): passed to ``run(resume=...)``, the run continues bitwise as if it had not
    failed.

    Preemption: Ray runs ``train_loop_per_worker`` off the main thread, where signal
    handlers cannot be installed, so ``run``'s SIGTERM checkpoint does not happen under Ray.
    Instead, after each log point every rank asks ``ray.train.get_preemption_info()`` (Ray
    Train V2, Ray 2.60's default; a collective); at the first notice that a node of
    the worker group is being preempted, ``save_requested`` turns True and ``run`` writes
    (and this tracker reports) a checkpoint after that update, then trains on until Ray
    restarts the group from it (``FailureConfig(max_preemption_failures=...)``). The notice
    is seen at most ``log_every`` updates late. Without V2 (``RAY_TRAIN_V2_ENABLED=0``) there
    is no notice: a preempted group restarts from the last periodic checkpoint.

    Raises:
        ImportError: Ray is not installed (``pip install "accelfn[ray]"``).

    Example:
        A ``train_loop_per_worker`` (run by ``ray.train.torch.TorchTrainer``)::

            def train_loop(config):
                tracker = af.RayTrain()
                with af.RayTrain.resume() as checkpoint:  # None on the first attempt
                    af.run(program, state, data, checkpoints=af.Checkpoints("/tmp/ckpt", every_steps=50),
                           resume=checkpoint, trackers=[tracker], log_every=10)
    """

    every_rank = True  # run calls it on every process: ray.train.report is a collective

    def __init__(self) -> None:
        require("ray", "RayTrain", "ray")
        import ray.train

        self._train = ray.train
        self._last: dict[str, float] = {}
        self._last_step: int | None = None
        self._notice = getattr(ray.train, "get_preemption_info", None)  # Ray Train V2 only
        self._v2 = "delete_local_checkpoint_after_upload" in inspect.signature(ray.train.report).parameters
        self._noticed = False
        #: True from a preemption notice until the checkpoint ``run`` then writes is reported
        self.save_requested = False

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Reports ``metrics`` at ``step`` to Ray, then asks Ray for a preemption notice (on
        every rank: both are collectives)."""
        if step != self._last_step:
            self._last, self._last_step = {}, step
        self._last.update(metrics)
        self._train.report({**self._last, "step": step})
        if self._notice is not None and not self._noticed and self._notice() is not None:
            self._noticed = self.save_requested = True

    def saved(self, path: Path, step: int) -> None:
        """Reports the checkpoint ``path`` written at ``step`` with the last metrics (on every
        rank: a collective; rank 0 passes the checkpoint, the others None)."""
        metrics = self._last if step == self._last_step else {}
        rank = self._train.get_context().get_world_rank()
        checkpoint = self._train.Checkpoint.from_directory(str(path)) if rank == 0 else None
        keep = {"delete_local_checkpoint_after_upload": False} if self._v2 else {}  # Checkpoints(keep=...) owns it
        self._train.report({**metrics, "step": step}, checkpoint=checkpoint, checkpoint_dir_name=Path(path).name,
                           **keep)
        self.save_requested = False

    def close(self) -> None:
        """Nothing to flush: every point was reported when it was logged."""

    @staticmethod
    @contextlib.contextmanager
    def resume() -> Iterator[Path | None]:
        """The directory of the checkpoint Ray restarts this worker group from
        (``ray.train.get_checkpoint()``), for ``run(resume=...)``, or None on a first start.

        A context manager: the directory (a local copy where Ray's storage is remote) lasts
        until it exits.

        Raises:
            ImportError: Ray is not installed (``pip install "accelfn[ray]"``).
        """
        require("ray", "RayTrain", "ray")
        import ray.train

        checkpoint: Any = ray.train.get_checkpoint()
        if checkpoint is None:
            yield None
            return
        with checkpoint.as_directory() as directory:
            yield Path(directory)
