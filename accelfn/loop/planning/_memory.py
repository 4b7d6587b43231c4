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
import math
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
from torch.utils._pytree import tree_flatten

from accelfn.loop.planning._peak import PeakTracker
from accelfn.transforms import Replicate, ShardParams
from accelfn.transforms.precision import Policy


@attrs.frozen
class Memory:
    """Bytes one rank holds, by kind.

    Attributes:
        params: parameters (this rank's shards under ``shard_params``).
        grads: gradients, from the backward to the end of the update.
        optimizer: optimizer state after the first update.
        buffers: buffers (not sharded).
        transform_state: tensors in ``TrainState.transforms_state``.
        ddp_buckets: DDP's gradient buckets under ``replicate`` on more than one process.
        gathered: under ``shard_params``, the all-gathered parameters held at the same time
            (the root unit's and the largest unit's, twice for FSDP2's prefetch).
        micro_batch: what one micro-batch's forward and backward add at their peak
            (activations, temporaries and gradients), traced; None when not traced.
    """

    params: int
    grads: int
    optimizer: int
    buffers: int
    transform_state: int
    ddp_buckets: int = 0
    gathered: int = 0
    micro_batch: int | None = None

    @property
    def persistent(self) -> int:
        """Bytes held between updates: parameters, optimizer state, buffers, transform state."""
        return self.params + self.optimizer + self.buffers + self.transform_state

    @property
    def peak(self) -> int:
        """The step's peak: persistent state, DDP buckets, gathered parameters and the
        micro-batch's peak (its gradients included; without a trace, the gradients alone)."""
        extra = self.micro_batch if self.micro_batch is not None else self.grads
        return self.persistent + self.ddp_buckets + self.gathered + max(extra, self.grads)


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
    if any("__del__" in vars(c) for c in type(optimizer).__mro__[:-1]):
        raise RuntimeError(f"{type(optimizer).__qualname__} has a finalizer (__del__): it holds state outside "
                           "Python, which a copy stepped on meta tensors would release for the real optimizer")
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


def persistent_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer, transforms_state: Any, *,
                      policy: Policy, shard: ShardParams | None, replicate: Replicate | None, world_size: int,
                      local_world_size: int) -> tuple[tuple[Memory, ...], str | None]:
    """Each rank's persistent bytes, and why the optimizer state could not be planned (or None)."""
    params = list(dict.fromkeys(model.parameters()))
    degree = shard.shard_degree(world_size, local_world_size) if shard is not None else 1
    sharded = shard is not None and (world_size > 1 or shard.offload) and degree > 1
    if not sharded:
        degree = 1
    problem = None
    try:
        state_shapes = optimizer_state_shapes(optimizer, params, policy)
    except Exception as e:  # noqa: BLE001 - any optimizer's failure on meta tensors: said in the plan
        state_shapes = [[] for _ in params]
        problem = f"{type(optimizer).__name__}.step() does not run on meta tensors ({type(e).__name__}: {e})"
    buffers = sum(_nbytes(b.numel(), _storage_dtype(b, policy)) for b in model.buffers())
    transform = sum(t.nbytes for t in _tensors(transforms_state))
    memories = []
    cache: dict[int, Memory] = {}
    gathered = _gathered(model, shard, policy) if sharded else 0
    for rank in range(world_size):
        index = rank % degree
        if index in cache:
            memories.append(cache[index])
            continue
        p_bytes = g_bytes = o_bytes = 0
        for p, shapes in zip(params, state_shapes):
            dtype = _storage_dtype(p, policy)
            numel = local_numel(p.shape, index, degree)
            size = _nbytes(numel, dtype)
            p_bytes += size
            g_bytes += size if p.requires_grad else 0
            for shape, state_dtype in shapes:
                o_bytes += _nbytes(numel if shape == p.shape else math.prod(shape), state_dtype)
        buckets = g_bytes if replicate is not None and world_size > 1 and not replicate.gradient_as_bucket_view else 0
        cache[index] = Memory(params=p_bytes, grads=g_bytes, optimizer=o_bytes, buffers=buffers,
                              transform_state=transform, ddp_buckets=buckets,
                              gathered=gathered)
        memories.append(cache[index])
    return tuple(memories), problem


def _gathered(model: torch.nn.Module, shard: ShardParams | None, policy: Policy) -> int:
    """The unsharded parameters FSDP2 holds at once: the root's own, and the largest unit's twice
    (the one computing and the one prefetched), in the compute dtype of an autocast policy."""
    assert shard is not None
    dtype = policy.compute_dtype
    units = shard.select(model)
    inside: set[int] = set()
    sizes = []
    for _, unit in units:
        own = [p for p in unit.parameters() if id(p) not in inside]
        inside.update(id(p) for p in own)
        sizes.append(sum(_nbytes(p.numel(), dtype) for p in own))
    root = sum(_nbytes(p.numel(), dtype) for p in model.parameters() if id(p) not in inside)
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
