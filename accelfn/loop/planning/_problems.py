"""The catalogue of misconfigurations a plan finds before the first forward.

Each check reads the plan's facts (the program, the state, the data, the world size, the
counts and bytes already computed) and returns problems: a stable ``code``, whether it is an
error (``run`` refuses the program) or a warning, what is wrong (with the values seen) and
the fix. docs/07-troubleshooting.md lists them all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sized
from typing import Any

import attrs
import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from accelfn.backends.base import Backend
from accelfn.data import num_batches
from accelfn.data.blocks import epoch_length
from accelfn.distributed import meta as meta_models
from accelfn.distributed.mesh import Mesh
from accelfn.loop.planning._counts import EpochCounts
from accelfn.loop.planning._memory import Memory
from accelfn.loop.planning._schedule import simulate
from accelfn.state import TrainState
from accelfn.step import Step
from accelfn.transforms import (
    Accumulate,
    DeepSpeed,
    Invariant,
    Pipeline,
    Replicate,
    ShardData,
    ShardParams,
    TensorParallel,
)
from accelfn.transforms.precision import Policy


@attrs.frozen
class Problem:
    """A misconfiguration.

    Attributes:
        code: a stable name, e.g. ``"global-batch-indivisible"`` (docs/07 lists them).
        error: True if ``run`` refuses the program, False for a warning.
        what: what is wrong, with the values seen.
        fix: how to fix it.
    """

    code: str
    error: bool
    what: str
    fix: str

    def __str__(self) -> str:
        return f"[{self.code}] {self.what}. Fix: {self.fix}"


@attrs.frozen
class Facts:
    """What the checks read: the run's arguments and what the plan computed of them."""

    step: Step
    state: TrainState
    data: Iterable[Any]
    backend: Backend
    world_size: int
    local_world_size: int
    policy: Policy
    epochs: int | None
    max_steps: int | None
    device_memory: int | None
    epochs_counted: tuple[EpochCounts, ...] = ()
    final_steps: tuple[int | None, ...] = ()
    count_error: str | None = None
    memory: tuple[Memory, ...] | None = None
    optimizer_problem: str | None = None
    trace_problem: str | None = None
    context_problem: str | None = None
    unused_params: tuple[str, ...] = ()
    scheduler_steps: int | None = None
    recompute_full: int | None = None
    recompute_problem: str = ""
    mesh: Mesh | None = None
    mesh_error: str | None = None
    split_error: str | None = None
    not_planned: tuple[str, ...] = ()

    @property
    def data_world_size(self) -> int:
        """The data shards the world reads (the mesh's data dimensions; the world without a mesh)."""
        return self.mesh.data_size if self.mesh is not None else self.world_size


Check = Callable[[Facts], Iterable[Problem]]
CHECKS: list[Check] = []


def _check(fn: Check) -> Check:
    CHECKS.append(fn)
    return fn


def find_problems(facts: Facts) -> tuple[Problem, ...]:
    """Every problem of the catalogue that ``facts`` show, errors first."""
    found = [p for check in CHECKS for p in check(facts)]
    return tuple(sorted(found, key=lambda p: not p.error))


def _loader(f: Facts) -> DataLoader | None:
    return f.data if isinstance(f.data, DataLoader) else None


def _map_size(f: Facts) -> int | None:
    loader = _loader(f)
    if loader is not None and not isinstance(loader.dataset, IterableDataset):
        return len(loader.dataset)  # type: ignore[arg-type]  # map-style: sized
    return None


def _parallel(f: Facts) -> Replicate | ShardParams | DeepSpeed | Invariant | None:
    """The data-parallel transform that makes the processes train one model, if any."""
    return f.step.find(Replicate) or f.step.find(ShardParams) or f.step.find(DeepSpeed) or f.step.find(Invariant)


