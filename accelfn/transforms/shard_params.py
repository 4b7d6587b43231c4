"""``shard_params``: fully sharded data parallel (ZeRO-3), each rank holding 1/W of the model.

Parameters, gradients and optimizer state are split over the ranks; before a unit's
forward (and again for its backward) its parameters are all-gathered, and its gradients
are reduce-scattered (averaged) after its backward. On CPU and CUDA this is FSDP2
(``torch.distributed.fsdp.fully_shard``), applied to each selected submodule (a *unit*:
the granularity of one all-gather) and then to the root module.

References:
    Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
    Models", SC 2020. Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded
    Data Parallel", VLDB 2023.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Literal, Union

import attrs
import torch

from accelfn.errors import boolean, check_int, wrong_type
from accelfn.step import Phase, TransformBase
from accelfn.transforms.replicate import Replicate

#: ``(qualified name, module) -> bool``: whether the submodule becomes its own unit
UnitPredicate = Callable[[str, torch.nn.Module], bool]
Units = Union[frozenset[type[torch.nn.Module]], UnitPredicate, None]


def _to_units(value: object) -> Units:
    """``None``, a module class, an iterable of module classes, or a predicate -> a Units value."""
    if value is None:
        return None
    if isinstance(value, type):
        value = (value,)
    elif callable(value):
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(
            f"shard_params(units=...) takes None (each block of a repeated nn.ModuleList), "
            f"a set of nn.Module classes, or a predicate (name, module) -> bool; got {value!r}"
        )
    classes = frozenset(value)
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, torch.nn.Module))]
    if bad or not classes:
        raise TypeError(
            f"shard_params(units=...) as a set must hold nn.Module subclasses (at least one), "
            f"got {sorted(map(repr, bad)) or 'an empty set'}"
        )
    return classes


def _shard_size(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    if value is None or value == "node":
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong_type("shard_params", "shard_size", 'an int, "node" or None', value)
    check_int("shard_params", "shard_size", value, minimum=1)


def repeated_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The blocks of every ``nn.ModuleList`` of two or more modules of one class, outermost
    lists first (a list inside a selected block is not searched)."""
    found: list[tuple[str, torch.nn.Module]] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in inside):
            continue
        children = list(module.named_children()) if isinstance(module, torch.nn.ModuleList) else []
        if len(children) >= 2 and len({type(c) for _, c in children}) == 1:
            for child_name, child in children:
                full = f"{name}.{child_name}" if name else child_name
                found.append((full, child))
                inside.append(full + ".")
    return found


