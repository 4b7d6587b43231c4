"""The memory of a plan: the bytes one rank holds, from shapes and dtypes alone.

Persistent state per rank (what ``prepare`` and the first update leave behind):

- parameters in the policy's storage dtype (``bf16-true`` casts floating ones); under
  ``shard_params`` over ``D`` ranks (``D = W``, or ``shard_size``) each parameter of ``d0``
  rows is cut as ``torch.chunk`` cuts it (FSDP2's ``Shard(0)``): chunks of ``ceil(d0 / D)``
  rows, rank ``r`` holding rows ``[i c, min((i + 1) c, d0))`` of shard index ``i = r mod D``;
- gradients: the same bytes for every parameter that requires a gradient (held from the
  backward until ``zero_grad(set_to_none=True)`` after the update); ``replicate`` on W > 1 adds
  DDP's flat buckets, one more copy of them (none with ``gradient_as_bucket_view=True``);
- optimizer state: the optimizer's own ``step`` run once on meta tensors of the parameters'
  shapes and dtypes, so any ``torch.optim`` optimizer's state (Adam's two moments and its
  scalar step, SGD's momentum buffer, ...) comes out exactly; state of a parameter's shape is
  sharded like the parameter, scalars are not;
- buffers, whole on every rank (FSDP2 does not shard them), and transform state tensors.

Which piece of each parameter a rank holds is the split of the run's own rules
(``_split``): a pipeline's stages, a tensor-parallel layer's ``Shard`` dimension, FSDP2's
``Shard(0)`` of that (2-D FSDP x TP). Under ``deepspeed()`` DeepSpeed's partitions
(``distributed.deepspeed.zero_partition``): the parameters whole (ZeRO 0-2) or in
``ceil(numel / W)`` partitions plus the persistent ones whole (ZeRO-3), the fp32 master
partitions and the optimizer's state of them counted as optimizer state (the ZeRO paper's
``K``), offloaded bytes (``offload_optimizer``, ``offload_param``; ``shard_params(offload=
True)``) counted where they are and named in ``Memory.offloaded``. Under ``invariant()``
the window's partial sums: flat gradient buffers as many as ``push``'s binary counter keeps.

The activation peak of one micro-batch is traced: the loss function's forward and backward
run on a fake copy of the model (``FakeTensorMode``: shapes, dtypes and devices without
storage) over a fake copy of the first batch, counting the bytes of every storage an operator
creates until it is freed (``_peak.PeakTracker``: MemTracker's count, in constant time per
operator); the peak of that count is what the micro-batch adds (activations, temporaries,
gradients).
"""

from __future__ import annotations

import collections
import copy
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
from torch.utils._pytree import tree_flatten

from accelfn.distributed.canonical import blocks
from accelfn.distributed.deepspeed import offloaded, zero_partition
from accelfn.distributed.mesh import Mesh
from accelfn.loop.planning._peak import PeakTracker
from accelfn.loop.planning._split import ModelSplit, whole
from accelfn.step import Step
from accelfn.transforms import Clip, DeepSpeed, Invariant, Replicate, ShardParams
from accelfn.transforms.deepspeed import enabled_precisions, engine_config, micro_batches_per_update
from accelfn.transforms.invariant import stack_sizes
from accelfn.transforms.precision import Policy, parse_policy

_FP32 = parse_policy("fp32")


