"""The closed set of transforms, and ``compose``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Union

import toolz

from accelfn.step import TransformBase
from accelfn.transforms.accumulate import Accumulate
from accelfn.transforms.checkpoint_activations import CheckpointActivations
from accelfn.transforms.clip import Clip, ClipValue
from accelfn.transforms.compile import Compile
from accelfn.transforms.context_parallel import ContextParallel
from accelfn.transforms.data import ShardData
from accelfn.transforms.deepspeed import DeepSpeed
from accelfn.transforms.invariant import Invariant
from accelfn.transforms.pipeline import Pipeline
from accelfn.transforms.precision import WithPrecision
from accelfn.transforms.replicate import Replicate
from accelfn.transforms.shard_params import ShardParams
from accelfn.transforms.skip_nonfinite import SkipNonfinite
from accelfn.transforms.tensor_parallel import TensorParallel

if TYPE_CHECKING:
    from accelfn.step import Step

Transform = Union[ShardData, Replicate, ShardParams, Compile, WithPrecision, Accumulate, Clip, ClipValue,
                  SkipNonfinite, TensorParallel, ContextParallel, Pipeline, Invariant, DeepSpeed,
                  CheckpointActivations]
TRANSFORM_TYPES: tuple[type[TransformBase], ...] = (
    ShardData, Replicate, ShardParams, Compile, WithPrecision, Accumulate, Clip, ClipValue, SkipNonfinite,
    TensorParallel, ContextParallel, Pipeline, Invariant, DeepSpeed, CheckpointActivations,
)
_VERB_NAMES = frozenset(t.verb for t in TRANSFORM_TYPES)


def compose(*transforms: Transform) -> Callable[[Step], Step]:
    """Composes transforms into one ``Step -> Step`` function (``toolz.compose``).

    The order of the arguments does not matter: every transform acts at its own phase.

    Raises:
        TypeError: an argument that is not a transform (a common slip: ``af.clip`` instead
            of ``af.clip(1.0)``).

    Example:
        >>> import accelfn as af
        >>> step = af.compose(af.accumulate(2), af.clip(1.0))(af.train_step(lambda m, b: m(b).sum()))
        >>> [type(t).__name__ for t in step.transforms]
        ['Accumulate', 'Clip']
    """
    for t in transforms:
        if not isinstance(t, TRANSFORM_TYPES):
            verb = getattr(t, "__name__", None)
            hint = f" (call it: af.{verb}(...), not af.{verb})" if verb in _VERB_NAMES else ""
            raise TypeError(f"compose() takes transforms such as af.clip(1.0), got {t!r}{hint}")
    return toolz.compose(*transforms)
