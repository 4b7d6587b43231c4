"""The collectives of a plan: what one optimizer update sends, per rank, in order.

- ``replicate`` (DDP): one all-reduce per gradient bucket on a window's last micro-batch
  (``no_sync`` before it). From the second update on DDP uses buckets rebuilt in the order the
  gradients became ready, cut by ``torch.distributed._compute_bucket_assignment_by_size`` at
  ``bucket_cap_mb`` (torch < 2.10: the first bucket at 1 MiB); the plan takes the ready
  order to be the reverse of the parameters' registration order (the backward's order for a
  model whose forward uses its modules in the order they are defined). The first update
  all-reduces one bucket of every gradient. A model with buffers has them broadcast from
  rank 0 (coalesced per dtype) before the forward of a window's last micro-batch (DDP skips it
  under ``no_sync``).
- ``shard_params`` (FSDP2) over ``D`` ranks: per micro-batch an all-gather per unit before
  its forward (the root's too) and again before each non-root unit's backward (none with
  ``reshard_after_forward=False``), then a reduce-scatter per unit on the window's last
  micro-batch (every micro-batch with ``reduce_every_micro_batch``); elements are the
  unit's parameters padded to a multiple of ``D`` rows; gathered in the compute dtype of an
  autocast policy, reduced in fp32. ``clip`` adds one scalar fp32 all-reduce of the norm.
  Under ``with_precision("fp8", float8_all_gather=True)`` the converted weights travel in
  float8 (1 byte) beside the unit's other parameters in the compute dtype, in one buffer of
  bytes (FSDP2 gathers mixed dtypes as ``uint8``; a unit of float8 weights only, as
  float8), and each update adds one fp32 all-reduce of one amax per converted weight
  (torchao's ``precompute_float8_dynamic_scale_for_fsdp``).
- ``replicate(comm_hook=...)``: each bucket all-reduced in the hook's dtype
  (``distributed.ddp.bucket_dtype``: fp16 or bf16 compression); a hook with collectives of its
  own (PowerSGD) is not planned.
- ``tensor_parallel`` over ``t`` ranks (``distributed.tensor_parallel.layer_splits``): per
  micro-batch an all-reduce of each row-wise layer's output in the forward, of each
  column-wise layer's input gradient in the backward (where the input requires one), an
  all-gather of a gathered column-wise output; sizes and dtypes from the traced micro-batch.
  ``clip`` adds a float32 all-reduce of the norm per mesh dimension a layout is split along.
- ``pipeline``: per micro-batch rank 0's stages send their activation to the next stage and
  receive its gradient (point to point; the shapes from the micro-batch traced through the
  cut stages), the window's sums broadcast from the last stage, under ``replicate`` (or any
  replicate dimension) the stage's gradients all-reduced over the replicas, ``clip``'s norm
  over the pipe group.
- ``invariant()``: the canonical sum (``distributed.canonical``): a send and a receive of the
  flat gradients and of the window's sums per round of rank 0's power-of-two block, a
  broadcast of each block's root otherwise; every rank's subtrees all-gathered for an ``A``
  that is no power of two.
- ``deepspeed()``: DeepSpeed's collectives by kind and dtype (their sizes are its buckets').
- Every logged update (``log_every``) on W > 1 reduces the metrics: one float64 sum
  all-reduce of the metrics and counts and one float64 max all-reduce of the memory.

Bytes on the wire per rank follow the ring algorithms: an all-reduce of ``B`` bytes sends
``2 (W-1)/W B``, an all-gather or reduce-scatter whose whole is ``B`` sends ``(W-1)/W B``, a
broadcast ``B`` (its root; counted for every rank alike), a send ``B`` (a receive nothing).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.nn.parallel.distributed as ddp_module

from accelfn.distributed import ddp as ddp_rules
from accelfn.distributed import float8
from accelfn.distributed.canonical import blocks
from accelfn.distributed.deepspeed import offloaded
from accelfn.distributed.pipeline import stage_indices
from accelfn.loop.planning._split import ModelSplit, whole
from accelfn.step import Step
from accelfn.transforms import (
    Clip,
    DeepSpeed,
    Invariant,
    Pipeline,
    Replicate,
    ShardParams,
    SkipNonfinite,
    TensorParallel,
)
from accelfn.transforms.deepspeed import enabled_precisions, engine_config, micro_batches_per_update
from accelfn.transforms.invariant import stack_sizes
from accelfn.transforms.precision import Policy

_MIB = 1024 * 1024


@attrs.frozen
class Collective:
    """One collective of an update.

    Attributes:
        kind: ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``, ``"broadcast"``, or
            ``"send"``/``"recv"`` (point to point).
        dtype: the element type, e.g. ``torch.float32``.
        elements: the elements of the whole tensor (the gathered or scattered one for
            all-gather and reduce-scatter, one rank's for all-reduce, broadcast, send and
            receive); None for an activation's where the micro-batch was not traced.
        what: what it carries (``"DDP bucket 0"``, ``"gather layers.0"``, ``"clip norm"``).
        count: how many times per update (micro-batches, or once).
        wire_bytes: bytes one rank sends for it, per time (ring algorithms; a send its
            tensor, a receive nothing); None where ``elements`` is.
        per_log: True for the metric reductions, issued once per logged update.
    """

    kind: str
    dtype: torch.dtype
    elements: int | None
    what: str
    count: int = 1
    wire_bytes: int | None = 0
    per_log: bool = False

    @property
    def bytes(self) -> int | None:
        """The tensor's bytes (``elements`` times the element size; None where not known)."""
        return None if self.elements is None else self.elements * self.dtype.itemsize


