"""``MLflow``: metrics and the run configuration in an MLflow tracking store, through
``mlflow.MlflowClient`` (no global active run is started or changed)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from accelfn.errors import check_directory, to_path
from accelfn.tracking._config import flatten, require
from accelfn.tracking._runs import Runs

# MLflow's own limits on one log_batch call (mlflow.utils.validation)
_MAX_PARAMS_PER_BATCH = 100
_MAX_METRICS_PER_BATCH = 1000


class MLflow:
    """Logs metrics (``log_batch`` at ``step``) and the run configuration (params) to MLflow.

    Without ``tracking_uri`` everything stays under ``dir``: the store is the SQLite
    database ``dir/mlflow.db`` (no server; view it with ``mlflow ui --backend-store-uri
    sqlite:///<dir>/mlflow.db``) and artifacts go to ``dir/artifacts``. With
    ``tracking_uri`` (``"http://host:5000"``, ``"sqlite:///..."``, ``"databricks"``) the
    store is that one. The MLflow run is created at the first call, on the process that
    logs (the main process); its id is ``run_id``. Installed by ``pip install "accelfn[mlflow]"``.

    A later ``run`` through the same tracker that continues (it starts at or after the last
    step logged: phases, a ``run`` per epoch) logs to the same MLflow run. MLflow's params
    cannot change, so a value of its configuration that differs from the one logged (a
    phase with another batch size) is logged as ``<key>/from_step_<N>``, N the step that
    ``run`` started from; the others are not sent again. A ``run`` that restarts from an
    earlier step (``find_batch_size``'s retry after an out-of-memory error, a rerun from an
    earlier snapshot) gets a new MLflow run (a new ``run_id``), with its own params; the
    earlier one stays as it was, finished.

    Args:
        dir: the directory of the local store (created when first used), or None with
            ``tracking_uri``.
        experiment: the experiment's name (created if missing).
        run_name: the run's name in the UI, or None for MLflow's generated one.
        tracking_uri: the tracking store, or None for the SQLite store under ``dir``.
        tags: tags set on the run (``{"team": "vision"}``).

    Raises:
        ImportError: MLflow is not installed (the message says which extra installs it).
        ValueError: neither or both of ``dir`` and ``tracking_uri``; ``dir`` is a file;
            ``experiment`` is empty.

    Example:
        >>> import accelfn as af
        >>> tracker = af.MLflow("runs/mlflow", experiment="mnist")
    """

    def __init__(self, dir: str | os.PathLike[str] | None = None, *, experiment: str = "accelfn",
                 run_name: str | None = None, tracking_uri: str | None = None,
                 tags: Mapping[str, str] | None = None):
        require("mlflow", "MLflow", "mlflow")
        if (dir is None) == (tracking_uri is None):
            raise ValueError(f"MLflow(dir={dir!r}, tracking_uri={tracking_uri!r}): give one of them, a directory "
                             "for a local store (MLflow('runs/mlflow')) or the URI of a tracking server")
        self.dir = to_path("MLflow", "dir", dir) if dir is not None else None
        if self.dir is not None:
            check_directory(self.dir, f"MLflow(dir={str(dir)!r})")
        if not isinstance(experiment, str) or not experiment:
            raise ValueError(f"MLflow(experiment={experiment!r}): give a non-empty experiment name")
        self.experiment = experiment
        self.run_name = run_name
        self.tracking_uri = tracking_uri
        self.tags = dict(tags or {})
        self.run_id: str | None = None
        self._client: Any = None
        self._runs = Runs()
        self._params: dict[str, str] = {}  # the params of run_id's run logged through this tracker

    def __repr__(self) -> str:
        where = f"tracking_uri={self.tracking_uri!r}" if self.dir is None else repr(str(self.dir))
        return f"MLflow({where}, experiment={self.experiment!r})"

    @property
    def uri(self) -> str:
        """The tracking URI: ``tracking_uri``, or the SQLite store ``sqlite:///<dir>/mlflow.db``."""
        if self.dir is None:
            return self.tracking_uri  # type: ignore[return-value]
        return f"sqlite:///{(self.dir / 'mlflow.db').resolve()}"

    @property
    def client(self) -> Any:
        """The ``mlflow.MlflowClient`` of the tracking URI, with the run created (its id is
        ``run_id``): for what ``run`` does not log (``tracker.client.log_artifact(tracker.run_id,
        path)``)."""
        self._run()
        return self._client

    def _run(self) -> str:
        if self._client is None:
            from mlflow import MlflowClient

            artifacts = None
            if self.dir is not None:
                self.dir.mkdir(parents=True, exist_ok=True)
                artifacts = (self.dir / "artifacts").resolve().as_uri()
            self._client = MlflowClient(tracking_uri=self.uri)
        if self.run_id is None:
            found = self._client.get_experiment_by_name(self.experiment)
            experiment_id = (found.experiment_id if found is not None
                             else self._client.create_experiment(self.experiment, artifact_location=artifacts))
            self.run_id = self._client.create_run(experiment_id, run_name=self.run_name, tags=self.tags).info.run_id
        return self.run_id

    def start(self, step: int) -> None:
        """Called by ``run`` before it logs: a restart from ``step`` makes the next call
        create a new MLflow run (class docstring)."""
        if self._runs.start(step) and self.run_id is not None:
            self.run_id = None
            self._params = {}

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Logs every metric at ``step`` in one ``log_batch`` call (more if over 1000)."""
        from mlflow.entities import Metric

        run_id = self._run()
        timestamp = int(time.time() * 1000)
        batch = [Metric(name, float(value), timestamp, step) for name, value in metrics.items()]
        for i in range(0, len(batch), _MAX_METRICS_PER_BATCH):
            self._client.log_batch(run_id, metrics=batch[i:i + _MAX_METRICS_PER_BATCH])
        self._runs.logged(step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Logs the configuration as params, nested keys joined by dots (``"accelfn.world_size"``);
        in a continued run, only what is new, a changed value as ``<key>/from_step_<N>``."""
        from mlflow.entities import Param

        run_id = self._run()
        new: dict[str, str] = {}
        for key, value in flatten(config).items():
            logged = self._params.get(key)
            if logged is not None and logged != str(value):  # MLflow's params are immutable
                key = f"{key}/from_step_{self._runs.started or 0}"
                logged = self._params.get(key)
            if logged is None:
                new[key] = str(value)
        self._params.update(new)
        params = [Param(key, value) for key, value in new.items()]
        for i in range(0, len(params), _MAX_PARAMS_PER_BATCH):
            self._client.log_batch(run_id, params=params[i:i + _MAX_PARAMS_PER_BATCH])

    def close(self) -> None:
        """Marks the MLflow run finished (a later ``log`` still adds to it)."""
        if self._client is not None and self.run_id is not None:
            self._client.set_terminated(self.run_id)