@attrs.frozen
class Memory:
    """Bytes one rank holds, by kind.

    Attributes:
        params: parameters (this rank's shards under ``shard_params``).
        grads: gradients, from the backward to the end of the update.
        optimizer: optimizer state after the first update.
        buffers: buffers (not sharded).
        transform_state: tensors in ``TrainState.transforms_state``.
        ddp_buckets: DDP's gradient buckets under ``replicate`` on more than one process
            (under ``pipeline() x replicate()``, the one flat copy of the stage's gradients
            its all-reduce sends).
        gathered: under ``shard_params``, the all-gathered parameters held at the same time
            (the root unit's and the largest unit's, twice for FSDP2's prefetch).
        micro_batch: what one micro-batch's forward and backward add at their peak
            (activations, temporaries and gradients), traced; None when not traced.
        partial_sums: under ``invariant()``, the flat gradient buffers of the window's
            partial sums held at once at their most (the stack, the leaf being made, the
            exchange's received copy).
        offloaded: of the parameters, gradients and optimizer state above, the bytes that
            offloading keeps off the device (``shard_params(offload=True)``: all three;
            DeepSpeed's ``offload_optimizer``: the optimizer state, ``offload_param``: the
            parameter partitions).
    """

    params: int
    grads: int
    optimizer: int
    buffers: int
    transform_state: int
    ddp_buckets: int = 0
    gathered: int = 0
    micro_batch: int | None = None
    partial_sums: int = 0
    offloaded: int = 0

    @property
    def persistent(self) -> int:
        """Bytes held between updates: parameters, optimizer state, buffers, transform state."""
        return self.params + self.optimizer + self.buffers + self.transform_state

    @property
    def peak(self) -> int:
        """The step's peak: persistent state, DDP buckets, gathered parameters, invariant's
        partial sums and the micro-batch's peak (its gradients included; without a trace, the
        gradients alone), wherever they are held."""
        extra = self.micro_batch if self.micro_batch is not None else self.grads
        return self.persistent + self.ddp_buckets + self.gathered + self.partial_sums + max(extra, self.grads)

    @property
    def device_peak(self) -> int:
        """:attr:`peak` less what offloading keeps in host memory (or on NVMe): the device's share."""
        return self.peak - self.offloaded


def _storage_dtype(t: torch.Tensor, policy: Policy) -> torch.dtype:
    return policy.param_dtype if t.is_floating_point() and policy.param_dtype != torch.float32 else t.dtype


def local_numel(shape: torch.Size, index: int, degree: int) -> int:
    """Elements of the ``index``-th of ``degree`` dim-0 chunks of ``shape`` (``torch.chunk``'s cut)."""
    if degree == 1 or len(shape) == 0:
        return math.prod(shape)
    chunk = -(-shape[0] // degree)
    rows = max(0, min(chunk, shape[0] - index * chunk))
    return rows * math.prod(shape[1:])


def _nbytes(numel: int, dtype: torch.dtype) -> int:
    return numel * dtype.itemsize


def _finalizer(cls: type) -> RuntimeError | None:
    """Why no instance of ``cls`` may be made to plan with, where it has a finalizer: any
    instance sharing the real optimizer's attributes, once collected, would release the real
    one's state."""
    if not any("__del__" in vars(c) for c in cls.__mro__[:-1]):
        return None
    return RuntimeError(f"{cls.__qualname__} has a finalizer (__del__): it holds state outside "
                        "Python, which a copy stepped on meta tensors would release for the real optimizer")


def optimizer_state_shapes(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                           policy: Policy) -> list[list[tuple[torch.Size, torch.dtype]]]:
    """The (shape, dtype) of each state tensor the optimizer keeps per parameter after one step,
    learned by running a copy of it (same class and hyperparameters) once on meta tensors: one
    stand-in per kind of parameter (shape, dtype, requires_grad, parameter group), since a
    ``torch.optim`` optimizer's state of a parameter depends on nothing else (18 alike
    transformer blocks step as one).

    Raises:
        RuntimeError: the optimizer cannot step on meta tensors (one reading values on the host),
            or its class has a finalizer (``__del__``: state held outside Python, such as
            DeepSpeed's CPU Adam, which a copy would release for the real one).
    """
    if (refused := _finalizer(type(optimizer))) is not None:
        raise refused
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    keys = [(tuple(p.shape), _storage_dtype(p, policy), p.requires_grad, group_of.get(id(p))) for p in params]
    stand_ins: dict[tuple[Any, ...], torch.nn.Parameter] = {}
    for shape, dtype, requires_grad, group in keys:
        if group is not None and (shape, dtype, requires_grad, group) not in stand_ins:
            meta = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=requires_grad)
            if requires_grad:
                meta.grad = torch.zeros_like(meta)
            stand_ins[(shape, dtype, requires_grad, group)] = meta
    groups = []
    for g, options_of in enumerate(optimizer.param_groups):
        options = {k: v for k, v in options_of.items() if k != "params"}
        for flag in ("foreach", "fused", "capturable"):  # kernels for real devices; same state
            if flag in options:
                options[flag] = False if flag != "foreach" else None
        groups.append({**options, "params": [m for key, m in stand_ins.items() if key[3] == g]})
    copy_ = copy.copy(optimizer)  # the same class and attributes, never its constructor's arguments
    # an instance attribute shadowing a method (an lr scheduler's counting wrapper of `step`) calls
    # the real optimizer: the copy uses its class's own methods
    own = {k: v for k, v in optimizer.__dict__.items() if not (callable(v) and hasattr(type(optimizer), k))}
    copy_.__dict__ = dict(own, param_groups=groups, state=collections.defaultdict(dict))
    for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):  # not the user's hooks
        if hasattr(copy_, hooks):
            setattr(copy_, hooks, collections.OrderedDict())
    with torch.no_grad():
        copy_.step()
    shapes = {key: [(v.shape, v.dtype) for v in copy_.state.get(meta, {}).values() if isinstance(v, torch.Tensor)]
              for key, meta in stand_ins.items()}
    return [shapes.get(key, []) for key in keys]


