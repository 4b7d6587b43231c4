"""Transforms: small frozen values that are also functions ``Step -> Step``.

Each transform acts at a fixed phase of the step, so the order in which they are composed
never changes the meaning of the program; ``Step.transforms`` lists them in phase order::

    data      shard_data      each process reads its own shard of every epoch
    model     replicate       data parallel: one gradient all-reduce per update
              shard_params    fully sharded data parallel (FSDP2): 1/W of the state per rank
              tensor_parallel  layers split over groups of ranks (TP; with shard_params: 2-D)
              context_parallel  each sequence split over groups of ranks (CP; attention as a ring)
              pipeline        the model cut into stages over ranks (PP; with replicate: PP x DP)
              invariant       the same bits on any number of processes (canonical sum tree)
              tolerate_faults  replica groups that die and come back per update (torchft)
              checkpoint_activations  blocks' activations recomputed in the backward
    forward   with_precision  autocast / low-precision parameters, loss scaling
    backward  accumulate      n micro-batches per optimizer update
    gradient  clip, clip_value  after unscaling and after the all-reduce
    update    skip_nonfinite  skip updates whose gradients are not finite
    model     deepspeed       a DeepSpeed engine (ZeRO 0-3, offload) from the user's config

One module per transform holds its record, its verb and the state record it keeps in
``TrainState.transforms_state`` (the loss scale, the accumulation window, the skip count).
Transforms never import ``torch.distributed``, ``torch_xla`` or ``accelfn.backends``: the
backend interprets them.
"""

from accelfn.transforms.accumulate import Accumulate, Window, accumulate
from accelfn.transforms.checkpoint_activations import CheckpointActivations, checkpoint_activations
from accelfn.transforms.clip import Clip, ClipValue, clip, clip_value
from accelfn.transforms.compile import Compile, compile
from accelfn.transforms.compose import TRANSFORM_TYPES, Transform, compose
from accelfn.transforms.context_parallel import ContextParallel, context_parallel
from accelfn.transforms.data import ShardData, shard_data
from accelfn.transforms.deepspeed import DeepSpeed, deepspeed
from accelfn.transforms.invariant import Invariant, Layout, Node, TreeWindow, invariant
from accelfn.transforms.invariant import per_world as invariant_per_world
from accelfn.transforms.pipeline import SCHEDULES, Pipeline, pipeline
from accelfn.transforms.precision import (
    POLICY_NAMES,
    DynamicScaling,
    LossScale,
    Policy,
    SkipCount,
    WithPrecision,
    parse_policy,
    with_precision,
)
from accelfn.transforms.replicate import PowerSGDMemory, Replicate, replicate
from accelfn.transforms.shard_params import ShardParams, shard_params
from accelfn.transforms.skip_nonfinite import SkipNonfinite, skip_nonfinite
from accelfn.transforms.tensor_parallel import TensorParallel, tensor_parallel
from accelfn.transforms.tolerate_faults import TolerateFaults, tolerate_faults

__all__ = [
    "POLICY_NAMES",
    "TRANSFORM_TYPES",
    "Accumulate",
    "Clip",
    "ClipValue",
    "Compile",
    "DynamicScaling",
    "LossScale",
    "Policy",
    "PowerSGDMemory",
    "Replicate",
    "ShardData",
    "ShardParams",
    "SkipCount",
    "SkipNonfinite",
    "Transform",
    "Window",
    "WithPrecision",
    "accumulate",
    "clip",
    "clip_value",
    "compile",
    "compose",
    "parse_policy",
    "replicate",
    "shard_data",
    "shard_params",
    "skip_nonfinite",
    "with_precision",
    "TensorParallel",
    "tensor_parallel",
    "ContextParallel",
    "context_parallel",
    "SCHEDULES",
    "Pipeline",
    "pipeline",
    "Invariant",
    "Layout",
    "Node",
    "TreeWindow",
    "invariant",
    "invariant_per_world",
    "DeepSpeed",
    "deepspeed",
    "TolerateFaults",
    "tolerate_faults",
    "CheckpointActivations",
    "checkpoint_activations",
]