def _wire(kind: str, nbytes: int | None, world_size: int) -> int | None:
    if nbytes is None:
        return None
    if world_size == 1 or kind == "recv":
        return 0
    if kind == "all_reduce":
        return 2 * (world_size - 1) * nbytes // world_size
    if kind in ("all_gather", "reduce_scatter"):
        return (world_size - 1) * nbytes // world_size
    return nbytes


def _make(kind: str, dtype: torch.dtype, elements: int | None, what: str, world_size: int, count: int = 1,
          per_log: bool = False) -> Collective:
    size = None if elements is None else elements * dtype.itemsize
    return Collective(kind, dtype, elements, what, count, _wire(kind, size, world_size), per_log)


def ddp_buckets(params: list[torch.nn.Parameter], bucket_cap_mb: float) -> list[list[int]]:
    """DDP's steady-state buckets: indices into ``params`` (in registration order), the buckets
    in the order they are all-reduced, as ``DistributedDataParallel`` rebuilds them after its
    first iteration (first bucket 1 MiB with the default cap, then ``bucket_cap_mb``)."""
    ready = [i for i in reversed(range(len(params))) if params[i].requires_grad]
    if not ready:
        return []
    cap = int(bucket_cap_mb * _MIB)
    # accelfn passes bucket_cap_mb explicitly: torch >= 2.10 then sizes the first bucket like the
    # others (its _BucketCapacityConfig); older torch always cut the first at 1 MiB
    first = cap if hasattr(ddp_module, "_BucketCapacityConfig") else dist._DEFAULT_FIRST_BUCKET_BYTES  # noqa: SLF001
    limits = [first, cap] if first < cap else [cap]
    metas = [torch.empty(params[i].shape, dtype=params[i].dtype, device="meta") for i in ready]
    buckets, _ = dist._compute_bucket_assignment_by_size(metas, limits, [False] * len(metas))  # noqa: SLF001
    return [[ready[j] for j in bucket] for bucket in buckets]


def metric_count(step: object, optimizer: torch.optim.Optimizer, policy: Policy, user_metrics: int) -> int:
    """The metrics ``run`` reduces at each log: loss, lr (and ``lr/group{i}`` for groups of
    different learning rates), grad_norm under clip, skipped and loss_scale where updates may be
    skipped, and the loss function's own."""
    find = step.find  # type: ignore[attr-defined]
    lrs = {g["lr"] for g in optimizer.param_groups}
    count = 2 + (len(optimizer.param_groups) if len(optimizer.param_groups) > 1 and len(lrs) > 1 else 0)
    count += find(Clip) is not None
    count += (policy.scaling is not None or find(SkipNonfinite) is not None) + (policy.scaling is not None)
    return count + user_metrics