@_check
def _global_batch(f: Facts) -> Iterable[Problem]:
    shard, loader = f.step.find(ShardData), _loader(f)
    world = f.data_world_size
    if shard is not None and shard.split_batches and loader is not None and loader.batch_size \
            and loader.batch_size % world:
        b = loader.batch_size
        yield Problem("global-batch-indivisible", True,
                      f"shard_data(split_batches=True) splits each global batch of {b} samples over {world} "
                      f"data shards, and {b} does not divide by {world}",
                      f"use a DataLoader batch_size that is a multiple of {world} (e.g. "
                      f"{math.ceil(b / world) * world}), or split_batches=False")


@_check
def _shard_size(f: Facts) -> Iterable[Problem]:
    shard = f.step.find(ShardParams)
    if shard is None or f.world_size == 1:
        return
    size = f.local_world_size if shard.shard_size == "node" else shard.shard_size
    if size is not None and f.world_size % size:
        yield Problem("shard-size-indivisible", True,
                      f"shard_params(shard_size={shard.shard_size!r}) groups ranks by {size}, and the world of "
                      f"{f.world_size} processes does not divide by it",
                      f"launch a multiple of {size} processes, or leave shard_size out to shard over all ranks")


@_check
def _sampler(f: Facts) -> Iterable[Problem]:
    loader = _loader(f)
    if f.step.find(ShardData) is None or loader is None:
        return
    if loader.batch_size is None:
        yield Problem("sampler-unshardable", True,
                      "shard_data() needs a DataLoader built with batch_size=...; this one has a custom "
                      "batch_sampler (or batch_size=None)",
                      "build DataLoader(dataset, batch_size=B, shuffle=...), or drop shard_data() and shard yourself")
    elif not isinstance(loader.dataset, IterableDataset):
        sampler = loader.sampler
        custom = not isinstance(sampler, (RandomSampler, SequentialSampler))
        if custom or isinstance(sampler, RandomSampler) and (sampler.replacement
                                                             or sampler._num_samples is not None):  # noqa: SLF001
            yield Problem("sampler-unshardable", True,
                          f"shard_data() replaces the DataLoader's sampler, and this {type(sampler).__name__} "
                          "(a custom one, or drawing with replacement) cannot be replaced without changing "
                          "what the run reads",
                          "build the DataLoader with shuffle=True/False, or drop shard_data() and shard yourself")


@_check
def _count_error(f: Facts) -> Iterable[Problem]:
    known = ("split_batches=True) splits each batch", "shard_size", "batch_size=None", "sampler")
    if f.count_error is not None and not any(k in f.count_error for k in known):
        what, _, fix = f.count_error.partition("; ")
        yield Problem("data-unshardable", True, what, fix or "see docs/07")


@_check
def _empty_ranks(f: Facts) -> Iterable[Problem]:
    if f.count_error is not None:
        return
    size = _map_size(f) if isinstance(f.data, DataLoader) else len(f.data) if isinstance(f.data, Sized) else None
    if not size:  # no data at all: run warns of an epoch that read nothing, as it always has
        return
    if f.step.find(Invariant) is not None:  # its blocks: the counts say whether an epoch has an update
        return
    shard, world = f.step.find(ShardData), f.data_world_size
    try:
        counts = {num_batches(f.data, shard, rank=r, world_size=world) for r in {0, world - 1}}
    except ValueError:
        return
    if 0 in counts:
        yield Problem("empty-rank", True,
                      f"some rank reads no micro-batch in an epoch ({size if size is not None else 'the'} samples "
                      f"over {world} data shards, after drop_last)",
                      "use fewer processes or a smaller batch size, or keep the last partial batch "
                      "(drop_last=False)")


@_check
def _dropped(f: Facts) -> Iterable[Problem]:
    size = _map_size(f)
    if not f.epochs_counted or size is None or not size:
        return
    dropped = f.epochs_counted[0].dropped
    if dropped is not None and dropped * 3 >= size:
        yield Problem("drop-last-large", True,
                      f"drop_last drops {dropped} of the {size} samples of every epoch on {f.world_size} processes",
                      "lower the batch size or the number of processes, or keep the tail (drop_last=False pads "
                      "it by wrapping)")


