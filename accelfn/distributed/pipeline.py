"""What the CPU (gloo) and CUDA (NCCL) backends share for ``pipeline``: the ``(pipe, data)``
mesh, the model traced and cut into stages, and each rank's model and optimizer pruned to its
own stages.

The model is traced with ``torch.fx.symbolic_trace`` and its graph cut where each split
point's module is first used (a node belongs to the module on its ``nn_module_stack``, so a
block's own shape arithmetic goes with the block). Each stage is a ``GraphModule`` built on
the model itself: its parameters are the model's own ``Parameter`` objects, under their own
names, so the optimizer keeps them, and the model, pruned of every other stage's
parameters and buffers, still names each of its tensors as the whole model does (checkpoints
and exports are the unsharded model's). The stages run through
``torch.distributed.pipelining`` (``PipelineStage`` and its schedules; ``_pipeline_step``).
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch
import torch.distributed as dist

from accelfn.distributed import recompute
from accelfn.distributed.mesh import Mesh
from accelfn.distributed.phases import ModelPhase
from accelfn.transforms import CheckpointActivations, Pipeline

if TYPE_CHECKING:
    from accelfn.distributed.phases import Preparation


#: the attribute of a prepared model that holds the Pipeline it was cut with
_CUT_WITH = "_accelfn_pipeline"


def _module_path(node: torch.fx.Node) -> tuple[str, ...]:
    """The modules a traced node runs in, outermost first (its ``nn_module_stack``), with the
    module it calls or the attribute it reads."""
    stack = [path for path, _ in node.meta.get("nn_module_stack", {}).values()]
    if node.op in ("call_module", "get_attr") and isinstance(node.target, str):
        stack.append(node.target)
    return tuple(stack)


def _inside(path: str, point: str) -> bool:
    return path == point or path.startswith(point + ".")


def assign_stages(graph: torch.fx.Graph, split_points: tuple[str, ...]) -> dict[torch.fx.Node, int]:
    """Each node of ``graph`` (but ``output``) and the stage it runs in.

    Raises:
        ValueError: a split point the forward never uses, or split points out of the forward's order.
    """
    stage, stages = 0, {}
    for node in graph.nodes:
        if node.op == "output":
            continue
        paths = _module_path(node)
        for later in range(stage, len(split_points)):
            if any(_inside(p, split_points[later]) for p in paths):
                if later > stage:
                    skipped = split_points[stage:later]
                    raise ValueError(
                        f"pipeline(split_points={list(split_points)!r}): the forward uses {split_points[later]!r} "
                        f"before {skipped[0]!r}; list the split points in the order the forward runs them")
                stage = later + 1
                break
        stages[node] = stage
    if stage < len(split_points):
        raise ValueError(
            f"pipeline(split_points={list(split_points)!r}): the forward never uses the module "
            f"{split_points[stage]!r}; name modules of the model (model.named_modules()) that its forward calls")
    return stages


def _crossing(graph: torch.fx.Graph, stages: dict[torch.fx.Node, int], num_stages: int,
              split_points: tuple[str, ...]) -> list[torch.fx.Node]:
    """The one value that flows into each stage after the first, from the stage before it.

    Raises:
        ValueError: a split point crossed by several values, or by a value that skips a stage.
    """
    crossing: list[set[torch.fx.Node]] = [set() for _ in range(num_stages)]
    for node, stage in stages.items():
        if node.op == "get_attr":  # a parameter read: read again where it is used
            continue
        for user in node.users:
            to = num_stages - 1 if user.op == "output" else stages[user]
            for s in range(stage + 1, to + 1):
                crossing[s].add(node)
    flows = []
    for s in range(1, num_stages):
        values = crossing[s]
        if len(values) != 1 or stages[next(iter(values))] != s - 1:
            names = sorted(n.name for n in values)
            raise ValueError(
                f"pipeline(): at the split point {split_points[s - 1]!r}, {len(values)} values of the forward "
                f"cross into stage {s} ({', '.join(names)}); a split point must be crossed by exactly one tensor "
                "from the stage before (the hidden state): choose another split point, e.g. the start of a block")
        flows.append(next(iter(values)))
    return flows


class _Tracer(torch.fx.Tracer):
    """``torch.fx``'s tracer, keeping the modules ``leaves`` whole (one ``call_module`` node each)."""

    def __init__(self, leaves: Collection[torch.nn.Module]):
        super().__init__()
        self._leaves = leaves

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return m in self._leaves or super().is_leaf_module(m, module_qualified_name)


