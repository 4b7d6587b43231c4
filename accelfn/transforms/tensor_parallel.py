"""``tensor_parallel``: Megatron-style tensor parallelism, each layer split over ``size`` ranks.

``size`` is the mesh's ``tensor`` dimension, its innermost (``distributed.mesh``): rank ``r``
of a world of data-parallel groups sits at ``(r // size, r % size)``, so the ranks of one
tensor-parallel group are consecutive (on one node, where the per-layer collectives are
cheapest). Inside a group the layers the plan names are split (``torch.distributed.tensor.parallel.parallelize_module``):
a column-wise linear layer keeps ``out_features / size`` rows of its weight, a row-wise one
``in_features / size`` columns, and one all-reduce per row-wise layer joins the partial
outputs. The ranks of a group compute one model together, so they read the same batch:
``shard_data`` shards over the data dimension only, and the metrics are those of each data
shard. Data parallelism over the data dimension composes: ``shard_params`` shards what the
plan split (FSDP2 on the ``shard`` sub-mesh: 2-D FSDP x TP).

References:
    Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using
    Model Parallelism", 2019. Korthikanti et al., "Reducing Activation Recomputation in
    Large Transformer Models", MLSys 2023 (sequence parallelism).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal, Union

import attrs
import torch

from accelfn.errors import check_int, wrong_type
from accelfn.step import Phase, TransformBase
from accelfn.transforms.replicate import Replicate

#: the styles a plan may name by string (torch's ColwiseParallel, RowwiseParallel, SequenceParallel)
STYLE_NAMES = ("colwise", "rowwise", "sequence_parallel")
#: ``parallelize(model, mesh)``: a model's own function that splits it over a 1-D device mesh
PlanFn = Callable[[torch.nn.Module, Any], None]
Plan = Union[tuple[tuple[str, Any], ...], PlanFn, Literal["auto"]]


def _is_style(value: object) -> bool:
    """A torch ``ParallelStyle`` (told by its ``_apply(module, mesh)``: transforms do not import
    ``torch.distributed``) or one of ``STYLE_NAMES``."""
    return value in STYLE_NAMES if isinstance(value, str) else callable(getattr(value, "_apply", None))


def _to_plan(value: object) -> Plan:
    """A mapping of module-name pattern -> style, a function, or ``"auto"`` -> a Plan value."""
    if value == "auto":
        return "auto"
    if isinstance(value, str):
        raise ValueError(f"tensor_parallel(plan={value!r}): a string plan must be 'auto' (the model's own plan, "
                         "e.g. a transformers model's); otherwise pass a dict {module pattern: style}")
    if isinstance(value, Mapping):
        pairs = tuple((k, v) for k, v in value.items())
        if not pairs:
            raise ValueError("tensor_parallel(plan={}): the plan names no module; map module name patterns "
                             "(fnmatch, e.g. 'blocks.*.mlp.0') to 'colwise', 'rowwise' or 'sequence_parallel'")
        for pattern, style in pairs:
            if not isinstance(pattern, str) or not pattern:
                raise wrong_type("tensor_parallel", "plan", "a dict whose keys are module name patterns (str)",
                                 pattern)
            if not _is_style(style):
                raise ValueError(
                    f"tensor_parallel(plan=...): the style of {pattern!r} is {style!r}; use one of "
                    f"{', '.join(map(repr, STYLE_NAMES))} or a torch.distributed.tensor.parallel ParallelStyle "
                    "(ColwiseParallel(...), RowwiseParallel(...), SequenceParallel(), PrepareModuleInput(...))")
        return pairs
    if callable(value):
        return value  # a (model, mesh) -> None function
    raise wrong_type("tensor_parallel", "plan", "a dict {module pattern: style}, a function (model, mesh) -> None, "
                     "or 'auto'", value)


def _size(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong_type("tensor_parallel", "size", "an int >= 1 (the ranks one layer is split over)", value)
    check_int("tensor_parallel", "size", value, minimum=1)


@attrs.frozen
class TensorParallel(TransformBase):
    """Tensor parallelism: the plan's layers split over groups of ``size`` consecutive ranks.

    See :func:`tensor_parallel`.

    Attributes:
        plan: ``((pattern, style), ...)``, a function ``(model, mesh) -> None``, or ``"auto"``.
        size: the ranks of one tensor-parallel group.
    """

    phase: ClassVar[Phase] = Phase.MODEL
    kind: ClassVar[str] = "tensor_parallel"
    verb: ClassVar[str] = "tensor_parallel"
    couples_ranks: ClassVar[bool] = True

    plan: Plan = attrs.field(converter=_to_plan)
    size: int = attrs.field(validator=_size)

    def conflicts_with(self, other: TransformBase) -> str | None:
        if isinstance(other, Replicate):
            return (
                "replicate() (DDP) does not take a tensor-parallel model's DTensor parameters; for data "
                "parallelism over the data dimension compose shard_params() with tensor_parallel() "
                "(FSDP2 x TP, a 2-D mesh) instead"
            )
        return None


def tensor_parallel(plan: Mapping[str, Any] | PlanFn | Literal["auto"], *, size: int) -> TensorParallel:
    """Tensor parallelism (``torch.distributed.tensor.parallel``) over groups of ``size`` ranks.

    Each rank keeps ``1/size`` of every layer the plan splits; the ranks of one group read
    the same batches and compute one model together (an all-reduce per row-wise layer in the
    forward, per column-wise layer in the backward). With ``world_size > size`` the other
    dimension of the mesh is data parallel: compose ``shard_params()`` (FSDP2 over it, a 2-D
    mesh; with ``shard_size``, 3-D HSDP x TP), and ``shard_data()`` to split the data over it.
    Parameters the plan leaves whole stay plain tensors, equal on the ranks of a group;
    ``clip`` still takes the exact global norm over both kinds.

    Args:
        plan: which modules to split and how: a dict mapping module name patterns
            (``fnmatch``-style, ``*`` within one name part, as ``parallelize_module``:
            ``"blocks.*.mlp.0"``) to a style: ``"colwise"`` (``ColwiseParallel()``: the
            weight's rows split, the output sharded along its last dimension), ``"rowwise"``
            (``RowwiseParallel()``: the columns split, the input sharded along its last
            dimension, the output all-reduced), ``"sequence_parallel"``
            (``SequenceParallel()``: norms and dropout on sequence shards, dim 1), or any
            ``ParallelStyle`` object (e.g. ``ColwiseParallel(use_local_output=False)``, loss
            parallel's ``ColwiseParallel(output_layouts=Shard(-1))``); a function
            ``parallelize(model, mesh) -> None`` that splits the model itself over ``mesh``
            (a 1-D ``DeviceMesh`` of the group, torchtitan's style); or ``"auto"``: a
            transformers model's own plan (``model._tp_plan``; its ``"colwise"``/``"rowwise"``
            entries), refused when the model has none.
        size: the ranks of a tensor-parallel group, >= 1; the world size must be a multiple.

    Returns:
        TensorParallel: the transform.

    Raises:
        TypeError: ``plan`` of another type, or a pattern that is not a string; ``size`` not an int.
        ValueError: an empty plan, a style that is neither a known name nor a ParallelStyle,
            a string plan other than ``"auto"``, ``size`` < 1 (a world size that is not a
            multiple of ``size`` is refused when the program is prepared).

    Example:
        >>> import accelfn as af
        >>> af.tensor_parallel({"mlp.0": "colwise", "mlp.2": "rowwise"}, size=2).plan
        (('mlp.0', 'colwise'), ('mlp.2', 'rowwise'))
    """
    return TensorParallel(plan, size)  # the converter takes a Mapping