@_check
def _padding(f: Facts) -> Iterable[Problem]:
    size = _map_size(f)
    if not f.epochs_counted or not size:
        return
    padded = f.epochs_counted[0].padded
    total = sum(p for p in padded if p is not None)
    if total * 10 > size:
        yield Problem("padding-large", False,
                      f"shard_data pads {total} wrapped samples onto {size} per epoch ({f.world_size} processes): "
                      "they are trained on twice",
                      f"use a dataset size divisible by {f.world_size}, or shard_data(drop_last=True)")


@_check
def _precision(f: Facts) -> Iterable[Problem]:
    name = f.policy.name
    if name not in f.backend.supported_precisions:
        yield Problem("precision-unsupported", True,
                      f"the {f.backend.name} backend does not run with_precision({name!r})",
                      f"use one of {', '.join(map(repr, f.backend.supported_precisions))}")
    elif f.backend.device.type == "cuda" and torch.cuda.is_available() and name.startswith("bf16") \
            and not torch.cuda.is_bf16_supported():
        yield Problem("precision-unsupported", True,
                      f"{torch.cuda.get_device_name(f.backend.device)} has no bfloat16 support for "
                      f"with_precision({name!r})",
                      "use with_precision('fp16') (dynamic loss scaling) or 'fp32'")


@_check
def _scheduler(f: Facts) -> Iterable[Problem]:
    """The schedule, stepped on a copy over the run's updates and past them (``_schedule``),
    raises before the run ends (an error) or ends after it (a warning: sized for the
    micro-batches, the processes' updates, or any other count above the run's)."""
    scheduler, steps = f.state.scheduler, f.scheduler_steps
    if scheduler is None or steps is None:
        return
    now = int(getattr(scheduler, "last_epoch", f.state.step))
    micro = f.state.micro_step + sum((e.micro_batches[0] or 0) * e.num_epochs for e in f.epochs_counted)
    horizon = 2 * max(steps, micro, steps * f.world_size) + 1
    trajectory = simulate(scheduler, f.state.optimizer, horizon - now, shared=(f.state.model,))
    if trajectory is None:
        return
    kind = type(scheduler).__name__
    if trajectory.raised_at is not None and now + trajectory.raised_at <= steps:
        yield Problem("scheduler-too-short", True,
                      f"{kind} is stepped once per optimizer update, and this run applies {steps - now}"
                      f"{f' more (to scheduler step {steps})' if now else ''}: it raises at update "
                      f"{now + trajectory.raised_at} ({trajectory.error})",
                      f"size it with af.plan(...).scheduler_steps or af.count_updates(...).total ({steps}), "
                      "not the number of batches")
        return
    end = trajectory.end()
    if end is None or now + end <= steps:
        return
    end += now
    hint = " (the micro-batches)" if end in (micro, micro - 1) else f" ({steps} x {f.world_size} processes)" \
        if f.world_size > 1 and end in (steps * f.world_size, steps * f.world_size - 1) else ""
    lrs = trajectory.lrs[steps - now]
    yield Problem("scheduler-not-finished", False,
                  f"{kind} ends at scheduler step {end}{hint}, and the run applies only {steps} optimizer "
                  f"updates: the schedule stops part-way (lr {', '.join(f'{lr:.3g}' for lr in lrs)} at the end, "
                  f"{', '.join(f'{lr:.3g}' for lr in trajectory.lrs[end - now])} at its own end)",
                  f"size it for {steps} steps (af.plan(...).scheduler_steps: schedules count optimizer "
                  "updates, not micro-batches or processes)")


@_check
def _iterable_readers(f: Facts) -> Iterable[Problem]:
    loader = _loader(f)
    if loader is None or not isinstance(loader.dataset, IterableDataset) or f.step.find(ShardData) is None:
        return
    try:
        items = len(loader.dataset)  # type: ignore[arg-type]  # an IterableDataset may define __len__
    except TypeError:
        return
    readers = f.data_world_size * max(1, loader.num_workers)
    if items < readers:
        yield Problem("iterable-empty-readers", True,
                      f"the IterableDataset has {items} items for {readers} readers ({f.data_world_size} data shards x "
                      f"{max(1, loader.num_workers)} workers): some read nothing",
                      f"use at most {items} processes x workers, or a dataset with at least {readers} items")


