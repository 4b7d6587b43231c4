"""accelfn: train PyTorch models anywhere with composable, functional transforms."""

# the program and its state
from accelfn.state import Stopped, TrainState
from accelfn.step import Loss, OutputLoss, Step, output_loss, train_step

# transforms: each a frozen record and the verb that builds it
from accelfn.transforms import (
    Accumulate,
    CheckpointActivations,
    Clip,
    ClipValue,
    Compile,
    ContextParallel,
    Invariant,
    Pipeline,
    Replicate,
    ShardData,
    ShardParams,
    SkipNonfinite,
    TensorParallel,
    Transform,
    WithPrecision,
    accumulate,
    checkpoint_activations,
    clip,
    clip_value,
    compile,
    compose,
    context_parallel,
    invariant,
    pipeline,
    replicate,
    shard_data,
    shard_params,
    skip_nonfinite,
    tensor_parallel,
    with_precision,
)
from accelfn.transforms.deepspeed import DeepSpeed, deepspeed

# running a program: backends, the loop, evaluation, the plan
from accelfn import backends
from accelfn.evaluate import evaluate
from accelfn.loop import Hook, Plan, Profile, Stop, UpdateCount, count_updates, find_batch_size, plan, run
from accelfn.cli.launcher import launch

# checkpoints
from accelfn.checkpoint import Checkpoints, Snapshot, load, load_model, restore, save, save_model, snapshot

# tracking
from accelfn.tracking import JSONL, Comet, ConfigTracker, MLflow, RayTrain, TensorBoard, Tracker, WandB

# errors, seeds, version
from accelfn.errors import CheckpointError, LaunchError, NonFiniteError, PlanError, PlanWarning, TransformError
from accelfn.seed import set_seed
from accelfn._version import __version__

__all__ = [
    "JSONL",
    "Accumulate",
    "CheckpointActivations",
    "CheckpointError",
    "Checkpoints",
    "Clip",
    "ClipValue",
    "Comet",
    "Compile",
    "ConfigTracker",
    "ContextParallel",
    "DeepSpeed",
    "Hook",
    "Invariant",
    "LaunchError",
    "Loss",
    "MLflow",
    "NonFiniteError",
    "OutputLoss",
    "Pipeline",
    "Plan",
    "PlanError",
    "PlanWarning",
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
    "TensorParallel",
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
    "checkpoint_activations",
    "clip",
    "clip_value",
    "compile",
    "compose",
    "context_parallel",
    "count_updates",
    "deepspeed",
    "evaluate",
    "find_batch_size",
    "invariant",
    "launch",
    "load",
    "load_model",
    "output_loss",
    "pipeline",
    "plan",
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
    "tensor_parallel",
    "train_step",
    "with_precision",
]
