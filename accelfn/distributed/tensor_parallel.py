"""What the CPU (gloo) and CUDA (NCCL) backends share for ``tensor_parallel``: the device mesh
of the whole world, built once from the transforms, and the plan applied through
``torch.distributed.tensor.parallel.parallelize_module``.

The mesh is ``("data", "tensor")`` of shape ``(world_size // size, size)``: the ranks of a
tensor-parallel group are consecutive. ``tensor_parallel`` splits the plan's layers over the
``"tensor"`` dimension; ``shard_params`` then shards every parameter (split or not) over the
``"data"`` dimension with FSDP2 (2-D FSDP x TP, as torchtitan composes them). Accelerate's
``ParallelismConfig(dp_shard_size=d, tp_size=t)`` is ``shard_params()`` with
``tensor_parallel(plan, size=t)`` on ``d * t`` processes.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from accelfn.distributed import fsdp, is_dtensor
from accelfn.transforms import ShardParams, TensorParallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: Hugging Face ``_tp_plan`` style names that have a torch ParallelStyle of the same meaning
HF_STYLES = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise")
#: the attribute of a prepared model that holds the TensorParallel it was split with
_SPLIT_WITH = "_accelfn_tensor_parallel"


def check(tp: TensorParallel, shard: ShardParams | None, world_size: int) -> None:
    """Raises before anything changes if ``tp`` cannot run in a world of ``world_size``.

    Raises:
        ValueError: the world size is not a multiple of ``tp.size``.
        NotImplementedError: ``shard_params(shard_size=...)`` or ``offload=True`` with it.
    """
    tp.data_degree(world_size)
    if shard is not None and (shard.shard_size is not None or shard.offload):
        option = "shard_size" if shard.shard_size is not None else "offload"
        raise NotImplementedError(
            f"shard_params({option}=...) with tensor_parallel() is not supported (3-D HSDP x TP and offloaded "
            "TP shards are not built yet); use shard_params() over the whole data dimension"
        )


def world_mesh(device: torch.device, world_size: int, tp: TensorParallel) -> DeviceMesh:
    """The ``("data", "tensor")`` mesh of the world (a single-process group made first on one process)."""
    fsdp.single_process_group(device)
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (tp.data_degree(world_size), tp.size), mesh_dim_names=("data", "tensor"))


def _style(name: Any, where: str) -> Any:
    """A plan's style (a name or a torch ParallelStyle) as a torch ParallelStyle."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if not isinstance(name, str):
        return name
    styles: dict[str, Callable[[], Any]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence_parallel": SequenceParallel,
              "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
              "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate())}
    if name not in styles:
        raise NotImplementedError(
            f"tensor_parallel(plan='auto'): the model's plan gives {where!r} the style {name!r}, which accelfn "
            f"does not map to a torch ParallelStyle (it maps {', '.join(map(repr, HF_STYLES))}); pass the plan "
            "as a dict of torch ParallelStyles instead"
        )
    return styles[name]()


def resolve(tp: TensorParallel, model: torch.nn.Module) -> dict[str, Any] | None:
    """The plan as ``parallelize_module`` takes it (None for a plan function).

    Raises:
        ValueError: ``"auto"`` for a model without a ``_tp_plan``; a pattern that matches no module.
        NotImplementedError: ``"auto"`` with a style this module does not map.
    """
    if callable(tp.plan):
        return None
    if tp.plan == "auto":
        own = getattr(model, "_tp_plan", None) or getattr(model, "tp_plan", None)
        if not own:
            raise ValueError(
                f"tensor_parallel(plan='auto') takes the model's own tensor-parallel plan (a transformers "
                f"model's _tp_plan), but {type(model).__name__} has none; pass a dict {{module pattern: style}} "
                "or a function (model, mesh) -> None"
            )
        pairs = list(own.items())
    else:
        pairs = list(tp.plan)  # neither a function nor "auto": the pairs
    names = [n for n, _ in model.named_modules() if n]
    for pattern, _ in pairs:
        if not any(_matches(pattern, n) for n in names):
            raise ValueError(
                f"tensor_parallel(plan=...): the pattern {pattern!r} matches no module of {type(model).__name__} "
                f"(its modules include {', '.join(repr(n) for n in names[:8])}); patterns are module names "
                "with '*' for one part, e.g. 'blocks.*.mlp.0'"
            )
    return {pattern: _style(style, pattern) for pattern, style in pairs}


def _matches(pattern: str, name: str) -> bool:
    """``parallelize_module``'s rule: the parts of ``name`` match the ``.``-parts of ``pattern``."""
    parts, want = name.split("."), pattern.split(".")
    return len(parts) == len(want) and all(fnmatch.fnmatch(p, w) for p, w in zip(parts, want))


def split_model(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tp: TensorParallel,
                mesh: DeviceMesh, *, broadcast: bool = True) -> None:
    """Splits ``model`` in place over ``mesh["tensor"]`` and points ``optimizer`` at its parameters.

    Rank 0's parameters and buffers are broadcast first (``broadcast``), so every rank starts
    from the same model whatever its seed (as DDP does).

    Raises:
        ValueError, NotImplementedError: from :func:`resolve`.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    plan = resolve(tp, model)  # before anything changes
    names = {id(p): name for name, p in model.named_parameters()}
    on_meta = any(t.is_meta for t in model.parameters())  # materialized after splitting (_materialize)
    if broadcast and mesh.size() > 1 and not on_meta:
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)
    if plan is None:
        tp.plan(model, mesh["tensor"])  # type: ignore[operator]  # a plan function
    else:  # equal on every rank already: each cuts its own part (no scatter, which meta tensors cannot do)
        parallelize_module(model, mesh["tensor"], plan, src_data_rank=None)
    split = dict(model.named_parameters())
    fsdp.rebind(optimizer, {id_: split[name] for id_, name in names.items()})
    setattr(model, _SPLIT_WITH, tp)


def split_with(model: torch.nn.Module) -> TensorParallel | None:
    """The TensorParallel ``model`` was split with by ``prepare``, or None."""
    return getattr(model, _SPLIT_WITH, None)


def check_same_split(model: torch.nn.Module, now: TensorParallel | None) -> None:
    """Raises if ``model`` was split by ``prepare`` and ``now`` is another split (or none).

    Raises:
        ValueError: naming both.
    """
    before = split_with(model)
    if before is None or before == now:
        return
    raise ValueError(
        f"this state's model was split with {before!r}, and the step has {now!r}; a model is split once: "
        "give the step the tensor_parallel(...) it was prepared with, or build the state again"
    )


def holds_dtensors(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor."""
    return any(is_dtensor(p) for p in model.parameters())
