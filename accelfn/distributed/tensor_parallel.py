"""What ``tensor_parallel`` does to a model: the plan applied through
``torch.distributed.tensor.parallel.parallelize_module`` over the mesh's ``"tensor"``
dimension (its ranks are consecutive: ``distributed.mesh``), as the ``Split`` model phase.

``shard_params`` then shards every parameter (split or not) over the data dimension with FSDP2
(2-D FSDP x TP, as torchtitan composes them: ``distributed.fsdp.Shard``, the next phase). Accelerate's
``ParallelismConfig(dp_shard_size=d, tp_size=t)`` is ``shard_params()`` with
``tensor_parallel(plan, size=t)`` on ``d * t`` processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch
import torch.distributed as dist

from accelfn.distributed import _tp_layouts, fsdp, is_dtensor
from accelfn.distributed.phases import ModelPhase
from accelfn.transforms import Compile as CompileSpec
from accelfn.transforms import ShardParams, TensorParallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from accelfn.distributed.phases import Preparation

#: Hugging Face ``_tp_plan`` style names that have a torch ParallelStyle of the same meaning
HF_STYLES = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise")
#: the attribute of a prepared model that holds the TensorParallel it was split with
_SPLIT_WITH = "_accelfn_tensor_parallel"


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


@attrs.frozen
class Resolved:
    """A plan as ``parallelize_module`` takes it, checked.

    Attributes:
        plan: module pattern -> torch ParallelStyle (``"auto"``: completed to keep tied weights tied).
        spelling: module pattern -> how the plan spelled its style, for messages.
    """

    plan: dict[str, Any]
    spelling: dict[str, str]


def _own_plan(model: torch.nn.Module) -> dict[str, Any] | None:
    """The model's own plan (a transformers model's ``_tp_plan``), its patterns prefixed with
    the name of the module that holds it: the outermost that has one of its own (a
    ``peft.PeftModel`` holds its transformers model as ``base_model.model``, and forwards
    attribute lookups to it, so the root's ``_tp_plan`` would name modules it does not have)."""
    for name, module in model.named_modules():
        own = vars(module).get("_tp_plan") or vars(module).get("tp_plan")
        if own:
            return {f"{name}.{pattern}" if name else pattern: style for pattern, style in own.items()}
    return getattr(model, "_tp_plan", None) or getattr(model, "tp_plan", None)  # a class attribute


def resolve(tp: TensorParallel, model: torch.nn.Module) -> Resolved | None:
    """The plan as ``parallelize_module`` takes it, checked (None for a plan function).

    Raises:
        ValueError: ``"auto"`` for a model without a ``_tp_plan``; a pattern that matches no
            module; a layer-splitting style on a module that is no ``nn.Linear`` or
            ``nn.Embedding``; a tied weight the plan splits two ways (``_tp_layouts``).
        NotImplementedError: ``"auto"`` with a style this module does not map.
    """
    if callable(tp.plan):
        return None
    if tp.plan == "auto":
        own = _own_plan(model)
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
        if not any(_tp_layouts.matches(pattern, n) for n in names):
            raise ValueError(
                f"tensor_parallel(plan=...): the pattern {pattern!r} matches no module of {type(model).__name__} "
                f"(its modules include {', '.join(repr(n) for n in names[:8])}); patterns are module names "
                "with '*' for one part, e.g. 'blocks.*.mlp.0'"
            )
    plan = {pattern: _style(style, pattern) for pattern, style in pairs}
    spelling = {pattern: _tp_layouts.spelled(style) for pattern, style in pairs}
    _tp_layouts.check_modules(model, plan, spelling)
    plan = _tp_layouts.check_ties(model, plan, spelling, complete=tp.plan == "auto")
    return Resolved(plan, spelling)


@attrs.frozen
class LayerSplit:
    """What one layer of a tensor-parallel plan holds and sends on each rank of its group: the
    rule ``af.plan`` reads, from the torch style ``parallelize_module`` applies to it.

    Attributes:
        module: the layer's name in the model.
        style: ``"colwise"`` or ``"rowwise"``.
        dims: each of its parameters' (by local name) split dimension (``Shard(dim)``, cut as
            ``torch.chunk`` cuts it); a parameter not named stays whole.
        gathers_output: a column-wise layer whose output is gathered whole (``output_layouts=
            Replicate()``): one all-gather of the output per forward.
        reduces_output: a row-wise layer: one all-reduce of its (partial) output per forward.
        reduces_input_grad: a column-wise layer: one all-reduce of its input's gradient per
            backward (when the input requires a gradient).
    """

    module: str
    style: str
    dims: tuple[tuple[str, int], ...]
    gathers_output: bool = False
    reduces_output: bool = False
    reduces_input_grad: bool = False


def layer_splits(tp: TensorParallel, model: torch.nn.Module) -> tuple[list[LayerSplit], list[str]]:
    """The layers ``tp``'s plan splits in ``model``, and what of the plan no rule here says
    (a plan function, a style other than torch's ``ColwiseParallel``/``RowwiseParallel`` with
    their default layouts, a layer that is not a Linear or an Embedding), each named.

    Raises:
        ValueError, NotImplementedError: from :func:`resolve`.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    resolved = resolve(tp, model)
    if resolved is None:
        return [], [f"tensor_parallel(plan={getattr(tp.plan, '__name__', tp.plan)!r}) (a plan function)"]
    splits, unknown = [], []
    modules = dict(model.named_modules())
    for pattern, style in resolved.plan.items():
        for name in (n for n in modules if n and _tp_layouts.matches(pattern, n)):
            module = modules[name]
            kind = type(style)
            linear, embedding = isinstance(module, torch.nn.Linear), isinstance(module, torch.nn.Embedding)
            if kind is ColwiseParallel and (linear or embedding) and style.input_layouts == (Replicate(),) \
                    and style.output_layouts in ((Shard(-1),), (Replicate(),)):
                dims = (("weight", 1),) if embedding else tuple((n, 0) for n, _ in module.named_parameters())
                splits.append(LayerSplit(name, "colwise", dims, gathers_output=style.output_layouts == (Replicate(),),
                                         reduces_input_grad=linear))
            elif kind is RowwiseParallel and (linear or embedding) and style.output_layouts == (Replicate(),):
                splits.append(LayerSplit(name, "rowwise", (("weight", 0 if embedding else 1),), reduces_output=True))
            else:
                unknown.append(f"{name!r} ({style!r} on a {type(module).__name__})")
    return splits, unknown


def split_model(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tp: TensorParallel,
                mesh: DeviceMesh, *, watch: bool = True) -> None:
    """Splits ``model`` in place over ``mesh`` (the 1-D tensor dimension) and points
    ``optimizer`` at its parameters.

    Rank 0's parameters and buffers are broadcast first, over the whole world, so every rank
    starts from the same model whatever its seed (as DDP does). A tied weight stays one
    parameter under all its names. A dict or ``"auto"`` plan's layers hand back outputs of
    their own, not views (``_tp_layouts.own_outputs``); with ``watch`` the first forward with
    gradients checks the layouts of the activations (``_tp_layouts.LayoutWatch``).

    Raises:
        ValueError, NotImplementedError: from :func:`resolve`; a plan function that split a
            tied weight two ways.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    resolved = resolve(tp, model)  # before anything changes
    names = {id(p): name for name, p in model.named_parameters()}
    tied = _tp_layouts.tied_names(model)
    on_meta = any(t.is_meta for t in model.parameters())  # materialized after splitting (_materialize)
    if dist.get_world_size() > 1 and not on_meta:
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)
    if resolved is None:
        tp.plan(model, mesh)  # type: ignore[operator]  # a plan function
    else:  # equal on every rank already: each cuts its own part (no scatter, which meta tensors cannot do)
        parallelize_module(model, mesh, resolved.plan, src_data_rank=None)
    _tp_layouts.retie(model, tied)
    split = dict(model.named_parameters())
    fsdp.rebind(optimizer, {id_: split[name] for id_, name in names.items()})
    setattr(model, _SPLIT_WITH, tp)
    if resolved is not None:
        _tp_layouts.own_outputs(model, resolved.plan)
        if watch:
            _tp_layouts.LayoutWatch(model, resolved.plan, resolved.spelling, mesh.size())