def _planned_state_shapes(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], policy: Policy
                          ) -> tuple[list[list[tuple[torch.Size, torch.dtype]]], str | None]:
    """:func:`optimizer_state_shapes`, or no state and why (said in the plan as a warning) where
    the optimizer cannot be stepped on meta tensors: the plan of the rest still holds."""
    try:
        return optimizer_state_shapes(optimizer, params, policy), None
    except Exception as e:  # noqa: BLE001 - any optimizer's failure on meta tensors: said in the plan
        return [[] for _ in params], _unplanned(optimizer, e)


def _unplanned(optimizer: torch.optim.Optimizer, error: Exception) -> str:
    return f"{type(optimizer).__name__}.step() does not run on meta tensors ({type(error).__name__}: {error})"


def persistent_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer, transforms_state: Any, *,
                      policy: Policy, step: Step, split: ModelSplit) -> tuple[tuple[Memory, ...], str | None]:
    """Each rank's persistent bytes on ``split``'s mesh, and why the optimizer state could not
    be planned (or None)."""
    mesh = split.mesh
    params = whole(model.parameters())
    ds = step.find(DeepSpeed)
    if ds is not None:
        return _zero_memory(model, optimizer, transforms_state, step, ds, policy, mesh)
    state_shapes, problem = _planned_state_shapes(optimizer, params, policy)
    shard, replicate, invariant = step.find(ShardParams), step.find(Replicate), step.find(Invariant)
    transform = sum(t.nbytes for t in _tensors(transforms_state))
    memories = []
    cache: dict[tuple[int, ...], Memory] = {}
    for rank in range(mesh.world_size):
        key = split.key(rank)
        if key in cache:
            memories.append(cache[key])
            continue
        p_bytes = g_bytes = o_bytes = 0
        for p, shapes in zip(params, state_shapes):
            dtype = _storage_dtype(p, policy)
            numel = split.numel(p, rank)
            size = _nbytes(numel, dtype)
            p_bytes += size
            g_bytes += size if p.requires_grad else 0
            if split.holds(p, rank):
                for shape, state_dtype in shapes:
                    o_bytes += _nbytes(numel if shape == p.shape else math.prod(shape), state_dtype)
        buffers = sum(_nbytes(b.numel(), _storage_dtype(b, policy)) for b in model.buffers() if split.holds(b, rank))
        # DDP's flat buckets; under pipeline() the one flat copy of the stage's gradients its all-reduce sends
        copies = replicate is not None and mesh.replicas > 1 and (
            not replicate.gradient_as_bucket_view or split.held)
        offloaded = p_bytes + g_bytes + o_bytes if shard is not None and shard.offload else 0
        cache[key] = Memory(params=p_bytes, grads=g_bytes, optimizer=o_bytes, buffers=buffers,
                            transform_state=transform, ddp_buckets=g_bytes if copies else 0,
                            gathered=_gathered(model, shard, policy, split, rank) if split.sharded else 0,
                            partial_sums=_partial_sums(params, policy, mesh, rank, invariant,
                                                         micro_batches_per_update(step)),
                            offloaded=offloaded)
        memories.append(cache[key])
    return tuple(memories), problem


