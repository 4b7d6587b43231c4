"""How a program's parallelisms lay a model over the ranks of its mesh, read from the rules
the run applies (``af.plan``'s bytes and collectives count from it).

Rank ``r`` sits at ``Mesh.coordinates(r)`` (``distributed.mesh``). Of each parameter of
``d`` elements along a dimension it keeps:

- ``pipeline``: nothing unless one of its stages uses the parameter (the model traced and cut
  by ``distributed.pipeline.cut``, the stages of pipe position ``p`` by ``stage_indices``,
  kept as ``distributed.pipeline.held`` keeps them: the unused ones with stage 0), buffers alike;
- ``tensor_parallel``: the ``t``-th of ``tensor`` chunks along the dimension its layer's
  style splits (``distributed.tensor_parallel.layer_splits``: column-wise ``Shard(0)``,
  row-wise ``Shard(1)``, as ``torch.chunk`` cuts, so ranks differ where ``tensor`` does not
  divide ``d``);
- ``shard_params``: of that, the ``s``-th of ``shard`` chunks along dim 0 (FSDP2's
  ``Shard(0)`` of the local tensor, over the mesh's shard dimension: 2-D FSDP x TP; with
  ``context_parallel``, over shard x context, ``Mesh.fsdp_place`` of ``Mesh.fsdp_size``).

DeepSpeed's partitions are DeepSpeed's own rule (``distributed.deepspeed.zero_partition``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs
import torch

from accelfn.distributed import pipeline as pipeline_rules
from accelfn.distributed.mesh import Mesh
from accelfn.distributed.tensor_parallel import LayerSplit, layer_splits
from accelfn.step import Step
from accelfn.transforms import Pipeline, ShardParams, TensorParallel


def chunk_shape(shape: tuple[int, ...], dim: int, index: int, parts: int) -> tuple[int, ...]:
    """The shape of the ``index``-th of ``parts`` chunks of ``shape`` along ``dim``."""
    if parts == 1 or len(shape) == 0:
        return tuple(shape)
    chunk = -(-shape[dim] // parts)
    rows = max(0, min(chunk, shape[dim] - index * chunk))
    return (*shape[:dim], rows, *shape[dim + 1:])


@attrs.frozen(eq=False)
class ModelSplit:
    """Where each parameter and buffer of a model lives on the ranks of ``mesh``.

    Attributes:
        mesh: the program's mesh.
        stages: under ``pipeline``, the model cut into its stages (``distributed.pipeline.cut``).
        held: under ``pipeline``, the ids of the tensors each pipe position keeps.
        tensor_dims: under ``tensor_parallel``, each split parameter's id and its split dimension.
        layers: the layers the tensor-parallel plan splits (their styles' collectives).
        sharded: ``shard_params`` shards the (tensor-local) parameters over the shard dimension.
        unknown: what of the program no rule here says (named, for a ``not-planned`` warning).
    """

    mesh: Mesh
    stages: tuple[torch.fx.GraphModule, ...] = ()
    held: dict[int, frozenset[int]] = attrs.Factory(dict)
    tensor_dims: dict[int, int] = attrs.Factory(dict)
    layers: tuple[LayerSplit, ...] = ()
    sharded: bool = False
    unknown: tuple[str, ...] = ()

    def holds(self, tensor: torch.Tensor, rank: int) -> bool:
        """Whether ``rank`` keeps ``tensor`` (a parameter or buffer) at all."""
        if not self.held:
            return True
        return id(tensor) in self.held[self.mesh.coordinates(rank)["pipe"]]

    def local_shape(self, param: torch.Tensor, rank: int) -> tuple[int, ...] | None:
        """The shape of ``rank``'s piece of ``param`` (None: the rank does not keep it)."""
        if not self.holds(param, rank):
            return None
        place = self.mesh.coordinates(rank)
        shape = tuple(param.shape)
        dim = self.tensor_dims.get(id(param))
        if dim is not None:
            shape = chunk_shape(shape, dim, place["tensor"], self.mesh.tensor)
        if self.sharded:
            shape = chunk_shape(shape, 0, self.mesh.fsdp_place(rank), self.mesh.fsdp_size)
        return shape

    def numel(self, param: torch.Tensor, rank: int) -> int:
        """Elements of ``rank``'s piece of ``param`` (0 where it keeps none)."""
        shape = self.local_shape(param, rank)
        return 0 if shape is None else math.prod(shape)

    def key(self, rank: int) -> tuple[int, ...]:
        """Ranks with the same key hold the same pieces (their place on pipe, tensor, shard)."""
        place = self.mesh.coordinates(rank)
        return place["pipe"], place["tensor"], self.mesh.fsdp_place(rank) if self.sharded else 0


def model_split(step: Step, model: torch.nn.Module, mesh: Mesh) -> ModelSplit:
    """The split ``step``'s parallelisms make of ``model`` on ``mesh``, by the run's rules.

    Raises:
        ValueError: the model cannot be cut at the pipeline's split points, or a
            tensor-parallel pattern matches no module (the run's own errors).
        NotImplementedError: ``tensor_parallel(plan="auto")`` with a style it does not map.
    """
    pp, tp, shard = step.find(Pipeline), step.find(TensorParallel), step.find(ShardParams)
    stages: tuple[torch.fx.GraphModule, ...] = ()
    held: dict[int, frozenset[int]] = {}
    if pp is not None:
        stages = tuple(pipeline_rules.cut(model, pp))
        held = {position: frozenset(pipeline_rules.held(model, list(stages),
                                                        pipeline_rules.stage_indices(pp, position)))
                for position in range(pp.size)}
    tensor_dims: dict[int, int] = {}
    layers: list[LayerSplit] = []
    unknown: list[str] = []
    if tp is not None:
        layers, unknown = layer_splits(tp, model)
        modules = dict(model.named_modules())
        for layer in layers:
            params = dict(modules[layer.module].named_parameters())
            tensor_dims.update((id(params[name]), dim) for name, dim in layer.dims if name in params)
    sharded = shard is not None and mesh.fsdp_size > 1
    return ModelSplit(mesh, stages, held, tensor_dims, tuple(layers), sharded, tuple(unknown))


def split_of(step: Step, model: torch.nn.Module, mesh: Mesh) -> tuple[ModelSplit, str | None]:
    """:func:`model_split`, or the mesh alone and the run's error where the model cannot be split."""
    try:
        return model_split(step, model, mesh), None
    except (ValueError, NotImplementedError) as e:
        return ModelSplit(mesh), str(e)


def whole(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """Distinct parameters of an iterable, in order (tied parameters once)."""
    return list(dict.fromkeys(params))