def check_split_points(model: torch.nn.Module, split_points: tuple[str, ...]) -> None:
    """Raises unless every split point names a module of ``model`` (before tracing it).

    Raises:
        ValueError: naming each split point that is no module of ``model``, with the modules
            it may have meant (the children of its parent, or close names).
    """
    names = [n for n, _ in model.named_modules() if n]
    known = set(names)
    for point in split_points:
        if point in known:
            continue
        parent = point.rpartition(".")[0]
        siblings = [n for n in names if n.rpartition(".")[0] == parent] if parent in known or not parent else []
        near = siblings or difflib.get_close_matches(point, names, n=6)
        raise ValueError(
            f"pipeline(split_points={list(split_points)!r}): {type(model).__name__} has no module {point!r}"
            f"{f' (it has {_listed(near)})' if near else ''}; a split point is a module name of "
            "model.named_modules() where a stage begins")


def _listed(names: list[str]) -> str:
    shown = [repr(n) for n in names[:8]]
    return ", ".join(shown) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def _check_not_empty(stages: dict[torch.fx.Node, int], split_points: tuple[str, ...]) -> None:
    """Raises if a stage would run no operation of the forward (a split point at the first
    module the forward runs, or two split points with nothing between them).

    Raises:
        ValueError: naming the empty stage and its split points.
    """
    working = {stage for node, stage in stages.items() if node.op in ("call_module", "call_function", "call_method")}
    for s in range(len(split_points) + 1):
        if s in working:
            continue
        where = (f"before {split_points[0]!r}, the first module its forward runs" if s == 0 else
                 f"between {split_points[s - 1]!r} and {split_points[s]!r}")
        raise ValueError(
            f"pipeline(split_points={list(split_points)!r}): stage {s} would be empty: the model runs nothing "
            f"{where}, so its rank would train no parameter; split before a later module (a stage begins at its "
            "split point: the first stage runs everything before the first split point)")


def _untraceable_hint(model: torch.nn.Module) -> str:
    """What to do about a model ``symbolic_trace`` cannot trace: a transformers model's forward
    is not traceable (keyword arguments, checks on its inputs), and its tied weights are named."""
    hint = ""
    if callable(getattr(model, "get_input_embeddings", None)) and hasattr(model, "config"):
        hint += ("; a transformers model's forward takes keyword arguments and branches on them: pipeline a module "
                 "of your own whose forward calls its layers in order (e.g. embeddings, then blocks, then the head)")
    seen: dict[int, str] = {}
    tied = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.append(f"{name} = {seen[id(p)]}")
        seen.setdefault(id(p), name)
    if tied:
        hint += (f"; its tied weights ({', '.join(tied)}) must be untied too when the stages that use them "
                 "differ (a copy of its own per stage)")
    return hint