class Split(ModelPhase):
    """``tensor_parallel()``'s model phase: the plan's layers split over the mesh's ``"tensor"``
    dimension, after placement and before sharding (torchtitan's order).

    On a tensor dimension of one rank (``size=1``, or one process) the plan is checked and the
    model left whole. A model split by an earlier ``prepare`` must be split the same way.
    """

    name: ClassVar[str] = "tensor_parallel"

    def __init__(self, spec: TensorParallel | None, split: bool):
        self.spec = spec
        self.split = split

    @classmethod
    def of(cls, prep: Preparation) -> Split | None:
        spec, split = prep.step.find(TensorParallel), split_with(prep.state.model) is not None
        return cls(spec, split) if spec is not None or split else None

    def check(self, prep: Preparation) -> None:
        """Raises ValueError for another split than the model's, a plan that matches no module or
        ``"auto"`` without a model plan; NotImplementedError for a device other than CPU and CUDA,
        ``shard_params(shard_size=...)`` or ``offload`` with it, or a style ``"auto"`` cannot map."""
        check_same_split(prep.state.model, self.spec)
        if self.split or self.spec is None:
            return
        if prep.hardware.device.type not in ("cpu", "cuda"):
            raise NotImplementedError(f"the {prep.hardware.name} backend does not support tensor_parallel(); use the "
                                      "cpu or cuda backend")
        fsdp.check_available()
        shard = prep.step.find(ShardParams)
        if shard is not None and (shard.shard_size is not None or shard.offload):
            option = "shard_size" if shard.shard_size is not None else "offload"
            raise NotImplementedError(
                f"shard_params({option}=...) with tensor_parallel() is not supported (3-D HSDP x TP and offloaded "
                "TP shards are not built yet); use shard_params() over the whole data dimension")
        resolve(self.spec, prep.state.model)

    def apply(self, prep: Preparation) -> None:
        if self.split or self.spec is None:
            prep.forward_is_collective = prep.mesh.tensor > 1
            return
        sub = prep.mesh.device_mesh(prep.hardware.device, "tensor")
        if sub is not None:  # a compiled forward is not followed by the layout checks (a TorchFunctionMode)
            split_model(prep.state.model, prep.state.optimizer, self.spec, sub,
                        watch=prep.step.find(CompileSpec) is None)
            prep.forward_is_collective = True
        else:
            setattr(prep.state.model, _SPLIT_WITH, self.spec)


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
