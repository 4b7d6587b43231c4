"""accelfn: train PyTorch models anywhere with composable, functional transforms."""

from accelfn import backends
from accelfn._version import __version__
from accelfn.checkpoint import Checkpoints, Snapshot, load, restore, save, snapshot
from accelfn.errors import CheckpointError, LaunchError, NonFiniteError, TransformError
from accelfn.evaluate import evaluate
from accelfn.loop import run
from accelfn.state import TrainState
from accelfn.step import Loss, Step, train_step
from accelfn.tracking import JSONL, TensorBoard, Tracker
from accelfn.transforms import (
    Accumulate,
    Clip,
    ClipValue,
    Replicate,
    ShardData,
    ShardParams,
    SkipNonfinite,
    Transform,
    WithPrecision,
    accumulate,
    clip,
    clip_value,
    compose,
    replicate,
    shard_data,
    shard_params,
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
    "LaunchError",
    "Loss",
    "NonFiniteError",
    "Replicate",
    "ShardData",
    "ShardParams",
    "SkipNonfinite",
    "Snapshot",
    "Step",
    "TensorBoard",
    "Tracker",
    "TrainState",
    "Transform",
    "TransformError",
    "WithPrecision",
    "__version__",
    "accumulate",
    "backends",
    "clip",
    "clip_value",
    "compose",
    "evaluate",
    "load",
    "replicate",
    "restore",
    "run",
    "save",
    "shard_data",
    "shard_params",
    "skip_nonfinite",
    "snapshot",
    "train_step",
    "with_precision",
]