def _partial_sums(params: list[torch.nn.Parameter], policy: Policy, mesh: Mesh, rank: int,
                  invariant: Invariant | None, n: int) -> int:
    """Under ``invariant()``, the flat gradient buffers (all the parameters' gradients in one
    tensor) ``backends._invariant`` holds at once at its most, from its code: the window's stack
    (``transforms.invariant.stack_sizes``) and the leaf each micro-batch makes; at the update the
    stack, the last leaf (still referenced where it was added into a node), and what the
    canonical sum allocates (``_exchange_buffers``), or, with ``A`` no power of two on several
    ranks, every rank's padded stack all-gathered (``W + 1`` stacks of the deepest's size)."""
    if invariant is None or not params:
        return 0
    world = mesh.world_size
    flat = _nbytes(sum(p.numel() for p in params),
                   functools.reduce(torch.promote_types, (_storage_dtype(p, policy) for p in params)))
    sizes = stack_sizes(rank=rank, world_size=world, num_micro_batches=n)
    making = max(before + 1 for before in [0, *sizes[:-1]])
    merged = int(n > 1 and sizes[-1] <= sizes[-2])
    if world > 1 and n & (n - 1):  # blocks straddle subtrees: every rank's stack gathered
        most = max(max(stack_sizes(rank=r, world_size=world, num_micro_batches=n)) for r in range(world))
        return flat * max(making, sizes[-1] + merged + most * (world + 1))
    return flat * max(making, sizes[-1] + merged + _exchange_buffers(rank, world))


def _exchange_buffers(rank: int, world: int) -> int:
    """The flat buffers ``distributed.canonical_all_reduce`` holds at once besides its input on
    ``rank``: the last round's received copy (a block of more than one rank), and where the world
    has several power-of-two blocks the other blocks' roots and the running sum of their fold."""
    if world == 1:
        return 0
    layout = blocks(world)
    size = next(n for start, n in layout if start <= rank < start + n)
    return int(size > 1) + (len(layout) if len(layout) > 1 else 0)


def _zero_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer, transforms_state: Any, step: Step,
                 ds: DeepSpeed, policy: Policy, mesh: Mesh) -> tuple[tuple[Memory, ...], str | None]:
    """Each rank's bytes under a DeepSpeed engine: ``distributed.deepspeed.zero_partition``'s
    elements, the parameters in the engine's dtype (bf16/fp16 when its section is enabled),
    fp32 master partitions, and the optimizer's own state of them (its step on meta tensors)."""
    config = engine_config(ds, num_micro_batches=micro_batches_per_update(step), clip=step.find(Clip),
                           precision=policy.name, micro_batch_size=1, world_size=mesh.world_size)
    enabled = enabled_precisions(config)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[enabled[0]] if enabled else torch.float32
    params = whole(model.parameters())
    groups = [[p.numel() for p in g["params"] if p.requires_grad and p.numel()] for g in optimizer.param_groups]
    part = zero_partition([p.numel() for p in params], groups, config=config, world_size=mesh.data_size)
    if part.masters:  # the optimizer steps flat fp32 partitions, one per (sub-)group
        stand_ins = [torch.nn.Parameter(torch.empty(n, device="meta")) for _, n in part.masters]
        shapes: list[list[tuple[torch.Size, torch.dtype]]]
        problem: str | None
        # checked before any instance exists: even an unstepped one runs the finalizer when collected
        if (refused := _finalizer(type(optimizer))) is not None:
            shapes, problem = [], _unplanned(optimizer, refused)
        else:
            flat = torch.optim.Optimizer.__new__(type(optimizer))  # the same class, over the partitions
            flat.__dict__ = dict(optimizer.__dict__, param_groups=[
                {**{k: v for k, v in optimizer.param_groups[g].items() if k != "params"}, "params": [m]}
                for (g, _), m in zip(part.masters, stand_ins)])
            shapes, problem = _planned_state_shapes(flat, stand_ins, _FP32)
        masters = sum(_nbytes(n, torch.float32) for _, n in part.masters)
        o_bytes = masters + sum(_nbytes(math.prod(shape), d) for s in shapes for shape, d in s)
    else:  # stage 0: the optimizer steps the parameters themselves
        shapes, problem = _planned_state_shapes(optimizer, params, policy)
        o_bytes = sum(_nbytes(math.prod(shape), d) for s in shapes for shape, d in s)
    on_host_optimizer, on_host_params = offloaded(config)
    p_bytes = _nbytes(part.params, dtype)
    offloaded_bytes = (o_bytes if on_host_optimizer else 0) + (_nbytes(part.partitions, dtype) if on_host_params else 0)
    memory = Memory(params=p_bytes, grads=_nbytes(part.grads, dtype), optimizer=o_bytes,
                    buffers=sum(_nbytes(b.numel(), b.dtype if not b.is_floating_point() else dtype)
                                for b in model.buffers()),
                    transform_state=sum(t.nbytes for t in _tensors(transforms_state)), offloaded=offloaded_bytes)
    return (memory,) * mesh.world_size, problem


