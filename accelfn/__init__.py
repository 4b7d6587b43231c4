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
from accelfn.cli.launcher import launch
from accelfn.errors import CheckpointError, LaunchError, NonFiniteError, TransformError
from accelfn.evaluate import evaluate
from accelfn.loop import (
    Hook,
    Profile,
    Stop,
    UpdateCount,
    count_updates,
    find_batch_size,
    run,
)
from accelfn.loop import Plan, plan
from accelfn.errors import PlanError, PlanWarning
from accelfn.seed import set_seed
from accelfn.state import Stopped, TrainState
from accelfn.step import Loss, Step, train_step
from accelfn.tracking import JSONL, Comet, ConfigTracker, MLflow, TensorBoard, Tracker, WandB
from accelfn.tracking import RayTrain
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
from accelfn.transforms import TensorParallel, tensor_parallel
from accelfn.transforms import Pipeline, pipeline
from accelfn.checkpoint import load_model
from accelfn.transforms import Invariant, invariant
from accelfn.transforms.deepspeed import DeepSpeed, deepspeed

__all__ = [
    "JSONL",
    "Accumulate",
    "CheckpointError",
    "Checkpoints",
    "Clip",
    "ClipValue",
    "Comet",
    "Compile",
    "ConfigTracker",
    "Hook",
    "LaunchError",
    "Loss",
    "MLflow",
    "NonFiniteError",
    "Profile",
    "RayTrain",
    "Replicate",
    "ShardData",
    "ShardParams",
    "SkipNonfinite",
    "Snapshot",
    "Step",
    "Stop",
    "Stopped",
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
    "compile",
    "compose",
    "count_updates",
    "evaluate",
    "find_batch_size",
    "launch",
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
    "TensorParallel",
    "tensor_parallel",
    "Pipeline",
    "pipeline",
    "load_model",
    "Invariant",
    "invariant",
    "Plan",
    "PlanError",
    "PlanWarning",
    "plan",
    "DeepSpeed",
    "deepspeed",
]
