"""accelfn: train PyTorch models anywhere with composable, functional transforms."""

from accelfn import backends
from accelfn._version import __version__
from accelfn.checkpoint import (
    Checkpoints,
    Snapshot,
    load,
    restore,
    save,
    save_model,
    snapshot,
)
from accelfn.errors import CheckpointError, LaunchError, NonFiniteError, TransformError
from accelfn.evaluate import evaluate
from accelfn.loop import find_batch_size, run
from accelfn.seed import set_seed
from accelfn.state import TrainState
from accelfn.step import Loss, Step, train_step
from accelfn.tracking import JSONL, TensorBoard, Tracker
from accelfn.transforms import (
    Accumulate,
    Clip,
    ClipValue,
    Compile,
    Replicate,
    ShardData,
    ShardParams,
    SkipNonfinite,
    Transform,
    WithPrecision,
    accumulate,
    clip,
    clip_value,
    compile,
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
    "Compile",
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
    "compile",
    "compose",
    "evaluate",
    "find_batch_size",
    "load",
    "replicate",
    "restore",
    "run",
    "save",
    "save_model",
    "set_seed",
    "shard_data",
    "shard_params",
    "skip_nonfinite",
    "snapshot",
    "train_step",
    "with_precision",
]