def _mib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@_check
def _fits(f: Facts) -> Iterable[Problem]:
    if f.device_memory is None or not f.memory:
        return
    worst = max(f.memory, key=lambda m: m.device_peak)
    if worst.device_peak <= f.device_memory:
        return
    options = []
    if f.step.find(ShardParams) is None and f.world_size > 1:
        per = math.ceil((worst.params + worst.grads + worst.optimizer) / f.world_size)
        options.append(f"af.shard_params() (about {_mib(per + worst.buffers)} of state per rank on "
                       f"{f.world_size} processes)")
    if f.step.find(ShardParams) is not None and not f.step.find(ShardParams).offload:  # type: ignore[union-attr]
        options.append("shard_params(offload=True) (the state in CPU memory)")
    if worst.micro_batch and f.recompute_full is not None and f.recompute_full < worst.micro_batch:
        options.append(f"af.checkpoint_activations() (its blocks recomputed in the backward: a micro-batch peak of "
                       f"{_mib(f.recompute_full)} instead of {_mib(worst.micro_batch)}, "
                       f"{_mib(worst.micro_batch - f.recompute_full)} less per rank)")
    if worst.micro_batch:
        options.append("a smaller micro-batch with af.accumulate(n) (the same update, 1/n of the activations)")
    yield Problem("exceeds-device-memory", True,
                  f"the planned peak per rank is {_mib(worst.device_peak)} (parameters {_mib(worst.params)}, gradients "
                  f"{_mib(worst.grads)}, optimizer {_mib(worst.optimizer)}, micro-batch "
                  f"{_mib(worst.micro_batch or 0)}), more than the device's {_mib(f.device_memory)}",
                  "; or ".join(options) or "a smaller model or micro-batch")


@_check
def _recompute_budget(f: Facts) -> Iterable[Problem]:
    if f.recompute_problem:
        yield Problem("recompute-budget-unreachable", True, f.recompute_problem,
                      "raise max_bytes, shard or split the model's activations (tensor_parallel), or make the "
                      "micro-batch smaller with af.accumulate(n)")


@_check
def _xla_cpu(f: Facts) -> Iterable[Problem]:
    if f.backend.name == "xla" and getattr(f.backend, "hardware", None) == "CPU" and f.world_size > 1:
        yield Problem("xla-cpu-multiprocess", True,
                      f"XLA on PJRT's CPU client has no collectives across {f.world_size} processes",
                      "use the cpu backend (accelfn launch --backend cpu) for several CPU processes")


@_check
def _resume_position(f: Facts) -> Iterable[Problem]:
    if f.state.epoch_micro_step == 0 or f.count_error is not None:
        return
    data_rank, data_world = f.mesh.data_coordinates(0) if f.mesh is not None else (0, f.world_size)
    try:
        per_epoch = epoch_length(f.data, f.step, rank=data_rank, world_size=data_world)
    except ValueError:
        return
    if per_epoch is not None and f.state.epoch_micro_step > per_epoch:
        yield Problem("resume-beyond-epoch", True,
                      f"the state is at micro-batch {f.state.epoch_micro_step} of epoch {f.state.epoch}, and an "
                      f"epoch has {per_epoch} micro-batches per rank on {f.world_size} processes",
                      "resume with the world size, batch size and data the checkpoint was written with")


def _names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