@attrs.frozen
class Traced:
    """What the traced micro-batch showed that the collectives' sizes depend on.

    Attributes:
        layers: each tensor-parallel layer's ``(output shape, output dtype, input shape, input
            dtype, input requires grad)`` in one micro-batch's forward, by module name.
        crossings: under ``pipeline``, the ``(shape, dtype)`` of the value that flows from each
            stage into the next, in stage order.
        metrics: the loss function's own metrics.
        item_counts: the loss function returned an ``af.Loss``.
    """

    layers: dict[str, tuple[tuple[int, ...], torch.dtype, tuple[int, ...], torch.dtype, bool]] = attrs.Factory(dict)
    crossings: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ()
    metrics: int = 0
    item_counts: bool = False


def collectives_per_update(step: Step, model: torch.nn.Module, policy: Policy, split: ModelSplit, *,
                           traced: Traced | None = None, num_metrics: int = 2,
                           memory_values: int = 1) -> tuple[tuple[Collective, ...], tuple[str, ...]]:
    """The collectives of one (steady-state) optimizer update on rank 0, and what of them the
    plan cannot model (named). The metric reductions (``per_log``) come once per logged update,
    here with ``num_metrics`` metrics and ``memory_values`` memory readings (RSS, and the
    device's peak on CUDA). Sizes of activations (tensor-parallel layers, pipeline stages)
    come from ``traced``: without a trace they are None."""
    mesh = split.mesh
    world_size = mesh.world_size
    if world_size == 1:
        return (), ()
    guard = policy.scaling is not None or step.find(SkipNonfinite) is not None
    n = micro_batches_per_update(step)
    params = whole(model.parameters())
    out: list[Collective] = []
    unknown: list[str] = []
    replicate, shard = step.find(Replicate), step.find(ShardParams)
    pp, tp, ds, invariant = step.find(Pipeline), step.find(TensorParallel), step.find(DeepSpeed), step.find(Invariant)
    over_ranks = guard  # the non-finite verdict summed over every rank (each saw a part)
    if ds is not None:
        out.extend(_deepspeed(step, ds, params, policy, mesh, n))
        over_ranks = False
        unknown.append("deepspeed(): the sizes of DeepSpeed's own collectives (its buckets: reduce_bucket_size, "
                       "allgather_bucket_size, ZeRO-3's prefetch and persistent parameters; only their kinds and "
                       "dtypes are planned)")
        if ds.stage == 0 and policy.name in ("bf16", "fp16") or ds.stage == 0 and enabled_precisions(ds.config):
            unknown.append("deepspeed() at ZeRO stage 0 with bf16 or fp16: the master weights and collectives of "
                           "DeepSpeed's mixed-precision optimizer wrapper (planned as without it)")
    elif pp is not None:
        out.extend(_pipeline(step, pp, params, policy, split, traced, n))
    elif invariant is not None:
        out.extend(_invariant(params, policy, mesh, n, traced))
        over_ranks = guard and shard is not None and mesh.fsdp_size > 1
        if shard is not None and mesh.fsdp_size > 1:
            unknown.append("invariant() with shard_params(): FSDP2's all-gathers of the parameters are not planned")
    else:
        if replicate is not None and mesh.replicas > 1:
            out.extend(_ddp(model, params, policy, replicate, mesh, unknown))
            over_ranks = False
        if split.sharded and shard is not None:
            out.extend(_fsdp(model, shard, policy, split, n))
            if mesh.replicate > 1:  # hybrid: the sharded gradients all-reduced across the groups
                out.extend(_make("all_reduce", c.dtype, (c.elements or 0) // mesh.fsdp_size,
                                 c.what.replace("reduce-scatter", "replica all-reduce"), mesh.replicate, c.count)
                           for c in list(out) if c.kind == "reduce_scatter")
        if tp is not None and mesh.tensor > 1:
            out.extend(_tensor_parallel(split, traced, n, mesh.tensor))
            unknown.extend(f"tensor_parallel(): the collectives of {what}" for what in split.unknown)
        if step.find(Clip) is not None:
            out.extend(_norm_reductions(params, split))
        over_ranks = guard and (split.sharded or (tp is not None and mesh.tensor > 1))
    if over_ranks:
        out.append(_make("all_reduce", torch.float32, 1, "non-finite check", world_size))
    out.append(_make("all_reduce", torch.int64, 4, "metric names agree", world_size, per_log=True))
    out.append(_make("all_reduce", torch.float64, num_metrics + 1, "metrics (sum)", world_size, per_log=True))
    out.append(_make("all_reduce", torch.float64, memory_values, "memory (max)", world_size, per_log=True))
    return tuple(out), tuple(unknown)