def _gathered(model: torch.nn.Module, shard: ShardParams | None, policy: Policy, split: ModelSplit,
              rank: int) -> int:
    """The unsharded parameters FSDP2 holds at once: the root's own, and the largest unit's twice
    (the one computing and the one prefetched), in the compute dtype of an autocast policy
    (under ``tensor_parallel``, each parameter's tensor-parallel piece)."""
    assert shard is not None
    dtype = policy.compute_dtype
    unsharded = attrs.evolve(split, sharded=False)
    units = shard.select(model)
    inside: set[int] = set()
    sizes = []
    for _, unit in units:
        own = [p for p in unit.parameters() if id(p) not in inside]
        inside.update(id(p) for p in own)
        sizes.append(sum(_nbytes(unsharded.numel(p, rank), dtype) for p in own))
    root = sum(_nbytes(unsharded.numel(p, rank), dtype) for p in model.parameters() if id(p) not in inside)
    if not shard.reshard_after_forward:
        return root + sum(sizes)
    return root + 2 * max(sizes, default=0)


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict) or hasattr(tree, "items"):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)
    elif attrs.has(type(tree)):
        for field in attrs.fields(type(tree)):
            yield from _tensors(getattr(tree, field.name))


#: ``(storages that exist before, the fake model) -> tracker``: what counts a traced micro-batch's bytes
TrackerFactory = Callable[[list[torch.Tensor], torch.nn.Module], PeakTracker]


def trace_micro_batch(model: torch.nn.Module, batch: Any, loss_of: Callable[[torch.nn.Module, Any], torch.Tensor],
                      autocast: Callable[[], Any], policy: Policy, unused: list[str] | None = None,
                      device: torch.device | None = None, *, adjust: Callable[[torch.nn.Module], Any] | None = None,
                      tracker: TrackerFactory | None = None) -> int:
    """What one micro-batch's forward and backward add at their peak, in bytes, traced on fake
    tensors: a fake copy of ``model`` (parameters in the policy's storage dtype) and of ``batch``,
    on ``device`` (None: the CPU) as the backend places them, so that the device's kernels and
    autocast decide the activations' dtypes and sizes.
    Nothing is allocated for activations or gradients, and ``model`` is not touched. The names of
    trainable parameters that got no gradient are appended to ``unused``. ``adjust`` changes the
    fake copy before the trace (which blocks recompute: ``distributed.recompute.recompute``);
    ``tracker`` makes the counter (default: a ``PeakTracker``; one that also watches the fake model)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with mode:
        memo: dict[int, Any] = {}
        for name, p in model.named_parameters(remove_duplicate=True):
            memo[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=_storage_dtype(p, policy), device=device),
                                             requires_grad=p.requires_grad)
        for b in model.buffers():
            memo[id(b)] = torch.empty(b.shape, dtype=_storage_dtype(b, policy), device=device)
        fake = copy.deepcopy(model, memo)
        if adjust is not None:
            adjust(fake)
        fake_batch = _to_fake(batch, mode, device)
        known = [*fake.parameters(), *fake.buffers(), *(t for t in tree_flatten(fake_batch)[0]
                                                        if isinstance(t, torch.Tensor))]
        with (tracker or (lambda k, _: PeakTracker(k)))(known, fake) as counting:
            with autocast():
                loss = loss_of(fake, fake_batch)
            loss.backward()
        if unused is not None:
            unused.extend(n for n, p in fake.named_parameters() if p.requires_grad and p.grad is None)
    return counting.peak


def _to_fake(tree: Any, mode: Any, device: torch.device | None) -> Any:
    if isinstance(tree, torch.Tensor):
        fake = torch.empty(tree.shape, dtype=tree.dtype) if tree.device.type == "meta" else mode.from_tensor(tree)
        return fake if device is None else fake.to(device)
    if isinstance(tree, dict):
        return type(tree)((k, _to_fake(v, mode, device)) for k, v in tree.items())
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_to_fake(v, mode, device) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_fake(v, mode, device) for v in tree)
    return tree