@_check
def _optimizer_coverage(f: Facts) -> Iterable[Problem]:
    names = _names(f.state.model)
    in_optimizer = {id(p) for g in f.state.optimizer.param_groups for p in g["params"]}
    missing = [n for i, n in names.items() if i not in in_optimizer
               and dict(f.state.model.named_parameters())[n].requires_grad]
    if missing:
        yield Problem("param-not-in-optimizer", False,
                      f"{len(missing)} trainable parameter(s) are not in the optimizer ({', '.join(missing[:4])}"
                      f"{', ...' if len(missing) > 4 else ''}): they get gradients and are never updated",
                      "pass model.parameters() to the optimizer, or set requires_grad=False on those parameters")
    frozen = [names[id(p)] for g in f.state.optimizer.param_groups if g.get("weight_decay", 0)
              for p in g["params"] if not p.requires_grad and id(p) in names]
    if frozen:
        yield Problem("frozen-weight-decay", False,
                      f"{len(frozen)} frozen parameter(s) ({', '.join(frozen[:4])}) sit in a parameter group "
                      "with weight_decay > 0: they hold optimizer slots and are never updated",
                      "leave frozen parameters out of the optimizer: "
                      "optimizer(p for p in model.parameters() if p.requires_grad)")
    if not any(p.requires_grad for p in f.state.model.parameters()):
        yield Problem("nothing-trainable", True, "no parameter of the model requires a gradient",
                      "unfreeze some parameters (requires_grad=True) before training")


@_check
def _unused(f: Facts) -> Iterable[Problem]:
    replicate = f.step.find(Replicate)
    if f.unused_params and replicate is not None and f.world_size > 1 and not replicate.find_unused_parameters:
        yield Problem("unused-parameters", True,
                      f"the traced micro-batch gives no gradient to {', '.join(f.unused_params[:4])}"
                      f"{', ...' if len(f.unused_params) > 4 else ''}, and DDP waits for every parameter's "
                      "gradient: the second update fails",
                      "af.replicate(find_unused_parameters=True), or set requires_grad=False on those parameters")


@_check
def _tied_across_units(f: Facts) -> Iterable[Problem]:
    shard = f.step.find(ShardParams)
    if shard is None or f.world_size == 1:
        return
    owner: dict[int, str] = {}
    split = set()
    names = _names(f.state.model)
    for unit_name, unit in shard.select(f.state.model):
        for p in unit.parameters():
            if id(p) in owner and not unit_name.startswith(owner[id(p)]) and not owner[id(p)].startswith(unit_name):
                split.add(names.get(id(p), unit_name))
            owner.setdefault(id(p), unit_name)
    units = [name for name, _ in shard.select(f.state.model)]
    outside = {id(p) for name, m in f.state.model.named_modules() if name and not any(
        name == u or name.startswith(u + ".") for u in units) for p in m.parameters(recurse=False)}
    for unit_name, unit in shard.select(f.state.model):
        split.update(names[id(p)] for p in unit.parameters() if id(p) in outside and id(p) in names)
    if split:
        yield Problem("tied-weights-split", True,
                      f"tied parameter(s) {', '.join(sorted(split)[:4])} are used by more than one shard_params "
                      "unit (or a unit and the root), and FSDP2 shards each parameter in one unit only",
                      "choose units that keep tied modules together (shard_params(units=...)), e.g. leave the "
                      "embedding and the output layer in the root")


@_check
def _data_parallel(f: Facts) -> Iterable[Problem]:
    if f.world_size == 1:
        return
    shard = f.step.find(ShardData)
    if _parallel(f) is not None and shard is None and isinstance(f.data, DataLoader):
        yield Problem("replicate-without-shard-data", False,
                      f"{_parallel(f).verb}() over {f.world_size} processes without shard_data(): every rank "  # type: ignore[union-attr]
                      "reads the DataLoader as it is (the same batches, unless each rank built its own)",
                      "add af.shard_data() so each process reads its own shard of one dataset")
    if shard is not None and _parallel(f) is None and f.step.find(TensorParallel) is None \
            and f.step.find(Pipeline) is None:
        yield Problem("shard-data-alone", False,
                      f"shard_data() over {f.world_size} processes without replicate() or shard_params(): each "
                      "process trains its own model on its own shard",
                      "add af.replicate() (or af.shard_params()) to train one model")