def _ddp(model: torch.nn.Module, params: list[torch.nn.Parameter], policy: Policy, replicate: Replicate,
         mesh: Any, unknown: list[str]) -> list[Collective]:
    """DDP: the buffers broadcast, one all-reduce per bucket in the comm hook's dtype."""
    out: list[Collective] = []
    by_dtype: dict[torch.dtype, int] = {}
    for b in model.buffers():
        by_dtype[_stored(b, policy)] = by_dtype.get(_stored(b, policy), 0) + b.numel()
    out.extend(_make("broadcast", dtype, elements, "DDP buffers", mesh.replicas) for dtype, elements in by_dtype.items())
    for i, bucket in enumerate(ddp_buckets(params, replicate.bucket_cap_mb)):
        dtype = ddp_rules.bucket_dtype(replicate.comm_hook, _stored(params[bucket[0]], policy))
        if dtype is None:
            unknown.append(f"replicate(comm_hook={ddp_rules.hook_name(replicate.comm_hook)}): the hook's own "
                           "collectives of each gradient bucket")
            return out
        out.append(_make("all_reduce", dtype, sum(params[j].numel() for j in bucket), f"DDP bucket {i}",
                         mesh.replicas))
    return out


def _tensor_parallel(split: ModelSplit, traced: Traced | None, n: int, size: int) -> list[Collective]:
    """Each split layer's all-reduce of its output (row-wise) per forward, of its input's
    gradient (column-wise, where the input requires one) per backward, and the all-gather of
    a gathered column-wise output, over the tensor-parallel group: ``n`` times an update."""
    out = []
    for layer in split.layers:
        seen = traced.layers.get(layer.module) if traced is not None else None
        out_numel = math.prod(seen[0]) if seen else None
        in_numel = math.prod(seen[2]) if seen else None
        out_dtype = seen[1] if seen else torch.float32
        in_dtype = seen[3] if seen else torch.float32
        if layer.reduces_output:
            out.append(_make("all_reduce", out_dtype, out_numel, f"TP output {layer.module}", size, count=n))
        if layer.gathers_output:
            out.append(_make("all_gather", out_dtype, out_numel, f"TP gather {layer.module}", size, count=n))
        if layer.reduces_input_grad and (seen is None or seen[4]):
            maybe = "" if seen else " (if its input needs a gradient: not traced)"
            out.append(_make("all_reduce", in_dtype, in_numel, f"TP input grad {layer.module}{maybe}", size,
                             count=n))
    return out


def _norm_reductions(params: list[torch.nn.Parameter], split: ModelSplit) -> list[Collective]:
    """``clip``'s norm over meshes (``distributed.grad_norm``): one float32 all-reduce per mesh
    dimension along which a layout's gradients differ, per distinct layout."""
    mesh = split.mesh
    layouts = []
    for p in params:
        if not p.requires_grad:
            continue
        dims = tuple(d for d, differs in (("shard", split.sharded),
                                          ("tensor", id(p) in split.tensor_dims and mesh.tensor > 1)) if differs)
        if dims and dims not in layouts:
            layouts.append(dims)
    return [_make("all_reduce", torch.float32, 1, f"clip norm ({dim})", getattr(mesh, dim))
            for dims in layouts for dim in dims]


