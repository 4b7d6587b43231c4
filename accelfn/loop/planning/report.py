"""The plan record, ``af.plan`` and the check ``run`` makes before its first forward:
what a run will do, hold and break on, known before it starts.

A plan is computed in one process for any world size, without training and without
allocating gradients, optimizer state or activations: the counts are arithmetic over the
data's length and the program's transforms (``_counts``), the persistent bytes come from
shapes and dtypes and the optimizer's own step on meta tensors, the activation peak from one
micro-batch traced on fake tensors (``_memory``; under ``context_parallel``, context rank 0's
part of each sequence, what its forward holds), the collectives from the bucket and
unit layout (``_comms``), and the misconfigurations from the catalogue (``_problems``).
``run`` checks the plan's problems before the first forward and refuses one with errors.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable
from typing import Any, NoReturn

import attrs
import torch
from torch.utils.data import DataLoader, IterableDataset

from accelfn.backends.base import Backend
from accelfn.backends.cpu import CPU
from accelfn.distributed import context_parallel
from accelfn.distributed.env import LaunchEnv, with_launch_defaults
from accelfn.distributed.mesh import Mesh
from accelfn.distributed.pipeline import cut, split_batch
from accelfn.distributed.recompute import recomputing
from accelfn.errors import PlanError, PlanWarning, check_int
from accelfn.loop.planning._comms import Collective, Traced, collectives_per_update, metric_count
from accelfn.loop.planning._counts import EpochCounts, epoch_counts
from accelfn.loop.planning._memory import Memory, persistent_memory, trace_micro_batch
from accelfn.loop.planning._problems import Facts, Problem, find_problems
from accelfn.loop.planning._recompute import Recomputation, adjusting, plan_recomputation, resolved_step
from accelfn.loop.planning._split import ModelSplit, split_of
from accelfn.loop.planning._table import render
from accelfn.state import TrainState
from accelfn.step import OutputLoss, Step, check_loss_form, unpack
from accelfn.transforms import CheckpointActivations, ContextParallel, Pipeline

__all__ = ["Collective", "EpochCounts", "Memory", "Plan", "PlanError", "Problem", "Recomputation", "plan"]


@attrs.frozen
class Plan:
    """What ``run(step, state, data, ...)`` will do, hold and break on; see :func:`plan`.

    Attributes:
        world_size: the processes the plan is for.
        backend: the backend's name (``"cpu"``, ``"cuda"``, ``"xla"``).
        precision: the precision policy's name.
        epochs: the counts of each epoch the run trains (from ``state``'s position on).
        total_updates: ``state.step`` when the run ends (rank 0's; None when the data's
            length is unknown and no ``max_steps`` bounds it).
        scheduler_steps: the steps ``state.scheduler`` will have taken when the run ends
            (its ``last_epoch``), if no fp16 update is skipped; None without a scheduler.
        memory: each rank's bytes, indexed by rank (None if not planned).
        comms: the collectives of one optimizer update on rank 0, in order.
        problems: errors and warnings, each with a code, what is wrong and the fix.
        device_memory: the bytes per device the plan was checked against, or None.
        recompute: under ``checkpoint_activations``, each candidate block's activation bytes,
            the micro-batch's traced peak under each policy and the blocks recomputed (None
            without it, or untraced).
        step: the program ``run`` prepares: ``step`` with a ``checkpoint_activations("budget")``
            resolved to the blocks the trace chose (prepare it in a loop of your own).
    """

    world_size: int
    backend: str
    precision: str
    epochs: tuple[EpochCounts, ...]
    total_updates: int | None
    scheduler_steps: int | None
    memory: tuple[Memory, ...] | None
    comms: tuple[Collective, ...]
    problems: tuple[Problem, ...]
    device_memory: int | None = None
    recompute: Recomputation | None = None
    step: Step | None = None

    @property
    def updates_per_epoch(self) -> tuple[int | None, ...]:
        """Optimizer updates of each epoch of the run (rank 0's)."""
        return tuple(u for e in self.epochs for u in [e.updates[0]] * e.num_epochs)

    @property
    def errors(self) -> tuple[Problem, ...]:
        """The problems that make ``run`` refuse the program."""
        return tuple(p for p in self.problems if p.error)

    @property
    def warnings(self) -> tuple[Problem, ...]:
        """The problems ``run`` warns about and trains anyway."""
        return tuple(p for p in self.problems if not p.error)

    def __str__(self) -> str:
        return render(self)


def _target(backend: Backend | None, world_size: int | None) -> tuple[Backend, int, int]:
    if backend is not None and not isinstance(backend, Backend):
        raise TypeError(f"plan(backend=...) must be a backend such as af.backends.auto() or None, got {backend!r}")
    if backend is None:
        backend = CPU(LaunchEnv())
    if world_size is None:  # under `accelfn plan` the backend stands for the planned world
        world_size = backend.world_size
    check_int("plan", "world_size", world_size, minimum=1)
    local = backend.local_world_size
    if world_size != backend.world_size:
        local = min(world_size, backend.local_world_size if backend.world_size > 1 else world_size)
    return backend, world_size, min(local, world_size)


def plan(step: Step, state: TrainState, data: Iterable[Any], *, backend: Backend | None = None,
         world_size: int | None = None, epochs: int | None = None, max_steps: int | None = None,
         device_memory: int | None = None, trace: bool = True) -> Plan:
    """What ``run(step, state, data, backend=backend, epochs=epochs, max_steps=max_steps)``
    will do on ``world_size`` processes, computed here in one process without training.

    The plan reads the run's own rules: the program's mesh (``distributed.mesh``: which data
    shard each rank reads under tensor and pipeline parallelism), each parallelism's split of
    the model (tensor-parallel styles, the pipeline's cut, FSDP2's shards, DeepSpeed's ZeRO
    partitions, invariant's partial sums) and the collectives each issues. Counts (updates,
    scheduler steps, samples per rank) are exact; parameter, gradient, optimizer-state and
    buffer bytes are exact; the micro-batch's peak is traced on fake tensors (no activation is
    allocated); collectives follow DDP's buckets (in a comm hook's dtype), FSDP2's units, the
    tensor-parallel layers, the pipeline's stages, invariant's canonical sum and DeepSpeed's
    kinds. What no rule models is a ``not-planned`` warning naming it (docs/13).
    ``state`` may be built on the meta device (``torch.device("meta")``).

    Args:
        step: the program (``af.train_step`` with transforms).
        state: the state ``run`` will train, fresh or resumed (its position counts).
        data: the DataLoader or iterable ``run`` will read.
        backend: the backend ``run`` will use (None: the CPU backend of one process);
            its launch defaults (``accelfn launch --precision/--accumulate``) apply.
        world_size: the processes to plan for (None: the backend's, or ``accelfn plan``'s);
            any number, since nothing is launched.
        epochs: as ``run``'s (None with ``max_steps`` None: ``run``'s default of 1).
        max_steps: as ``run``'s.
        device_memory: bytes of one device; a rank whose planned peak exceeds it is an error.
        trace: trace one micro-batch (the first batch of ``data``, read once) for the
            activation peak and the parameters no forward uses; False skips it.

    Returns:
        Plan: counts, memory, collectives and problems; ``print(plan)`` shows them as a table.

    Raises:
        TypeError: ``step`` not a Step, ``state`` not a TrainState, ``backend`` not a backend.
        ValueError: ``world_size``, ``epochs``, ``max_steps`` or ``device_memory`` below 1.
        TransformError: an ``af.output_loss(fn)`` in a program without ``pipeline()``.

    Example:
        >>> import torch, accelfn as af
        >>> model = torch.nn.Linear(4, 1)
        >>> state = af.TrainState.create(model, torch.optim.AdamW(model.parameters()))
        >>> data = torch.utils.data.DataLoader(torch.randn(100, 4), batch_size=8)
        >>> step = af.compose(af.shard_data(), af.replicate(), af.accumulate(2))(
        ...     af.train_step(lambda m, x: m(x).pow(2).mean()))
        >>> p = af.plan(step, state, data, world_size=4, epochs=2, trace=False)
        >>> p.updates_per_epoch, p.total_updates, p.epochs[0].samples
        ((2, 2), 4, (25, 25, 25, 25))
    """
    if not isinstance(step, Step):
        raise TypeError(f"plan() takes a Step first (af.train_step(loss_fn)), got {type(step).__name__}")
    if not isinstance(state, TrainState):
        raise TypeError(f"plan() takes a TrainState second (af.TrainState.create), got {type(state).__name__}")
    for name, value in (("epochs", epochs), ("max_steps", max_steps), ("device_memory", device_memory)):
        if value is not None:
            check_int("plan", name, value, minimum=1)
    if epochs is None and max_steps is None:
        epochs = 1
    backend, world_size, local_world_size = _target(backend, world_size)
    step = with_launch_defaults(step, backend.env, warn=False, world_size=world_size)
    check_loss_form(step)
    return _plan(step, state, data, backend, world_size, local_world_size, epochs, max_steps, device_memory,
                 trace=trace)


def _plan(step: Step, state: TrainState, data: Iterable[Any], backend: Backend, world_size: int,
          local_world_size: int, epochs: int | None, max_steps: int | None, device_memory: int | None, *,
          trace: bool) -> Plan:
    policy = backend.precision(step)
    facts = Facts(step=step, state=state, data=data, backend=backend, world_size=world_size,
                  local_world_size=local_world_size, policy=policy, epochs=epochs, max_steps=max_steps,
                  device_memory=device_memory)
    try:
        mesh = Mesh.of(step, world_size, local_world_size)
    except ValueError as e:  # a world the transforms cannot lay out: a problem of the plan
        facts = attrs.evolve(facts, mesh_error=str(e))
        return Plan(world_size=world_size, backend=backend.name, precision=policy.name, epochs=(),
                    total_updates=None, scheduler_steps=None, memory=None, comms=(),
                    problems=find_problems(facts), device_memory=device_memory)
    facts = attrs.evolve(facts, mesh=mesh)
    counted: tuple[EpochCounts, ...] = ()
    final: tuple[int | None, ...] = (state.step,)
    try:
        counted, final = epoch_counts(step, state, data, mesh=mesh, epochs=epochs, max_steps=max_steps)
    except ValueError as e:  # data that cannot be sharded or split as asked: a problem of the plan
        facts = attrs.evolve(facts, count_error=str(e))
    facts = attrs.evolve(facts, epochs_counted=counted, final_steps=final)
    split, split_error = split_of(step, state.model, mesh)
    not_planned = [f"tensor_parallel(): the split of {what}" for what in split.unknown]
    memory, optimizer_problem = None, None
    if split_error is None:
        memory, optimizer_problem = persistent_memory(state.model, state.optimizer, state.transforms_state,
                                                      policy=policy, step=step, split=split)
    facts = attrs.evolve(facts, optimizer_problem=optimizer_problem, split_error=split_error,
                         context_problem=_context_problem(step, data, mesh))
    traced = None
    recomputation = None
    if trace and memory is not None:
        recomputation, step, facts = _recomputation(step, state, data, backend, policy, facts, mesh)
        result = _trace(step, state, data, backend, policy, split, mesh, step.find(CheckpointActivations))
        if isinstance(result, tuple):
            peak, unused, traced = result
            memory = tuple(attrs.evolve(m, micro_batch=peak) for m in memory)
            facts = attrs.evolve(facts, unused_params=unused, step=step)
            if (device_memory is not None and recomputation is None
                    and max(m.device_peak for m in memory) > device_memory):  # what checkpoint_activations() saves
                full = _trace(step, state, data, backend, policy, split, mesh, CheckpointActivations())
                if isinstance(full, tuple):
                    facts = attrs.evolve(facts, recompute_full=full[0])
        else:
            facts = attrs.evolve(facts, trace_problem=result)
    if memory is not None and mesh.pipe > 1:
        not_planned.append("pipeline(): the activations of the micro-batches each stage keeps in flight (the "
                           "micro-batch peak is the whole model's, one micro-batch)")
    if mesh.context > 1:
        not_planned.append("context_parallel(): the ring's exchanges of keys and values in each attention (the "
                           "activation peak is one rank's part of each sequence, attended locally)")
    if memory is not None and mesh.tensor > 1:
        not_planned.append("tensor_parallel(): the activations of the split layers (the micro-batch peak is the "
                           "unsplit model's)")
    facts = attrs.evolve(facts, memory=memory)
    num_metrics = metric_count(step, state.optimizer, policy, traced.metrics if traced is not None else 0)
    total = final[0]
    scheduler_steps = None
    if state.scheduler is not None and total is not None:
        scheduler_steps = int(getattr(state.scheduler, "last_epoch", 0)) + total - state.step
    facts = attrs.evolve(facts, scheduler_steps=scheduler_steps)
    comms: tuple[Collective, ...] = ()
    if split_error is None:
        comms, unknown = collectives_per_update(step, state.model, policy, split, traced=traced,
                                                num_metrics=num_metrics,
                                                memory_values=2 if backend.device.type == "cuda" else 1)
        not_planned.extend(unknown)
    facts = attrs.evolve(facts, not_planned=tuple(not_planned))
    return Plan(world_size=world_size, backend=backend.name, precision=policy.name, epochs=counted,
                total_updates=total, scheduler_steps=scheduler_steps, memory=memory, comms=comms,
                problems=find_problems(facts), device_memory=device_memory, recompute=recomputation, step=step)


def _first_batch(data: Iterable[Any]) -> Any:
    if isinstance(data, DataLoader) and not isinstance(data.dataset, IterableDataset) and data.batch_size:
        size = min(data.batch_size, len(data.dataset))  # type: ignore[arg-type]  # map-style: sized
        return data.collate_fn([data.dataset[i] for i in range(size)])
    if isinstance(data, (list, tuple)):
        return data[0] if data else None
    return None  # an iterator would lose the batch; a stream would start its workers


def _context_part(step: Step, batch: Any, mesh: Mesh) -> Any:
    """Under ``context_parallel`` on several context ranks, context rank 0's part of ``batch``
    (what its forward holds); else ``batch``. Raises ValueError as ``split_batch``."""
    spec = step.find(ContextParallel)
    return batch if spec is None or mesh.context == 1 else context_parallel.split_batch(batch, spec, 0)


def _context_problem(step: Step, data: Iterable[Any], mesh: Mesh) -> str | None:
    """Why ``context_parallel`` cannot cut the first batch's sequences, or None."""
    batch = _first_batch(data) if step.find(ContextParallel) is not None else None
    if batch is None:
        return None
    try:
        _context_part(step, batch, mesh)
    except ValueError as e:
        return str(e)
    return None


def _tracing(step: Step, backend: Backend, policy: Any, split: ModelSplit | None,
             seen: dict[str, Any]) -> dict[str, Any]:
    """The loss, autocast, policy and device of a trace of ``step``'s micro-batch, recording in
    ``seen`` the loss function's metrics and, where ``split`` names layers, their inputs and
    outputs, and the values the pipeline's stages pass on. Under ``pipeline`` the forward runs
    through the model cut into its stages (each recomputed block of the fake model called
    whole, as ``prepare``'s cut does) and the loss takes the last stage's output and the
    batch's targets."""
    for key, empty in (("metrics", []), ("layers", {}), ("crossings", [])):
        seen.setdefault(key, empty)
    pp = step.find(Pipeline)

    def loss_of(model: torch.nn.Module, b: Any) -> torch.Tensor:
        modules = dict(model.named_modules())
        for layer in split.layers if split is not None else ():
            modules[layer.module].register_forward_hook(_layer_probe(layer.module, seen["layers"]))
        if pp is None and isinstance(step.loss_fn, OutputLoss):  # refused by the problems; traced whole
            inputs, targets = split_batch(b)
            out = step.loss_fn(model(*inputs), targets)
        elif pp is None:
            out = step.loss_fn(model, b)
        else:
            inputs, targets = split_batch(b)
            value: Any = inputs
            stages = cut(model, pp, frozenset(model.get_submodule(n) for n, _ in recomputing(model)))
            for i, stage in enumerate(stages):
                value = stage(*value) if i == 0 else stage(value)
                if i < len(stages) - 1:
                    seen["crossings"].append((tuple(value.shape), value.dtype))
            out = step.loss_fn(value, targets)
        loss, _, returned, is_sum = unpack(out)
        seen["metrics"].append((len(returned), is_sum))
        return loss

    def autocast() -> Any:
        return backend.autocast(policy)

    # on the GPU the fake copy is a CUDA one (CUDA's kernels and autocast); XLA's is traced on the CPU
    return {"loss_of": loss_of, "autocast": autocast, "policy": policy,
            "device": backend.device if backend.device.type == "cuda" else None}


def _trace(step: Step, state: TrainState, data: Iterable[Any], backend: Backend, policy: Any, split: ModelSplit,
           mesh: Mesh, recompute: CheckpointActivations | None) -> tuple[int, tuple[str, ...], Traced] | str:
    """(peak bytes of one micro-batch, parameters that got no gradient, what the collectives'
    sizes depend on), or why it was not traced; the blocks ``recompute`` chooses recompute."""
    batch = _first_batch(data)
    if batch is None:
        return "no first batch to trace (data that is not a map-style DataLoader or a list)"
    try:
        batch = _context_part(step, batch, mesh)  # a rank holds its part of each sequence
    except ValueError:  # the length does not divide: context-length-indivisible says so
        return "the batch's sequences cannot be cut over the context ranks"
    names: list[str] = []
    seen: dict[str, Any] = {}
    if recompute is not None and recompute.policy == "budget" and recompute.chosen is None:
        recompute = CheckpointActivations("full", recompute.modules)  # a budget not met: the most it recomputes
    try:
        peak = trace_micro_batch(state.model, batch, unused=names, adjust=adjusting(recompute),
                                 **_tracing(step, backend, policy, split, seen))
    except Exception as e:  # noqa: BLE001 - a forward that fake tensors cannot run: said in the plan
        return f"{type(e).__name__}: {str(e)[:300]}"
    metrics, is_sum = seen["metrics"][0]
    return peak, tuple(names), Traced(layers=seen["layers"], crossings=tuple(seen["crossings"]), metrics=metrics,
                                      item_counts=is_sum)


def _layer_probe(name: str, into: dict[str, Any]) -> Any:
    """A forward hook recording a layer's output and input (shapes, dtypes, whether the input
    requires a gradient) in ``into[name]``."""
    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        x = args[0] if args else None
        if isinstance(output, torch.Tensor) and isinstance(x, torch.Tensor):
            into[name] = (tuple(output.shape), output.dtype, tuple(x.shape), x.dtype, x.requires_grad)
    return hook


def _recomputation(step: Step, state: TrainState, data: Iterable[Any], backend: Backend, policy: Any,
                   facts: Facts, mesh: Mesh) -> tuple[Recomputation | None, Step, Facts]:
    """The plan of ``step``'s ``checkpoint_activations`` (None without it), ``step`` with its
    budget resolved, and the facts with what went wrong (a budget not met, a trace that failed);
    traced on the first batch as a rank holds it (its part of each sequence under context_parallel)."""
    spec = step.find(CheckpointActivations)
    if spec is None:
        return None, step, facts
    batch = _first_batch(data)
    if batch is None:
        return None, step, attrs.evolve(facts, trace_problem="no first batch to trace (data that is not a "
                                                             "map-style DataLoader or a list)")
    try:
        batch = _context_part(step, batch, mesh)
        planned, resolved, problem = plan_recomputation(spec, state.model, batch,
                                                        **_tracing(step, backend, policy, None, {}))
    except Exception as e:  # noqa: BLE001 - as _trace: said in the plan (a choice of no block: prepare's own error)
        return None, step, attrs.evolve(facts, trace_problem=f"{type(e).__name__}: {str(e)[:300]}")
    step = resolved_step(step, spec, resolved)
    return planned, step, attrs.evolve(facts, recompute_problem=problem, recompute_full=planned.peaks["full"])


def resolve_budget(step: Step, state: TrainState, data: Iterable[Any], backend: Backend) -> Step:
    """``step`` with its ``checkpoint_activations("budget")`` resolved to the blocks the trace of
    the data's first batch chooses (``run`` calls it before ``prepare``; every rank alike); any
    other ``step`` as it is.

    Raises:
        ValueError: no first batch to trace, a trace that fails, or a budget no choice meets.
    """
    spec = step.find(CheckpointActivations)
    if spec is None or spec.policy != "budget" or spec.chosen is not None:
        return step
    batch = _first_batch(data)
    if batch is None:
        raise ValueError(f"{spec!r} chooses its blocks from the trace of the data's first batch, and this data has "
                         "none to read ahead (not a map-style DataLoader or a list); name the blocks instead: "
                         "checkpoint_activations(modules=[...])")
    policy = backend.precision(with_launch_defaults(step, backend.env, warn=False))
    batch = _context_part(step, batch, Mesh.of(step, backend.world_size, backend.local_world_size))
    _, resolved, problem = plan_recomputation(spec, state.model, batch, **_tracing(step, backend, policy, None, {}))
    if problem:
        raise ValueError(f"{problem}; raise max_bytes, or make the micro-batch smaller (af.accumulate(n))")
    return resolved_step(step, spec, resolved)


#: errors that ``prepare`` and the data already raise before the first forward, with their own
#: exception types (NotImplementedError, ValueError) that callers catch: ``run`` leaves them to those
RAISED_ELSEWHERE = frozenset({"precision-unsupported", "shard-params-unsupported", "compile-unsupported",
                              "checkpoint-activations-unsupported",
                              "tensor-parallel-unsupported", "pipeline-unsupported", "invariant-unsupported",
                              "sampler-unshardable", "global-batch-indivisible", "shard-size-indivisible",
                              "data-unshardable", "resume-beyond-epoch", "world-indivisible",
                              "model-unsplittable"})


#: warnings about the plan itself, not the program: ``af.plan`` and ``accelfn plan`` show them, ``run`` does not
PLAN_ONLY = frozenset({"not-planned"})


def check_before_run(step: Step, state: TrainState, data: Iterable[Any], backend: Backend, epochs: int | None,
                     max_steps: int | None) -> Plan:
    """``run``'s check: the plan without tracing; raises ``PlanError`` naming every error (but
    those of ``RAISED_ELSEWHERE``) and warns of every warning (``PlanWarning``; not those of
    ``PLAN_ONLY``, about the plan rather than the program) on the main process; every rank
    computes the same plan, so every rank raises alike."""
    world_size = backend.world_size
    device_memory = None
    if backend.device.type == "cuda" and torch.cuda.is_available():
        device_memory = torch.cuda.get_device_properties(backend.device).total_memory
    result = _plan(step, state, data, backend, world_size, backend.local_world_size, epochs, max_steps,
                   device_memory, trace=False)
    errors = tuple(p for p in result.errors if p.code not in RAISED_ELSEWHERE)
    if errors and len(errors) < len(result.errors):  # name the others too: every error at once
        errors = result.errors
    if errors:
        raise PlanError(errors)
    if backend.is_main_process:
        for problem in result.warnings:
            if problem.code not in PLAN_ONLY:
                warnings.warn(str(problem), PlanWarning, stacklevel=4)
    return result


def show_plan(step: Step, state: TrainState, data: Iterable[Any], backend: Backend, epochs: int | None,
              max_steps: int | None) -> NoReturn:
    """``accelfn plan``: prints the plan for the launch's world size and exits the process,
    with status 1 if the plan has errors (0 otherwise), before anything is trained."""
    before = time.process_time()  # what the script cost up to here: building its model and data
    result = plan(step, state, data, backend=backend, epochs=epochs, max_steps=max_steps)
    print(result, flush=True)
    params = list(state.model.parameters())
    if params and all(p.device.type == "meta" for p in params):
        print(f"\nplanned in {time.process_time() - before:.1f} s of CPU; the model is on the meta device: "
              "nothing of it was allocated", flush=True)
    else:
        held = sum(p.numel() * p.element_size() for p in params)
        print(f"\nplanned in {time.process_time() - before:.1f} s of CPU, after {before:.1f} s of CPU in the script "
              f"before af.run, which built the model for real ({held / 2**20:.1f} MiB of parameters on "
              f"{params[0].device if params else 'no device'}); build it under torch.device('meta') to plan a model "
              "this machine cannot hold", flush=True)
    raise SystemExit(1 if result.errors else 0)
