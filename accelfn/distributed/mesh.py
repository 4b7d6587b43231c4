"""The mesh: one record per program of how its transforms lay the world's ranks out.

Every parallelism is a named dimension of one grid of ranks, outermost first::

    pipe       pipeline(size=p): the stages of one pipeline, p positions
    replicate  data parallel copies of the model (replicate(), invariant(), hybrid
               sharding's groups, a DeepSpeed ZeRO-0 engine, or ranks that train alone)
    shard      data parallel ranks that split one copy (shard_params(), DeepSpeed ZeRO 1-3)
    context    context_parallel(size=c): the ranks that split one sequence; their gradients
               are reduced with the data-parallel ranks' (FSDP2 over shard x context)
    tensor     tensor_parallel(size=t): the ranks that split each layer

Rank ``r`` sits at the row-major coordinates of ``r`` in that grid, so the innermost
dimensions hold consecutive ranks (a tensor-parallel group on one node, where its per-layer
collectives are cheapest; a pipeline's stages far apart, as torchtitan lays them out). The
data a rank reads is its place on the data dimensions (``replicate`` x ``shard``): the ranks
of one pipeline, one context group or one tensor-parallel group read the same batches.

``Mesh.of(step, world_size, local_world_size)`` is pure arithmetic (``af.plan`` builds the
mesh of any world size in one process); ``device_mesh`` builds torch's ``DeviceMesh`` of the
dimensions that have more than one rank, once per process, and its sub-meshes are what
FSDP2, tensor parallelism and the pipeline's process groups run over.

Reference: torchtitan's ``ParallelDims`` (``torchtitan/distributed/parallel_dims.py``), whose
order of dimensions this is.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch
import torch.distributed as dist

from accelfn.distributed.agreement import extremes
from accelfn.distributed.context import ProcessContext
from accelfn.step import Step
from accelfn.transforms import Pipeline, ShardParams, TensorParallel
from accelfn.transforms.context_parallel import ContextParallel
from accelfn.transforms.deepspeed import DeepSpeed

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: the dimensions, outermost first
DIMENSIONS = ("pipe", "replicate", "shard", "context", "tensor")
#: the dimensions that data is sharded over
DATA = ("replicate", "shard")


def _size(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ValueError(f"Mesh({attribute.name}={value}): a dimension has at least one rank")


@attrs.frozen
class Mesh:
    """How a program lays ``world_size`` ranks out: the size of each named dimension.

    Attributes:
        pipe, replicate, shard, context, tensor: ranks along each dimension (1: none);
            their product is ``world_size``.
    """

    DIMENSIONS: ClassVar[tuple[str, ...]] = DIMENSIONS

    pipe: int = attrs.field(default=1, validator=_size)
    replicate: int = attrs.field(default=1, validator=_size)
    shard: int = attrs.field(default=1, validator=_size)
    context: int = attrs.field(default=1, validator=_size)
    tensor: int = attrs.field(default=1, validator=_size)

    @classmethod
    def of(cls, step: Step, world_size: int, local_world_size: int | None = None) -> Mesh:
        """The mesh ``step``'s transforms make of a world of ``world_size`` processes
        (``local_world_size`` per node: ``shard_params(shard_size="node")``'s group).

        Raises:
            ValueError: the world size is not a multiple of the ranks one copy of the model
                spans (``tensor_parallel``'s size times ``pipeline``'s), or the data-parallel
                ranks not a multiple of ``shard_params(shard_size=...)``; the message names
                the transforms.
        """
        tp, pp, cp = step.find(TensorParallel), step.find(Pipeline), step.find(ContextParallel)
        tensor, pipe, context = (tp.size if tp else 1), (pp.size if pp else 1), (cp.size if cp else 1)
        model = tensor * pipe * context
        if world_size % model:
            named = " x ".join(f"{t.verb}(size={t.size})" for t in (pp, cp, tp) if t is not None)
            raise ValueError(
                f"{named}: one copy of the model spans {model} ranks, and the world of {world_size} processes "
                f"cannot be split into such groups; launch a multiple of {model} processes, or choose sizes whose "
                f"product divides {world_size}")
        data = world_size // model
        shard = step.find(ShardParams)
        if step.find(DeepSpeed) is not None:  # ZeRO partitions over every data-parallel rank
            return cls(pipe=pipe, shard=data, tensor=tensor)
        if shard is None or data == 1:
            return cls(pipe=pipe, replicate=data, context=context, tensor=tensor)
        local = world_size if local_world_size is None else local_world_size
        degree = shard.shard_degree(data, min(local, data))
        return cls(pipe=pipe, replicate=data // degree, shard=degree, context=context, tensor=tensor)

    # -- sizes and coordinates -------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """The number of ranks: the product of the dimensions' sizes."""
        return math.prod(self.sizes())

    def sizes(self, *names: str) -> tuple[int, ...]:
        """The sizes of the dimensions ``names`` (all of them, outermost first, when none)."""
        return tuple(getattr(self, name) for name in (names or DIMENSIONS))

    @property
    def data_size(self) -> int:
        """The number of data shards: the ranks along ``replicate`` x ``shard``."""
        return self.replicate * self.shard

    @property
    def fsdp_size(self) -> int:
        """The ranks FSDP2 shards one copy of the model over: ``shard`` x ``context`` (the
        context ranks' gradients are reduce-scattered with the shard ranks', as torchtitan folds
        them)."""
        return self.shard * self.context

    @property
    def replicas(self) -> int:
        """The ranks DDP averages the gradients over under ``replicate()``: ``replicate`` x
        ``context`` (the context ranks' gradients are summed with the replicas')."""
        return self.replicate * self.context

    def fsdp_place(self, rank: int) -> int:
        """``rank``'s place along FSDP2's sharded dimension, ``shard`` x ``context`` (row-major,
        as torch flattens them: ``fsdp_mesh``), of ``fsdp_size``."""
        place = self.coordinates(rank)
        return place["shard"] * self.context + place["context"]

    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s place along each dimension (row-major: the last dimension varies fastest).

        Raises:
            ValueError: ``rank`` is not in ``[0, world_size)``.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a mesh of {self.world_size} ranks")
        place: dict[str, int] = {}
        for name in reversed(DIMENSIONS):
            rank, place[name] = divmod(rank, getattr(self, name))
        return {name: place[name] for name in DIMENSIONS}

    def data_coordinates(self, rank: int) -> tuple[int, int]:
        """``(data rank, data world size)``: the data shard ``rank`` reads and how many there are
        (the ranks of one pipeline, one tensor-parallel group, read the same one)."""
        place = self.coordinates(rank)
        return place["replicate"] * self.shard + place["shard"], self.data_size

    def leads(self, rank: int) -> bool:
        """Whether ``rank`` reports for its data shard: the first rank of its pipeline, its
        context group and its tensor-parallel group (every rank of a data-parallel-only mesh)."""
        place = self.coordinates(rank)
        return all(place[name] == 0 for name in DIMENSIONS if name not in DATA)

    def ranks_along(self, name: str, rank: int) -> tuple[int, ...]:
        """The ranks that share every coordinate of ``rank`` but ``name``'s, in order along it."""
        index = DIMENSIONS.index(name)
        stride = math.prod(self.sizes(*DIMENSIONS[index + 1:]))
        first = rank - self.coordinates(rank)[name] * stride
        return tuple(first + i * stride for i in range(getattr(self, name)))

    def __str__(self) -> str:
        shown = [f"{name}={size}" for name, size in zip(DIMENSIONS, self.sizes()) if size > 1]
        return f"Mesh({', '.join(shown) or 'one rank'})"

    # -- torch's DeviceMesh ------------------------------------------------------------------

    def device_mesh(self, device: torch.device, *names: str) -> DeviceMesh | None:
        """torch's ``DeviceMesh`` of the dimensions ``names`` of more than one rank (all of
        them when none are named), or None when none of them has more than one rank.

        The whole mesh is built once per process and program shape (its process groups made
        on every rank together), and the named dimensions are sliced from it.
        """
        wanted = tuple(n for n in (names or DIMENSIONS) if getattr(self, n) > 1)
        if not wanted:
            return None
        whole = _whole(device.type, self)
        if wanted == whole.mesh_dim_names:
            return whole
        return whole[wanted] if len(wanted) > 1 else whole[wanted[0]]

    def fsdp_mesh(self, device: torch.device) -> DeviceMesh | None:
        """torch's ``DeviceMesh`` FSDP2 shards over: ``("replicate", "shard")`` with ``context``
        folded into ``shard`` (flattened to one dimension named ``"shard_context"`` when both have
        several ranks), as torchtitan's ``dp_shard_cp``; None when no data dimension has more
        than one rank."""
        folded = tuple(n for n in ("shard", "context") if getattr(self, n) > 1)
        if len(folded) < 2:
            return self.device_mesh(device, "replicate", "shard", "context")
        whole = _whole(device.type, self)
        # torch's own fold (torchtitan's dp_shard_cp), made once and kept by the root mesh
        flat = whole[folded]._flatten("shard_context")  # noqa: SLF001
        # hybrid sharding needs it beside "replicate": sliced from the root mesh, the one way torch 2.13 has
        return whole["replicate", "shard_context"] if self.replicate > 1 else flat

    def group(self, device: torch.device, name: str) -> Any:
        """The process group of this rank along dimension ``name``, or None (one rank)."""
        sub = self.device_mesh(device, name)
        return None if sub is None else sub.get_group()


#: the DeviceMesh of each (device type, mesh), made once per process and default group
_built: dict[tuple[str, Mesh, int], DeviceMesh] = {}


def _whole(device_type: str, mesh: Mesh) -> DeviceMesh:
    from torch.distributed.device_mesh import init_device_mesh

    key = (device_type, mesh, id(dist.distributed_c10d._get_default_group()))  # noqa: SLF001  # a new world, new groups
    if key not in _built:
        names = tuple(n for n in DIMENSIONS if getattr(mesh, n) > 1)
        _built[key] = init_device_mesh(device_type, mesh.sizes(*names), mesh_dim_names=names)
    return _built[key]


def agreed(step: Step, context: ProcessContext) -> Mesh:
    """The mesh of ``step`` in this process's world, the same on every rank.

    Only ``shard_params(shard_size="node")`` reads something that may differ across ranks
    (each node's ``LOCAL_WORLD_SIZE``): nodes running other numbers of processes would build
    other meshes and wait for each other forever, so the ranks first agree on it (one
    all-reduce of two numbers) and all fail alike where they do not.

    Raises:
        ValueError: as :meth:`Mesh.of`, on every rank; or, under ``shard_size="node"``, the
            ranks' node sizes differ (the message names this rank's).
    """
    shard = step.find(ShardParams)
    if shard is None or shard.shard_size != "node" or context.world_size == 1:
        return Mesh.of(step, context.world_size, context.local_world_size)
    (lowest,), (highest,) = extremes([context.local_world_size], device=context.collective_device)
    if lowest != highest:
        raise ValueError(
            f"shard_params(shard_size='node'): the nodes run from {lowest} to {highest} processes (this rank, "
            f"{context.rank}, has LOCAL_WORLD_SIZE={context.local_world_size}), so the ranks would split the world "
            "into groups of different sizes; start the same number of processes on every node, or give shard_size "
            "as a number that divides the world size")
    return Mesh.of(step, context.world_size, context.local_world_size)