def _pipeline(step: Step, pp: Pipeline, params: list[torch.nn.Parameter], policy: Policy, split: ModelSplit,
              traced: Traced | None, n: int) -> list[Collective]:
    """Rank 0's stages: per micro-batch the activation each sends to the next stage and the
    gradient it gets back (and the reverse for a stage after the first), point to point; the
    window's sums broadcast from the last stage; under ``replicate`` the stage's gradients
    all-reduced over its replicas; ``clip``'s norm over the pipe group."""
    mesh = split.mesh
    out = []
    last = pp.num_stages - 1
    for stage in stage_indices(pp, 0):
        for to, s in ((stage + 1, stage), (stage - 1, stage - 1)):
            if not 0 <= to <= last:
                continue
            shape, dtype = traced.crossings[s] if traced is not None and traced.crossings else (None, torch.float32)
            elements = math.prod(shape) if shape is not None else None
            forward = to > stage
            out.append(_make("send", dtype, elements, f"stage {stage} {'activation' if forward else 'gradient'} "
                                                     f"to stage {to}", pp.size, count=n))
            out.append(_make("recv", dtype, elements, f"stage {stage} {'gradient' if forward else 'activation'} "
                                                     f"from stage {to}", pp.size, count=n))
    metrics = traced.metrics if traced is not None else 0
    out.append(_make("broadcast", torch.float64, 4 + metrics, "window sums from the last stage", pp.size))
    held = [p for p in params if p.requires_grad and split.holds(p, 0)]
    if mesh.replicate > 1 and held:
        if traced is not None and traced.item_counts:
            out.append(_make("all_reduce", torch.float64, 1, "window items over replicas", mesh.replicate))
        dtype = functools.reduce(torch.promote_types, (_stored(p, policy) for p in held))
        out.append(_make("all_reduce", dtype, sum(p.numel() for p in held), "stage gradients over replicas",
                         mesh.replicate))
    if step.find(Clip) is not None:
        out.append(_make("all_reduce", torch.float32, 1, "clip norm (pipe)", pp.size))
    return out


def _invariant(params: list[torch.nn.Parameter], policy: Policy, mesh: Any, n: int,
               traced: Traced | None) -> list[Collective]:
    """``distributed.canonical``'s sum of the flat gradients and the window's sums: per round of
    the butterfly in rank 0's power-of-two block, a send and a receive of each; a broadcast of
    each block's root where ``W`` is no power of two; with ``A`` no power of two on several ranks,
    every rank's subtrees all-gathered instead (their count, starts, gradients and sums)."""
    world = mesh.world_size
    numel = sum(p.numel() for p in params)
    dtype = functools.reduce(torch.promote_types, (_stored(p, policy) for p in params))
    sums = 2 + (traced.metrics if traced is not None else 0)
    if n & (n - 1):
        most = max(max(stack_sizes(rank=r, world_size=world, num_micro_batches=n)) for r in range(world))
        return [_make("all_gather", torch.int64, world, "subtree counts", world),
                _make("all_gather", torch.int64, world * most * 2, "subtree starts", world),
                _make("all_gather", dtype, world * most * numel, "subtree gradients", world),
                _make("all_gather", torch.float64, world * most * sums, "subtree sums", world)]
    layout = blocks(world)
    out = []
    for _ in range(layout[0][1].bit_length() - 1):  # rank 0's block: log2 of its size rounds
        out += [_make("send", dtype, numel, "canonical sum: gradients", 2),
                _make("send", torch.float64, sums, "canonical sum: window sums", 2),
                _make("recv", dtype, numel, "canonical sum: gradients", 2),
                _make("recv", torch.float64, sums, "canonical sum: window sums", 2)]
    if len(layout) > 1:
        for start, _ in layout:
            out += [_make("broadcast", dtype, numel, f"canonical sum: block root {start}", world),
                    _make("broadcast", torch.float64, sums, f"canonical sum: block sums {start}", world)]
    return out


def _deepspeed(step: Step, ds: DeepSpeed, params: list[torch.nn.Parameter], policy: Policy, mesh: Any,
               n: int) -> list[Collective]:
    """DeepSpeed's collectives of an update by kind and dtype, in the engine's parameter dtype
    (their sizes are DeepSpeed's buckets: None here), as DeepSpeed 0.16+ issues them on gloo
    and NCCL. ZeRO-0: the gradients all-reduced (and under ``clip`` the norm, float32);
    ZeRO-1/2: the gradients all-reduced (ZeRO-2: every micro-batch), the updated partitions
    all-gathered, the norm all-reduced in float32 (bf16/fp16: also a uint8 overflow flag);
    ZeRO-3: the parameters all-gathered and the gradients reduce-scattered every micro-batch,
    the norm all-reduced in float64 (float32 with ``offload_optimizer``)."""
    config = engine_config(ds, num_micro_batches=n, clip=step.find(Clip), precision=policy.name, micro_batch_size=1,
                           world_size=mesh.world_size)
    enabled = enabled_precisions(config)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[enabled[0]] if enabled else _stored(params[0], policy)
    stage, world = ds.stage, mesh.world_size
    if stage == 0:
        return [_make("all_reduce", dtype, None, "DeepSpeed gradients", world),
                *([_make("all_reduce", torch.float32, 1, "DeepSpeed norm", world)] if step.find(Clip) else [])]
    if stage in (1, 2):
        return [_make("all_reduce", dtype, None, "DeepSpeed gradients", world, count=n if stage == 2 else 1),
                _make("all_gather", dtype, None, "DeepSpeed updated partitions", world),
                *([_make("all_reduce", torch.uint8, 1, "DeepSpeed overflow check", world)] if enabled else []),
                _make("all_reduce", torch.float32, 1, "DeepSpeed norm", world)]
    norm = torch.float32 if offloaded(config)[0] else torch.float64  # offloaded: the norm of the host's partitions
    return [_make("all_gather", dtype, None, "DeepSpeed parameters", world, count=n),
            _make("reduce_scatter", dtype, None, "DeepSpeed gradients", world, count=n),
            _make("all_reduce", norm, 1, "DeepSpeed norm", world)]