def cut(model: torch.nn.Module, pp: Pipeline, leaves: Collection[torch.nn.Module] = frozenset(),
        ) -> list[torch.fx.GraphModule]:
    """``model`` traced and cut at ``pp.split_points``: one ``GraphModule`` per stage, on the
    model's own parameters and buffers, under their own names.

    Args:
        model: the model.
        pp: the transform (its split points).
        leaves: modules the stages call whole, as ``call_module`` (the blocks
            ``checkpoint_activations`` recomputes: each stage then runs their own forward).

    Raises:
        ValueError: a split point that names no module of the model, the model cannot be
            traced (named), a split point it never uses or inside one of ``leaves``, a stage
            that would be empty, one crossed by more than one value, a parameter used by two
            stages, an output not computed by the last stage.
    """
    check_split_points(model, pp.split_points)
    whole = [name for name, module in model.named_modules() if module in leaves]
    for point in pp.split_points:
        inside = [name for name in whole if point.startswith(name + ".")]
        if inside:
            raise ValueError(
                f"pipeline(split_points={list(pp.split_points)!r}): {point!r} is inside the block {inside[0]!r}, "
                "whose activations checkpoint_activations() recomputes as a whole in its stage; split at a block "
                "(e.g. the block itself), or recompute other modules (checkpoint_activations(modules=...))")
    try:
        graph = _Tracer(leaves).trace(model)
    except Exception as e:  # noqa: BLE001  # torch's tracing errors have many types
        raise ValueError(
            f"pipeline(): torch.fx.symbolic_trace cannot trace {type(model).__name__} ({type(e).__name__}: {e}); "
            "pipeline() cuts a traceable forward (no control flow on tensor values, positional tensor "
            f"arguments){_untraceable_hint(model)}") from e
    stages = assign_stages(graph, pp.split_points)
    _check_not_empty(stages, pp.split_points)
    flows = _crossing(graph, stages, pp.num_stages, pp.split_points)
    (output,) = [n for n in graph.nodes if n.op == "output"]
    result = output.args[0]
    if not isinstance(result, torch.fx.Node) or stages.get(result) != pp.num_stages - 1:
        raise ValueError("pipeline(): the model's forward must return one tensor computed by the last stage")
    modules = []
    for s in range(pp.num_stages):
        g = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        if s > 0:
            env[flows[s - 1]] = g.placeholder("hidden")

        def arg(n: torch.fx.Node) -> torch.fx.Node:
            if n not in env and n.op == "get_attr":  # a parameter read in this stage
                env[n] = g.node_copy(n)
            return env[n]

        for node, stage in stages.items():
            if stage == s and (node.op != "get_attr" or node not in env):
                env[node] = g.node_copy(node, arg)
        g.output(env[flows[s]] if s < pp.num_stages - 1 else env[result])
        module = torch.fx.GraphModule(model, g, class_name=f"Stage{s}")
        module.graph.eliminate_dead_code()
        module.recompile()
        modules.append(module)
    _check_disjoint(model, modules)
    return modules


def _check_disjoint(model: torch.nn.Module, modules: list[torch.fx.GraphModule]) -> None:
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    owner: dict[int, int] = {}
    for s, module in enumerate(modules):
        for p in module.parameters():
            if owner.setdefault(id(p), s) != s:
                raise ValueError(
                    f"pipeline(): the parameter {names.get(id(p), '?')!r} is used by stages {owner[id(p)]} and {s} "
                    "(a weight tied across stages, e.g. an embedding shared with the output layer); untie it "
                    "(a copy of its own per stage), or move the split points so one stage uses it")


def stage_indices(pp: Pipeline, position: int) -> list[int]:
    """The stages the rank at pipe position ``position`` runs: ``position, position + size, ...``."""
    return list(range(position, pp.num_stages, pp.size))


def held(model: torch.nn.Module, stages: list[torch.fx.GraphModule], mine: Iterable[int]) -> set[int]:
    """The ids of the parameters and buffers of ``model`` that a rank running the stages
    ``mine`` of the cut ``stages`` keeps: those its stages use, and, on the rank of stage 0,
    those no stage uses (the rule ``prune`` applies and ``af.plan`` counts bytes by)."""
    mine = list(mine)
    kept = {id(t) for i in mine for t in [*stages[i].parameters(), *stages[i].buffers()]}
    if 0 in mine:
        used = {id(t) for m in stages for t in [*m.parameters(), *m.buffers()]}
        kept |= {id(t) for t in [*model.parameters(), *model.buffers()] if id(t) not in used}
    return kept


