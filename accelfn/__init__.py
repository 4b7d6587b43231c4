"""accelfn: train PyTorch models anywhere with composable, functional transforms."""

from accelfn import backends
from accelfn._version import __version__
from accelfn.checkpoint import Checkpoints, Snapshot, load, restore, save, snapshot
from accelfn.errors import CheckpointError, LaunchError, NonFiniteError, TransformError
from accelfn.evaluate import evaluate
from accelfn.loop import Hook, Profile, Stop, UpdateCount, count_updates, run
from accelfn.state import TrainState
from accelfn.step import Loss, Step, train_step
from accelfn.tracking import JSONL, ConfigTracker, MLflow, TensorBoard, Tracker, WandB
from accelfn.transforms import (
    Accumulate,
    Clip,
    ClipValue,
    Replicate,
    ShardData,
    SkipNonfinite,
    Transform,
    WithPrecision,
    accumulate,
    clip,
    clip_value,
    compose,
    replicate,
    shard_data,
    skip_nonfinite,
    with_precision,
)

__all__ = [
    "JSONL",
    "Accumulate",
    "CheckpointError",
    "Checkpoints",
    "Clip",
    "ClipValue",
    "ConfigTracker",
    "Hook",
    "LaunchError",
    "Loss",
    "MLflow",
    "NonFiniteError",
    "Profile",
    "Replicate",
    "ShardData",
    "SkipNonfinite",
    "Snapshot",
    "Step",
    "Stop",
    "TensorBoard",
    "Tracker",
    "TrainState",
    "Transform",
    "TransformError",
    "UpdateCount",
    "WandB",
    "WithPrecision",
    "__version__",
    "accumulate",
    "backends",
    "clip",
    "clip_value",
    "compose",
    "count_updates",
    "evaluate",
    "load",
    "replicate",
    "restore",
    "run",
    "save",
    "shard_data",
    "skip_nonfinite",
    "snapshot",
    "train_step",
    "with_precision",
]
