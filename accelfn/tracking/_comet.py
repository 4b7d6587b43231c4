"""``Comet``: metrics and the run configuration in a Comet experiment (``comet_ml.start``)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from accelfn.errors import check_directory, to_path
from accelfn.tracking._config import flatten, require
from accelfn.tracking._runs import Runs

Mode = Literal["online", "offline"]
_MODES = ("online", "offline")


class Comet:
    """Logs metrics (``experiment.log_metrics(metrics, step=step)``) and the run configuration
    (``experiment.log_parameters``, nested keys joined by dots) to a Comet experiment.

    ``mode="offline"`` needs no account and no network: the experiment is archived as
    ``dir/<experiment key>*.zip`` when it ends (upload it later with ``comet upload``), and
    comet_ml's own error reports to Sentry are off (``COMET_ERROR_TRACKING_ENABLE=false``
    unless set, when comet_ml is first imported by this tracker).
    ``mode="online"`` logs live and needs ``COMET_API_KEY`` (or ``~/.comet.config``); with
    ``mode=None`` Comet decides from its own settings (``COMET_START_ONLINE``). Comet's
    automatic logging (code, git, environment, console output, its own metrics) is off: the
    experiment holds what ``run`` logs. The experiment starts at the first call, on the
    process that logs (the main process), and ``close`` ends it; a ``log`` after ``close``,
    or :meth:`reopen`, continues the same experiment (same ``experiment_key``; offline, in a
    second archive that ``comet upload`` adds to it), and reading :attr:`experiment` after
    ``close`` does not. Installed by ``pip install "accelfn[comet]"``.

    A later ``run`` through the same tracker that continues (it starts at or after the last
    step logged: phases, a ``run`` per epoch) continues the same experiment; a changed
    parameter takes its new value. A ``run`` that restarts from an earlier step
    (``find_batch_size``'s retry after an out-of-memory error, a rerun from an earlier
    snapshot) starts a new experiment (a new ``experiment_key``) with its own parameters.

    Args:
        project: the Comet project.
        dir: offline mode: the directory of the archives, created if missing; None for
            Comet's default (``.cometml-runs``).
        name: the experiment's display name, or None for Comet's generated one.
        mode: ``"online"``, ``"offline"``, or None for Comet's own setting.
        workspace: the Comet workspace, or None for the default one.
        tags: tags of the experiment.

    Raises:
        ImportError: comet_ml is not installed (the message says which extra installs it).
        ValueError: an unknown ``mode``, or ``dir`` is a file.

    Example:
        >>> import accelfn as af
        >>> tracker = af.Comet("mnist", dir="runs/comet", mode="offline")
    """

    def __init__(self, project: str = "accelfn", *, dir: str | os.PathLike[str] | None = None,
                 name: str | None = None, mode: Mode | None = None, workspace: str | None = None,
                 tags: Sequence[str] = ()):
        require("comet_ml", "Comet", "comet")
        if mode is not None and mode not in _MODES:
            raise ValueError(f"Comet(mode={mode!r}): accepted values are {', '.join(map(repr, _MODES))} or None "
                             "(Comet's own setting)")
        self.dir: Path | None = to_path("Comet", "dir", dir) if dir is not None else None
        if self.dir is not None:
            check_directory(self.dir, f"Comet(dir={str(dir)!r})")
        self.project, self.name, self.mode, self.workspace, self.tags = project, name, mode, workspace, tuple(tags)
        #: the experiment's key once it started (``experiment.get_key()``), else None
        self.experiment_key: str | None = None
        self._experiment: Any = None
        self._ended: Any = None  # the experiment `close` ended, until it continues
        self._runs = Runs()

    def __repr__(self) -> str:
        return f"Comet({self.project!r}, dir={None if self.dir is None else str(self.dir)!r}, mode={self.mode!r})"

    @property
    def experiment(self) -> Any:
        """The ``comet_ml`` experiment ``run`` logs to (started if none has started): for what
        ``run`` does not log (``tracker.experiment.log_asset(...)`` in a hook). Use it on the
        main process only, as ``run`` does: on another process it starts an experiment of
        its own.

        After ``close`` (``af.run`` closes its trackers at its end) it is the ended
        experiment, to read (``get_key()``, ``get_name()``, ``url``), never a restarted one;
        a call on it that would log raises ``RuntimeError`` (comet_ml would ignore it
        silently): call :meth:`reopen` to add to the experiment after the run.
        """
        if self._experiment is None and self._ended is not None:
            return _Ended(self._ended)
        return self._open()

    def reopen(self) -> Any:
        """Continues the experiment ``close`` ended (the same ``experiment_key``; offline, in a
        second archive that ``comet upload`` adds to it), or starts one if none has started,
        and returns it; the next ``close`` ends it again."""
        return self._open()

    def _open(self) -> Any:
        """The experiment in progress, started (or continued) if there is none."""
        if self._experiment is None:
            self._ended = None
            if self.mode == "offline":  # no network: comet_ml reports its own errors to Sentry from import on
                os.environ.setdefault("COMET_ERROR_TRACKING_ENABLE", "false")
            import comet_ml

            if self.dir is not None:
                self.dir.mkdir(parents=True, exist_ok=True)
            config = comet_ml.ExperimentConfig(  # Comet's automatic logging off: the experiment holds run's values
                log_code=False, log_graph=False, parse_args=False, log_git_metadata=False, log_git_patch=False,
                log_env_details=False, log_env_gpu=False, log_env_host=False, log_env_cpu=False,
                log_env_network=False, log_env_disk=False, auto_param_logging=False, auto_metric_logging=False,
                auto_log_co2=False, auto_output_logging=False,  # type: ignore[arg-type]  # False is documented
                display_summary_level=0, name=self.name, tags=list(self.tags) or None,
                offline_directory=None if self.dir is None else str(self.dir))
            self._experiment = comet_ml.start(
                project_name=self.project, workspace=self.workspace, experiment_key=self.experiment_key,
                mode="get" if self.experiment_key is not None else "create",
                online=None if self.mode is None else self.mode == "online", experiment_config=config)
            self.experiment_key = self._experiment.get_key()
        return self._experiment

    def start(self, step: int) -> None:
        """Called by ``run`` before it logs: a restart from ``step`` ends the experiment, and
        the next call starts a new one (class docstring)."""
        if self._runs.start(step) and self.experiment_key is not None:
            self.close()
            self.experiment_key, self._ended = None, None

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Logs the metrics at Comet step ``step`` (after ``close``: continuing the experiment)."""
        self._open().log_metrics(dict(metrics), step=step)
        self._runs.logged(step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Logs the configuration as parameters, nested keys joined by dots (``"accelfn.world_size"``)."""
        self._open().log_parameters(flatten(config))

    def close(self) -> None:
        """Ends the experiment (offline: writes its archive)."""
        if self._experiment is not None:
            self._experiment.end()
            self._ended, self._experiment = self._experiment, None


class _Ended:
    """An ended ``comet_ml`` experiment, as :attr:`Comet.experiment` gives it after ``close``:
    attributes and ``get_*`` methods read it; any other method (``log_*``, ``set_*``...)
    raises, where comet_ml would ignore the call on an ended experiment silently."""

    def __init__(self, experiment: Any):
        object.__setattr__(self, "_experiment", experiment)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._experiment, name)
        if callable(value) and not name.startswith("get_") and name != "end":
            raise RuntimeError(
                f"Comet.experiment.{name}: the experiment {self._experiment.get_key()} has ended (af.run closes "
                "its trackers at its end), and comet_ml ignores what is logged to an ended experiment; call "
                "tracker.reopen() to continue it (the same key; offline, a second archive that `comet upload` "
                "adds to it), then tracker.close()")
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        raise RuntimeError(f"Comet.experiment.{name} = ...: the experiment has ended; call tracker.reopen() to "
                           "continue it")

    def __repr__(self) -> str:
        return f"<ended {self._experiment!r}>"
