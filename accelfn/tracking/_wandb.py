"""``WandB``: metrics and the run configuration in a Weights & Biases run (``wandb.init``)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from accelfn.errors import check_directory, to_path
from accelfn.tracking._config import plain, require
from accelfn.tracking._runs import Runs

Mode = Literal["online", "offline", "disabled"]
_MODES = ("online", "offline", "disabled")


class WandB:
    """Logs metrics (``run.log(metrics, step=step)``) and the run configuration (``run.config``)
    to Weights & Biases.

    ``mode="offline"`` needs no account and no network: the run is written under
    ``dir/wandb/offline-run-*`` (upload it later with ``wandb sync``, or read it with
    ``wandb leet inspect``). With ``mode=None`` W&B decides, from ``WANDB_MODE`` or
    ``wandb offline``/``wandb login``. The W&B run starts at the first call, on the process
    that logs (the main process), and ``close`` finishes it; a ``log`` after ``close``, or
    :meth:`reopen`, resumes the same run (same ``run_id``), and reading :attr:`run` after
    ``close`` does not. Installed by ``pip install "accelfn[wandb]"``.

    A later ``run`` through the same tracker that continues (it starts at or after the last
    step logged: phases, a ``run`` per epoch) resumes the same W&B run, its rows after the
    earlier ones, its configuration merged into the run's (a changed value replaces the
    earlier). A ``run`` that restarts from an earlier step (``find_batch_size``'s retry
    after an out-of-memory error, a rerun from an earlier snapshot) starts a new W&B run (a
    new ``run_id``) with its own configuration: W&B drops rows of a step below one it
    already holds, so the same run could not take them.

    Args:
        project: the W&B project.
        dir: the directory W&B writes its run files under (``dir/wandb``), created if missing.
        name: the run's display name, or None for W&B's generated one.
        mode: ``"online"``, ``"offline"``, ``"disabled"``, or None for W&B's own setting.
        entity: the W&B user or team, or None for the default one.
        tags: tags of the run.

    Raises:
        ImportError: wandb is not installed (the message says which extra installs it).
        ValueError: an unknown ``mode``, or ``dir`` is a file.

    Example:
        >>> import accelfn as af
        >>> tracker = af.WandB("mnist", dir="runs", mode="offline")
    """

    def __init__(self, project: str = "accelfn", *, dir: str | os.PathLike[str] = ".", name: str | None = None,
                 mode: Mode | None = None, entity: str | None = None, tags: Sequence[str] = ()):
        require("wandb", "WandB", "wandb")
        if mode is not None and mode not in _MODES:
            raise ValueError(f"WandB(mode={mode!r}): accepted values are {', '.join(map(repr, _MODES))} or None "
                             "(W&B's own setting)")
        self.dir = to_path("WandB", "dir", dir)
        check_directory(self.dir, f"WandB(dir={str(dir)!r})")
        self.project, self.name, self.mode, self.entity, self.tags = project, name, mode, entity, tuple(tags)
        self.run_id: str | None = None
        self._run: Any = None
        self._finished: Any = None  # the run `close` finished, until it resumes
        self._config: dict[str, Any] = {}
        self._runs = Runs()

    def __repr__(self) -> str:
        return f"WandB({self.project!r}, dir={str(self.dir)!r}, mode={self.mode!r})"

    @property
    def run(self) -> Any:
        """The ``wandb`` run ``af.run`` logs to (started if none has started): for what
        ``af.run`` does not log (``tracker.run.log({"samples": wandb.Table(...)})`` in a hook).
        Use it on the main process only, as ``af.run`` does: on another process it starts a
        W&B run of its own.

        After ``close`` (``af.run`` closes its trackers at its end) it is the finished run, to
        read (``id``, ``name``, ``url``), never a resumed one; W&B refuses what is logged to
        it (``wandb.errors.UsageError``): call :meth:`reopen` to add to the run after the run.
        """
        if self._run is None and self._finished is not None:
            return self._finished
        return self._open()

    def reopen(self) -> Any:
        """Resumes the W&B run ``close`` finished (the same ``run_id``), or starts one if none
        has started, and returns it; the next ``close`` finishes it again."""
        return self._open()

    def _open(self) -> Any:
        """The W&B run in progress, started (or resumed) if there is none."""
        if self._run is None:
            self._finished = None
            import wandb

            self.dir.mkdir(parents=True, exist_ok=True)
            self._run = wandb.init(
                project=self.project, dir=str(self.dir), name=self.name, mode=self.mode, entity=self.entity,
                tags=list(self.tags) or None, config=self._config or None, id=self.run_id,
                resume="allow" if self.run_id is not None else None,
                settings=wandb.Settings(console="off", silent=True), reinit="create_new",
            )
            self.run_id = self._run.id
        return self._run

    def start(self, step: int) -> None:
        """Called by ``run`` before it logs: a restart from ``step`` finishes the W&B run, and
        the next call starts a new one (class docstring)."""
        if self._runs.start(step) and self.run_id is not None:
            self.close()
            self.run_id, self._finished = None, None
            self._config = {}

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Logs the metrics as one row at W&B step ``step`` (rows of the same step merge)."""
        self._open().log(dict(metrics), step=step)
        self._runs.logged(step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Adds the configuration to ``run.config`` (nested keys stay nested)."""
        config = plain(config)
        self._config.update(config)
        if self._run is not None:
            self._run.config.update(config, allow_val_change=True)

    def close(self) -> None:
        """Finishes the W&B run (its files are complete on disk)."""
        if self._run is not None:
            self._run.finish()
            self._finished, self._run = self._run, None