@attrs.frozen
class ShardParams(TransformBase):
    """Fully sharded data parallel: parameters, gradients and optimizer state split over ranks.

    See :func:`shard_params`. On one process there is nothing to shard, and the model trains
    unsharded (except with ``offload=True``, which needs FSDP even on one GPU).

    Attributes:
        units: which submodules become FSDP units (see :func:`shard_params`).
        reshard_after_forward: free the gathered parameters after each unit's forward and
            gather them again for its backward (ZeRO-3; the root unit, gathered for the whole
            forward and the first to run backward, keeps its own, as FSDP2 does by default);
            ``False`` keeps them (ZeRO-2-like: less communication, the whole unsharded model
            held between forward and backward).
        offload: keep the sharded parameters, gradients and optimizer state in CPU memory
            (``CPUOffloadPolicy``; CUDA only); the optimizer step runs on the CPU.
        reduce_every_micro_batch: under ``accumulate(n)``, reduce-scatter the gradients of
            every micro-batch and accumulate sharded gradients (memory 1/W, n reduce-scatters
            per update) instead of accumulating unsharded gradients locally and reducing once.
        shard_size: the number of ranks each copy of the model is sharded over (None: all of
            them; ``"node"``: the processes of one node, ``LOCAL_WORLD_SIZE``); the world is
            split into groups of that many consecutive ranks, replicated across groups.
    """

    phase: ClassVar[Phase] = Phase.MODEL
    kind: ClassVar[str] = "shard_params"
    verb: ClassVar[str] = "shard_params"
    couples_ranks: ClassVar[bool] = True

    units: Units = attrs.field(default=None, converter=_to_units)
    reshard_after_forward: bool = attrs.field(default=True, validator=boolean)
    offload: bool = attrs.field(default=False, validator=boolean)
    reduce_every_micro_batch: bool = attrs.field(default=False, validator=boolean)
    shard_size: int | Literal["node"] | None = attrs.field(default=None, validator=_shard_size)

    def shard_degree(self, world_size: int, local_world_size: int) -> int:
        """The number of ranks a copy of the model is sharded over in a world of ``world_size``
        processes, ``local_world_size`` per node.

        Raises:
            ValueError: ``world_size`` is not a multiple of it.
        """
        if world_size == 1:  # nothing is sharded on one process
            return 1
        size = (world_size if self.shard_size is None else local_world_size if self.shard_size == "node"
                else self.shard_size)
        if world_size % size:
            asked = "LOCAL_WORLD_SIZE" if self.shard_size == "node" else "it"
            raise ValueError(f"shard_params(shard_size={self.shard_size!r}): the world of {world_size} processes "
                             f"cannot be split into groups of {size} ranks; make the world size a multiple "
                             f"of {asked}, or leave shard_size out to shard over all ranks")
        return size

    def select(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
        """The submodules that become units, innermost first (the order ``fully_shard`` needs);
        the root is not among them (it is always sharded last, holding what is left).

        Args:
            model: the root module.

        Returns:
            ``(qualified name, module)`` pairs, every unit after all of its descendants.
        """
        chosen: list[tuple[str, torch.nn.Module]]
        if self.units is None:
            chosen = repeated_blocks(model)
        elif isinstance(self.units, frozenset):
            classes: tuple[type[torch.nn.Module], ...] = tuple(self.units)
            chosen = [(n, m) for n, m in model.named_modules() if n and isinstance(m, classes)]
        else:
            predicate = self.units
            chosen = [(n, m) for n, m in model.named_modules() if n and predicate(n, m)]
        return chosen[::-1]  # named_modules is pre-order: reversed, descendants come first

    def conflicts_with(self, other: TransformBase) -> str | None:
        if isinstance(other, Replicate):
            return (
                "shard_params() is already data parallel over the same processes: it keeps 1/W "
                "of the parameters on each rank and reduce-scatters gradients, where replicate() "
                "keeps a full copy and all-reduces them; a model cannot be both. Remove replicate()"
            )
        return None


def shard_params(
    *,
    units: type[torch.nn.Module] | Iterable[type[torch.nn.Module]] | UnitPredicate | None = None,
    reshard_after_forward: bool = True,
    offload: bool = False,
    reduce_every_micro_batch: bool = False,
    shard_size: int | Literal["node"] | None = None,
) -> ShardParams:
    """Fully sharded data parallel (ZeRO-3, FSDP2's ``fully_shard``) over all processes.

    Each rank keeps 1/W of every parameter, gradient and optimizer state (W: world size);
    a unit's parameters are all-gathered before its forward and backward and freed after,
    and gradients are reduce-scattered (averaged over ranks, as ``replicate()``'s
    all-reduce does). The optimizer in the TrainState is kept: its parameter groups are
    pointed at the sharded parameters, and any state it has is sharded the same way.

    Args:
        units: which submodules become units, each gathered as a whole: ``None`` (each
            block of every ``nn.ModuleList`` of two or more modules of one class, e.g. a
            transformer's layers; a model without one is a single unit), a module class or
            set of classes, or a predicate ``(qualified name, module) -> bool``. The root
            module is always a unit too and holds every parameter not in another unit.
        reshard_after_forward: ``True`` (ZeRO-3) frees gathered parameters after the
            forward (except the root unit's, needed first by the backward: FSDP2's default);
            ``False`` keeps them until the backward (more memory, fewer all-gathers).
        offload: keep sharded parameters, gradients and optimizer state in CPU memory
            (CUDA only).
        reduce_every_micro_batch: under ``accumulate(n)``, reduce-scatter after every
            micro-batch (sharded accumulation: less memory, n times the communication).
        shard_size: hybrid sharding (HSDP, Accelerate's ``HYBRID_SHARD``): each copy of the
            model is sharded over groups of ``shard_size`` consecutive ranks and replicated
            across the groups, as a 2-D device mesh ``(replicate, shard)`` of FSDP2: gradients
            are reduce-scattered within a group, then all-reduced across groups. ``"node"``
            shards within each node (``LOCAL_WORLD_SIZE`` ranks), so the large collectives
            stay on the node's fast links; ``None`` (default) shards over all ranks. Each rank
            then holds 1/shard_size of the model. The world size must be a multiple of it.

    Returns:
        ShardParams: the transform.

    Raises:
        TypeError: ``units`` is not None, a module class, an iterable of module classes or a
            callable; a flag that is not a bool; ``shard_size`` not an int, ``"node"`` or None.
        ValueError: ``shard_size`` below 1 (a world size that is not a multiple of it is
            refused when the program is prepared).

    Example:
        >>> import accelfn as af
        >>> af.shard_params(reshard_after_forward=False)
        ShardParams(units=None, reshard_after_forward=False, offload=False, reduce_every_micro_batch=False, shard_size=None)
    """
    return ShardParams(units, reshard_after_forward, offload, reduce_every_micro_batch, shard_size)