@_check
def _one_process(f: Facts) -> Iterable[Problem]:
    shard = f.step.find(ShardParams)
    if shard is not None and f.world_size == 1 and not shard.offload:
        yield Problem("shard-params-one-process", False,
                      "shard_params() on one process shards nothing: the model trains unsharded",
                      "launch several processes (accelfn launch --nproc-per-node N), or drop shard_params()")


@_check
def _accumulate(f: Facts) -> Iterable[Problem]:
    accumulate = f.step.find(Accumulate)
    full = f.epochs_counted[0].micro_batches[0] if f.epochs_counted and f.state.epoch_micro_step == 0 \
        and f.max_steps is None else None
    if accumulate is not None and full is not None and 0 < full < accumulate.num_micro_batches:
        yield Problem("accumulate-longer-than-epoch", False,
                      f"accumulate({accumulate.num_micro_batches}) windows are longer than an epoch of {full} "
                      "micro-batches per rank: every update is a partial window",
                      f"use accumulate(n) with n <= {full}, or a smaller batch size")


@_check
def _backend_support(f: Facts) -> Iterable[Problem]:
    try:
        refused = f.backend.unsupported(f.step, f.state, world_size=f.world_size)
    except ValueError:  # a world the transforms cannot divide: a count problem already
        return
    for name, reason in refused:
        what, _, fix = reason.partition("; ")
        yield Problem(f"{name.replace('_', '-')}-unsupported", True, what, fix or f"drop {name}() on this backend")


@_check
def _nothing_to_do(f: Facts) -> Iterable[Problem]:
    if f.state.stopped is not None:
        yield Problem("nothing-to-train", False,
                      f"the state stopped at step {f.state.stopped.step} ({f.state.stopped.reason}): run trains nothing",
                      "pass run(..., continue_after_stop=True) to train on")
    elif f.max_steps is not None and f.state.step >= f.max_steps:
        yield Problem("nothing-to-train", False,
                      f"the state is at step {f.state.step}, at or past max_steps={f.max_steps}: run trains nothing",
                      "raise max_steps (a total over the whole job, not the updates of this call)")


@_check
def _unplanned(f: Facts) -> Iterable[Problem]:
    if f.optimizer_problem:
        yield Problem("optimizer-unplanned", False, f.optimizer_problem,
                      "the plan counts no optimizer state; measure it after the first update")
    if f.trace_problem:
        yield Problem("trace-failed", False, f"the micro-batch could not be traced on fake tensors: {f.trace_problem}",
                      "the plan has no activation peak; plan(trace=False) skips the trace")


@_check
def _context_length(f: Facts) -> Iterable[Problem]:
    if f.context_problem:
        what, _, fix = f.context_problem.partition("; ")
        yield Problem("context-length-indivisible", True, f"the first batch: {what}", fix)


@_check
def _meta(f: Facts) -> Iterable[Problem]:
    meta = [n for n, p in f.state.model.named_parameters() if p.device.type == "meta"]
    if meta and not meta_models.fills(f.step):  # shard_params or tensor_parallel: prepare fills each rank's part
        yield Problem("meta-model", False,
                      f"{len(meta)} parameter(s) are on the meta device ({meta[0]}, ...): a plan needs no more, "
                      "training does, and prepare fills such a model only for a program that shards or splits it",
                      "add shard_params() or tensor_parallel(...) (prepare then fills each rank's part), or "
                      "materialize the model (model.to_empty(device=...) and initialize it) before af.run")


@_check
def _layout(f: Facts) -> Iterable[Problem]:
    if f.mesh_error is not None and "shard_size" not in f.mesh_error:
        what, _, fix = f.mesh_error.partition("; ")
        yield Problem("world-indivisible", True, what, fix or "launch a multiple of the ranks one model spans")
    if f.split_error is not None:
        what, _, fix = f.split_error.partition("; ")
        yield Problem("model-unsplittable", True, what, fix or "see docs/11")


@_check
def _not_planned(f: Facts) -> Iterable[Problem]:
    for what in f.not_planned:
        yield Problem("not-planned", False, f"{what}: no rule of the plan models it, so the plan gives no number "
                      "for it", "measure it on a real run (docs/13 lists what the plan models)")