def prune(model: torch.nn.Module, optimizer: torch.optim.Optimizer, kept: set[int]) -> None:
    """Removes from ``model`` (and ``optimizer``) every parameter and buffer whose id is not in
    ``kept`` (:func:`held`)."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in list(table.items()):
                if tensor is None or id(tensor) in kept:
                    continue
                del table[name]
    remaining = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in remaining]
    for p in list(optimizer.state):
        if id(p) not in remaining:
            del optimizer.state[p]


def prepare_model(model: torch.nn.Module, optimizer: torch.optim.Optimizer, pp: Pipeline, mesh: Mesh,
                  rank: int, group: Any, leaves: Collection[torch.nn.Module] = frozenset(),
                  ) -> list[tuple[int, torch.fx.GraphModule]]:
    """Cuts ``model``, prunes it and ``optimizer`` to the stages of ``rank`` (its place on
    ``mesh``'s pipe dimension, whose process group is ``group``), leaves on it the
    ``StageLayout`` checkpoints read, and returns its stages as ``(stage index, module)`` pairs.

    Raises:
        ValueError: from :func:`cut` (``leaves``: the modules its stages call whole).
    """
    modules = cut(model, pp, leaves)
    names = {id(p): n for n, p in model.named_parameters()}
    layout = StageLayout(
        keys=tuple(model.state_dict()),
        param_names=tuple(tuple(names[id(p)] for p in g["params"]) for g in optimizer.param_groups),
        group=group, ranks=mesh.ranks_along("pipe", rank), data_rank=mesh.data_coordinates(rank)[0])
    mine = stage_indices(pp, mesh.coordinates(rank)["pipe"])
    prune(model, optimizer, held(model, modules, mine))
    setattr(model, _CUT_WITH, pp)
    setattr(model, LAYOUT_ATTRIBUTE, layout)
    return [(i, modules[i]) for i in mine]


class Cut(ModelPhase):
    """``pipeline()``'s model phase: the placed model cut into stages, each rank keeping its own.

    Checked first (the device, a model not on the meta device and not cut before, the cut
    itself: every error of the trace and the split points before anything changes); applied
    after placement: rank 0's parameters and buffers broadcast (every rank starts from the
    same model), then the model and optimizer pruned to this rank's stages (``prep.stages``).
    """

    name: ClassVar[str] = "pipeline"

    def __init__(self, spec: Pipeline):
        self.spec = spec

    @classmethod
    def of(cls, prep: Preparation) -> Cut | None:
        spec = prep.step.find(Pipeline)
        return None if spec is None else cls(spec)

    def check(self, prep: Preparation) -> None:
        """Raises NotImplementedError for another device than CPU/CUDA or a model on the meta
        device; ValueError for a model cut before, or one the split points cannot cut."""
        if prep.hardware.device.type not in ("cpu", "cuda"):
            raise NotImplementedError(f"pipeline() runs on the cpu and cuda backends, not on {prep.hardware.device.type}")
        if any(t.is_meta for t in [*prep.state.model.parameters(), *prep.state.model.buffers()]):
            raise NotImplementedError(
                "pipeline() of a model built on the meta device is not built yet (each rank would fill only its "
                "stages); build the model on the CPU: prepare cuts it and each rank keeps only its stages")
        check_not_cut(prep.state.model)
        cut(prep.state.model, self.spec, self._leaves(prep))  # every error of the cut, before anything changes

    def apply(self, prep: Preparation) -> None:
        model, rank = prep.state.model, prep.hardware.rank
        for tensor in [*model.parameters(), *model.buffers()]:  # every rank starts from rank 0's model
            dist.broadcast(tensor.data, src=0)
        group = prep.mesh.group(prep.hardware.device, "pipe")
        prep.stages = prepare_model(model, prep.state.optimizer, self.spec, prep.mesh, rank, group,
                                    self._leaves(prep))
        last_rank = prep.mesh.ranks_along("pipe", rank)[-1]
        keep(model, prep.stages, self.spec.num_stages, group, last_rank, prep.hardware.device)
        prep.forward_is_collective = True


    @staticmethod
    def _leaves(prep: Preparation) -> frozenset[torch.nn.Module]:
        """The blocks whose activations the program recomputes: each stage calls them whole, so
        that the stage recomputes them (``checkpoint_activations`` per stage)."""
        spec = prep.step.find(CheckpointActivations)
        if spec is None or (spec.policy == "budget" and spec.chosen is None):  # refused by its own phase
            return frozenset()
        return recompute.leaves(spec, prep.state.model)


def cut_with(model: torch.nn.Module) -> Pipeline | None:
    """The Pipeline ``model`` was cut with by ``prepare``, or None."""
    return getattr(model, _CUT_WITH, None)


def check_not_cut(model: torch.nn.Module) -> None:
    """Raises if ``model`` was cut by ``prepare`` already (a model is cut once).

    Raises:
        ValueError: always, when it was.
    """
    before = cut_with(model)
    if before is not None:
        raise ValueError(
            f"this state's model was already cut into stages with {before!r}: a model is cut once; build the "
            "state again (a fresh model and optimizer) to prepare another step")


def sample_count(batch: Any) -> int:
    """The micro-batch's samples: the leading dimension of its targets."""
    return int(batch[1].shape[0])


