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
  bytes (FSDP2 gathers mixed dtypes as ``uint8``; a unit of float8 weights only, as float8), and each update adds one fp32 all-reduce
  of one amax per converted weight (torchao's ``precompute_float8_dynamic_scale_for_fsdp``).
- Every logged update (``log_every``) on W > 1 reduces the metrics: one float64 sum
  all-reduce of the metrics and counts and one float64 max all-reduce of the memory.

Bytes on the wire per rank follow the ring algorithms: an all-reduce of ``B`` bytes sends
``2 (W-1)/W B``, an all-gather or reduce-scatter whose whole is ``B`` sends ``(W-1)/W B``, a
broadcast ``B`` (its root; counted for every rank alike).
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.distributed as dist
import torch.nn.parallel.distributed as ddp_module

from accelfn.distributed import float8
from accelfn.transforms import Accumulate, Clip, Replicate, ShardParams, SkipNonfinite
from accelfn.transforms.precision import Policy

_MIB = 1024 * 1024


@attrs.frozen
class Collective:
    """One collective of an update.

    Attributes:
        kind: ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"`` or ``"broadcast"``.
        dtype: the element type, e.g. ``torch.float32``.
        elements: the elements of the whole tensor (the gathered or scattered one for
            all-gather and reduce-scatter, one rank's for all-reduce and broadcast).
        what: what it carries (``"DDP bucket 0"``, ``"gather layers.0"``, ``"clip norm"``).
        count: how many times per update (micro-batches, or once).
        wire_bytes: bytes one rank sends for it, per time (ring algorithms).
        per_log: True for the metric reductions, issued once per logged update.
    """

    kind: str
    dtype: torch.dtype
    elements: int
    what: str
    count: int = 1
    wire_bytes: int = 0
    per_log: bool = False

    @property
    def bytes(self) -> int:
        """The tensor's bytes (``elements`` times the element size)."""
        return self.elements * self.dtype.itemsize


def _wire(kind: str, nbytes: int, world_size: int) -> int:
    if world_size == 1:
        return 0
    if kind == "all_reduce":
        return 2 * (world_size - 1) * nbytes // world_size
    if kind in ("all_gather", "reduce_scatter"):
        return (world_size - 1) * nbytes // world_size
    return nbytes


def _make(kind: str, dtype: torch.dtype, elements: int, what: str, world_size: int, count: int = 1,
          per_log: bool = False) -> Collective:
    size = elements * dtype.itemsize
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


def collectives_per_update(step: object, model: torch.nn.Module, policy: Policy, world_size: int,
                           local_world_size: int, *, num_metrics: int = 2,
                           memory_values: int = 1) -> tuple[Collective, ...]:
    """The collectives of one (steady-state) optimizer update on rank 0, in order; the metric
    reductions (``per_log``) come once per logged update, here with ``num_metrics`` metrics and
    ``memory_values`` memory readings (RSS, and the device's peak on CUDA)."""
    if world_size == 1:
        return ()
    find = step.find  # type: ignore[attr-defined]
    guard = policy.scaling is not None or find(SkipNonfinite) is not None

    accumulate = find(Accumulate)
    n = accumulate.num_micro_batches if accumulate else 1
    params = list(dict.fromkeys(model.parameters()))
    out: list[Collective] = []
    replicate, shard = find(Replicate), find(ShardParams)
    if replicate is not None:
        buffers = [b for b in model.buffers()]
        if buffers:
            by_dtype: dict[torch.dtype, int] = {}
            for b in buffers:
                dtype = policy.param_dtype if b.is_floating_point() and policy.param_dtype != torch.float32 else b.dtype
                by_dtype[dtype] = by_dtype.get(dtype, 0) + b.numel()
            for dtype, elements in by_dtype.items():
                out.append(_make("broadcast", dtype, elements, "DDP buffers", world_size))
        for i, bucket in enumerate(ddp_buckets(params, replicate.bucket_cap_mb)):
            dtype = _stored(params[bucket[0]], policy)
            out.append(_make("all_reduce", dtype, sum(params[j].numel() for j in bucket), f"DDP bucket {i}",
                             world_size))
    elif shard is not None:
        degree = shard.shard_degree(world_size, local_world_size)
        out.extend(_fsdp(model, shard, policy, degree, n))
        if degree < world_size:  # hybrid: the sharded gradients all-reduced across the groups
            out.extend(_make("all_reduce", c.dtype, c.elements // degree, c.what.replace("reduce-scatter",
                                                                                         "replica all-reduce"),
                             world_size // degree, c.count)
                       for c in list(out) if c.kind == "reduce_scatter")
        if find(Clip) is not None:
            out.append(_make("all_reduce", torch.float32, 1, "clip norm", degree))
    if guard and shard is not None:  # each rank checked only its shards
        out.append(_make("all_reduce", torch.float32, 1, "non-finite check", world_size))
    out.append(_make("all_reduce", torch.int64, 4, "metric names agree", world_size, per_log=True))
    out.append(_make("all_reduce", torch.float64, num_metrics + 1, "metrics (sum)", world_size, per_log=True))
    out.append(_make("all_reduce", torch.float64, memory_values, "memory (max)", world_size, per_log=True))
    return tuple(out)


def _stored(p: torch.Tensor, policy: Policy) -> torch.dtype:
    return policy.param_dtype if p.is_floating_point() and policy.param_dtype != torch.float32 else p.dtype


def _fsdp(model: torch.nn.Module, shard: ShardParams, policy: Policy, degree: int, n: int) -> list[Collective]:
    gather_dtype = policy.compute_dtype if policy.autocast else None
    reduce_dtype = torch.float32 if policy.autocast else None
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
        return sum((-(-p.shape[0] // degree) * degree) * math.prod(p.shape[1:]) if p.dim() else degree
                   for p in ps)

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