def _stored(p: torch.Tensor, policy: Policy) -> torch.dtype:
    return policy.param_dtype if p.is_floating_point() and policy.param_dtype != torch.float32 else p.dtype


def _fsdp(model: torch.nn.Module, shard: ShardParams, policy: Policy, split: ModelSplit, n: int) -> list[Collective]:
    degree = split.mesh.fsdp_size
    gather_dtype = policy.compute_dtype if policy.autocast else None
    reduce_dtype = torch.float32 if policy.autocast else None
    whole_rank = attrs.evolve(split, sharded=False)  # rank 0's tensor-parallel pieces, as FSDP2 shards them
    inside: set[int] = set()
    units: list[tuple[str, list[torch.nn.Parameter]]] = []
    for name, unit in shard.select(model):
        own = [p for p in unit.parameters() if id(p) not in inside]
        inside.update(id(p) for p in own)
        units.append((name, own))
    root = [p for p in dict.fromkeys(model.parameters()) if id(p) not in inside]
    forward_order = [("root", root), *reversed(units)]  # units are innermost-first; forward runs outermost
    out: list[Collective] = []
    reshard = shard.reshard_after_forward

    def padded(ps: list[torch.nn.Parameter]) -> int:
        total = 0
        for p in ps:
            shape = whole_rank.local_shape(p, 0) or tuple(p.shape)
            total += (-(-shape[0] // degree) * degree) * math.prod(shape[1:]) if len(shape) else degree
        return total

    in_float8 = _float8_weights(model, policy) if degree > 1 else set()

    def gather(ps: list[torch.nn.Parameter], what: str) -> Collective:
        dtype = gather_dtype or _stored(ps[0], policy)
        eight = [p for p in ps if id(p) in in_float8]
        if not eight:
            return _make("all_gather", dtype, padded(ps), what, degree, count=n)
        rest = [p for p in ps if id(p) not in in_float8]
        if not rest:
            return _make("all_gather", torch.float8_e4m3fn, padded(eight), what, degree, count=n)
        return _make("all_gather", torch.uint8, padded(eight) + padded(rest) * dtype.itemsize, what, degree, count=n)

    for name, ps in forward_order:
        if ps:
            out.append(gather(ps, f"gather {name}"))
    if reshard:
        for name, ps in units:  # backward: innermost (last) units first
            if ps:
                out.append(gather(ps, f"re-gather {name}"))
    scatters = n if shard.reduce_every_micro_batch else 1
    for name, ps in [*units, ("root", root)]:
        grads = [p for p in ps if p.requires_grad]
        if grads:
            out.append(_make("reduce_scatter", reduce_dtype or _stored(grads[0], policy), padded(grads),
                             f"reduce-scatter {name}", degree, count=scatters))
    if in_float8:
        out.insert(0, _make("all_reduce", torch.float32, len(in_float8), "float8 weight amax", degree))
    return out


def _float8_weights(model: torch.nn.Module, policy: Policy) -> set[int]:
    """The ids of the weights ``with_precision("fp8", float8_all_gather=True)`` gathers in float8."""
    if policy.float8 is None or not policy.float8.all_gather:
        return set()
    modules = dict(model.named_modules())
    return {id(modules[name].weight) for name in float8.convertible(model, policy.float8)}