def split_batch(batch: Any) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``(inputs, targets)`` of a pipelined micro-batch, ``inputs`` as a tuple of tensors.

    Raises:
        TypeError: a batch that is not a pair of tensors (inputs a tensor or a tuple of them).
    """
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(
            f"under pipeline(), every batch is a pair (inputs, targets) of tensors, batch first, got a "
            f"{type(batch).__name__}{f' of {len(batch)} items' if isinstance(batch, (tuple, list)) else ''}; the "
            "first stage takes inputs, the loss on the last stage takes targets")
    inputs, targets = batch
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if not all(isinstance(t, torch.Tensor) for t in (*inputs, targets)):
        raise TypeError("under pipeline(), a batch's inputs and targets must be tensors (inputs: a tensor or a "
                        "tuple of tensors, the model's positional arguments)")
    return inputs, targets


# -- the stages as checkpoints and exports see them -----------------------------------------
#
# The stages of a pipelined model as checkpoints and exports see them: which names the
# whole model has, which ranks hold its stages, and the one collective that joins them.
#
# ``backend.prepare`` cuts a model for ``af.pipeline`` and leaves on it a :class:`StageLayout`
# (the attribute ``ATTRIBUTE``); every rank's model then holds only its own stages'
# parameters, under the whole model's names. A checkpoint is written by every rank, its own
# stages (``checkpoint._pipelined``); an export joins the stages of the pipeline that holds
# rank 0 (data rank 0) onto rank 0 (:func:`gather_bytes`), so what it writes is the whole
# model's weights; a load keeps of a checkpoint what this rank's stages hold.

#: the attribute of a pipelined model holding its StageLayout
LAYOUT_ATTRIBUTE = "_accelfn_stage_layout"


@attrs.frozen(eq=False)
class StageLayout:
    """Where the parts of a pipelined model live.

    Attributes:
        keys: the whole model's ``state_dict`` keys, in its order.
        param_names: the whole optimizer's parameter names, per param group, in its order.
        group: the process group of this rank's pipeline (one rank per pipe position).
        ranks: the global ranks of that pipeline, by pipe position.
        data_rank: this rank's data-parallel rank (0: the pipeline that holds rank 0).
    """

    keys: tuple[str, ...]
    param_names: tuple[tuple[str, ...], ...]
    group: Any
    ranks: tuple[int, ...]
    data_rank: int


def stage_layout(model: torch.nn.Module) -> StageLayout | None:
    """The StageLayout ``model`` was cut with (``af.pipeline``), or None."""
    return getattr(model, LAYOUT_ATTRIBUTE, None)


def gather_bytes(payload: torch.Tensor, layout: StageLayout) -> list[torch.Tensor] | None:
    """Every stage's ``payload`` (a 1-D uint8 CPU tensor) of the pipeline that holds rank 0,
    in pipe order, on rank 0; None on its other ranks. Two collectives over that pipeline's
    group (its ranks call it; the other pipelines do not)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(layout.group) == "nccl" \
        else torch.device("cpu")
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in layout.ranks]
    dist.all_gather(lengths, length, group=layout.group)
    longest = int(max(int(n) for n in lengths))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:payload.numel()] = payload.to(device)
    first = layout.ranks[0]
    received = [torch.empty_like(padded) for _ in layout.ranks] if dist.get_rank() == first else None
    dist.gather(padded, received, dst=first, group=layout.group)
    if received is None:
        return None
    return [r[:int(n)].cpu() for r, n in zip(received, lengths)]


# -- the forward of a cut model outside training (af.evaluate) ----------------------------
#
# The forward of a pipelined model outside training (``af.evaluate``): the stages run
# forward only, through the schedule's forward-only path (``schedule.eval``), and the last
# stage's output is broadcast over the pipe group, so that every rank's ``fn`` sees it.
#
# ``_pipeline_step.prepare`` leaves on the cut model its ``(stage index, module)`` pairs and
# its pipe group (:data:`ATTRIBUTE`, a plain attribute: not a submodule, so the model's
# ``state_dict`` is unchanged). Per call, on every rank of one pipeline::
#
#     schedule   ScheduleGPipe (ScheduleLoopedBFS with several stages per rank) of one
#                micro-batch, made once per input shape on stages of its own, .eval(*inputs)
#     output     the last stage's output: its shape and dtype, then its values, broadcast
#                from the last stage over the pipe group (two broadcasts)

