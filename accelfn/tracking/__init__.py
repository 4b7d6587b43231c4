"""Trackers: where ``run`` writes metrics, one point per optimizer update at ``x = state.step``,
and the run configuration.

``run`` calls trackers on the main process only, with values already reduced over ranks,
so a multi-process run writes one TensorBoard event file, one JSONL file, one MLflow run,
one W&B run and one Comet experiment. A tracker is any object with ``log(metrics, step)``
and ``close()`` (:class:`Tracker`); one that also has ``log_config(config)`` (:class:`ConfigTracker`)
receives ``run(config=...)`` once per run. Each tracker's library object is public
(``TensorBoard.writer``, ``WandB.run``, ``MLflow.client`` with ``MLflow.run_id``,
``Comet.experiment``), for what ``run`` does not log. ``RayTrain`` reports to Ray Train from
every rank (``ray.train.report`` is a collective).

A second ``run`` through the same tracker object continues its run when it starts at or
after the last step logged (phases, a ``run`` per epoch) and restarts when it starts before
(``find_batch_size``'s retry): a new MLflow/W&B/Comet run, TensorBoard's restart marker,
JSONL's own later lines removed (``accelfn.tracking._runs``; docs/05).
"""

from accelfn.tracking._comet import Comet
from accelfn.tracking._files import JSONL, ConfigTracker, TensorBoard, Tracker
from accelfn.tracking._mlflow import MLflow
from accelfn.tracking._ray import RayTrain
from accelfn.tracking._wandb import WandB

__all__ = ["JSONL", "Comet", "ConfigTracker", "MLflow", "RayTrain", "TensorBoard", "Tracker", "WandB"]