#: the attribute of a cut model holding its _Stages
STAGES_ATTRIBUTE = "_accelfn_pipeline_stages"
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8, torch.int16)
_MAX_DIMS = 8


@attrs.define(eq=False)
class _Stages:
    """This rank's stages of a cut model, and what running them forward needs."""

    stages: list[tuple[int, torch.fx.GraphModule]]
    num_stages: int
    group: Any
    last_rank: int
    device: torch.device
    schedules: dict[Any, Any] = attrs.Factory(dict)


def keep(model: torch.nn.Module, stages: list[tuple[int, torch.fx.GraphModule]], num_stages: int, group: Any,
         last_rank: int, device: torch.device) -> None:
    """Leaves on ``model`` what :func:`forward_of` needs (a plain attribute, not a submodule)."""
    object.__setattr__(model, STAGES_ATTRIBUTE, _Stages(stages, num_stages, group, last_rank, device))


class PipelinedForward:
    """``forward(*inputs) -> output``: the whole model's forward of a pipelined model, on
    every rank of its pipeline (a collective over the pipe group).

    ``af.evaluate`` hands it to ``fn`` in place of the model: ``fn(model, batch)`` calls
    ``model(inputs)`` as for an unsharded model. Every rank of a pipeline must call it
    alike (the same number of times, with inputs of the same shapes: they read the same data).

    Args (of a call):
        *inputs: the model's positional arguments, tensors of shape ``(batch, ...)``, on the
            backend's device (the first stage reads them; the other stages' are ignored but for
            their shapes).

    Returns:
        The last stage's output, shape ``(batch, ...)``, the same on every rank of the pipeline.

    Raises:
        TypeError: an input that is not a tensor, or keyword arguments.
        ValueError: an output of more than 8 dimensions or of an unusual dtype.
    """

    def __init__(self, model: torch.nn.Module, stages: _Stages):
        self.module = model
        self._stages = stages

    def __call__(self, *inputs: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs or not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
            raise TypeError("a pipelined model's forward takes its inputs as positional tensors (batch first), "
                            "without keyword arguments: call model(inputs) or model(*inputs) in fn")
        s = self._stages
        indices = [i for i, _ in s.stages]
        schedule = self._schedule(tuple((tuple(t.shape), t.dtype) for t in inputs))
        output = schedule.eval(*inputs) if 0 in indices else schedule.eval()
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=s.device)
        if s.num_stages - 1 in indices:
            output = output.detach()
            if output.ndim > _MAX_DIMS or output.dtype not in _DTYPES:
                raise ValueError(f"af.evaluate of a pipelined model: the last stage's output has shape "
                                 f"{tuple(output.shape)} and dtype {output.dtype}; at most {_MAX_DIMS} dimensions "
                                 "of a usual dtype are broadcast to the other stages")
            header[0], header[1] = output.ndim, _DTYPES.index(output.dtype)
            header[2:2 + output.ndim] = torch.tensor(output.shape, dtype=torch.int64)
        dist.broadcast(header, src=s.last_rank, group=s.group)
        ndim = int(header[0])
        if s.num_stages - 1 not in indices:
            shape = [int(n) for n in header[2:2 + ndim]]
            output = torch.empty(shape, dtype=_DTYPES[int(header[1])], device=s.device)
        output = output.contiguous()
        dist.broadcast(output, src=s.last_rank, group=s.group)
        return output

    def _schedule(self, key: Any) -> Any:
        """The forward-only schedule of one micro-batch of ``key``'s input shapes (made once)."""
        s = self._stages
        if key not in s.schedules:
            from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleLoopedBFS

            stages = [PipelineStage(module, i, s.num_stages, s.device, group=s.group) for i, module in s.stages]
            s.schedules[key] = (ScheduleGPipe(stages[0], 1) if len(stages) == 1
                                else ScheduleLoopedBFS(list[Any](stages), 1))
        return s.schedules[key]


def forward_of(model: torch.nn.Module) -> PipelinedForward | None:
    """The pipelined forward of ``model`` (cut by ``af.pipeline``), or None for another model."""
    stages = getattr(model, STAGES_ATTRIBUTE, None)
    return None if stages is None else PipelinedForward(model, stages)
