"""What ``replicate()`` does to a model on CPU and CUDA: ``DistributedDataParallel`` with the
communication hooks of ``replicate(comm_hook=...)`` registered on it, PowerSGD's state carried
by the TrainState, and the ``DDP`` model phase.

A PowerSGD hook keeps state between updates on each rank (error feedback, the P and Q
matrices of each gradient bucket, an iteration count, a numpy RandomState). It lives in
torch's ``PowerSGDState``, which the hook changes during every synchronizing backward; the
TrainState carries it as a ``PowerSGDMemory`` record in ``transforms_state["comm_hook"]``
(tensors and plain values, checkpointed per rank through the record registry, never
pickled). ``prepare`` puts a record of the live state in the state (or a record already
there, a loaded one, into the live state); the interpreter records the live state after
each update and, before a synchronizing backward, puts a record it did not make itself (a
state loaded or restored since) into the live state.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

from accelfn.distributed.ops import mark_replicas
from accelfn.distributed.phases import ModelPhase
from accelfn.state import TrainState
from accelfn.transforms import PowerSGDMemory, Replicate

if TYPE_CHECKING:
    from accelfn.distributed.phases import Preparation

#: the hooks whose state is a PowerSGDState (accelfn builds it from replicate's comm_state)
_POWERSGD = (powersgd.powerSGD_hook, powersgd.batched_powerSGD_hook)


class PowerSGDHook:
    """A PowerSGD hook with its ``PowerSGDState`` (``state``), which keeps the hook's memory
    laid out as its bucket is.

    DDP orders a bucket's parameters as they are registered on the first backward of a new
    wrapper, then rebuilds the buckets in the order gradients became ready (torch's PowerSGD
    starts at iteration 2 or later for this reason). A state resumed into a new wrapper was
    written in the rebuilt order: before ``powerSGD_hook`` runs on a bucket whose order
    differs from the one its memory (error feedback, P, Q) was written in, the memory's
    per-parameter pieces are put in the bucket's order. ``batched_powerSGD_hook``'s memory
    is of the whole bucket and is not laid out again.
    """

    def __init__(self, hook: Any, state: powersgd.PowerSGDState, params: list[torch.nn.Parameter]):
        self.hook, self.state = hook, state
        self.__name__, self.__qualname__ = hook.__name__, hook.__qualname__  # DDP reads a hook's names
        self._index = {id(p): i for i, p in enumerate(params)}
        self._shapes = [tuple(p.shape) for p in params]
        self.layouts: dict[int, tuple[int, ...]] = {}

    # unannotated: DDP checks a hook's annotations, and this module's are strings (__future__)
    def __call__(self, state, bucket):
        index, order = bucket.index(), tuple(self._index[id(p)] for p in bucket.parameters())
        before = self.layouts.get(index)
        if before is not None and before != order and self.hook is powersgd.powerSGD_hook:
            self._relayout(index, before, order)
        self.layouts[index] = order
        return self.hook(state, bucket)

    def _relayout(self, index: int, before: tuple[int, ...], after: tuple[int, ...]) -> None:
        state = self.state
        if index in state.error_dict:
            state.error_dict[index] = _reorder(state.error_dict[index], self._error_pieces(before),
                                               self._error_pieces(after))
        if index in state.p_memory_dict:
            for memory, side in ((state.p_memory_dict, 0), (state.q_memory_dict, 1)):
                memory[index] = _reorder(memory[index], self._matrix_pieces(before, side),
                                         self._matrix_pieces(after, side))

    def _error_pieces(self, order: tuple[int, ...]) -> dict[int, tuple[int, int]]:
        """Each parameter's (offset, length) in the flat bucket, the parameters in ``order``."""
        pieces, offset = {}, 0
        for i in order:
            length = int(np.prod(self._shapes[i], dtype=np.int64))
            pieces[i], offset = (offset, length), offset + length
        return pieces

    def _matrix_pieces(self, order: tuple[int, ...], side: int) -> dict[int, tuple[int, int]]:
        """Each compressed parameter's (offset, length) in the P (side 0) or Q (side 1) memory:
        powerSGD_hook's layout, grouped by shape in first-seen order, each (n or m) x rank."""
        groups: dict[tuple[int, int], list[int]] = {}
        for i in order:
            shape = self._shapes[i]
            n = shape[0]
            m = int(np.prod(shape[1:], dtype=np.int64))
            rank = min(n, m, self.state.matrix_approximation_rank)
            if powersgd._should_compress(n, m, rank, self.state.min_compression_rate)[0]:
                groups.setdefault((n, m), []).append(i)
        pieces, offset = {}, 0
        for (n, m), members in groups.items():
            rank = min(n, m, self.state.matrix_approximation_rank)
            for i in members:
                length = (n, m)[side] * rank
                pieces[i], offset = (offset, length), offset + length
        return pieces


def _reorder(memory: torch.Tensor, before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]]) -> torch.Tensor:
    """``memory``'s pieces (laid out as ``before``) laid out as ``after``."""
    out = torch.empty_like(memory)
    for i, (offset, length) in after.items():
        source = before[i][0]
        out[offset:offset + length] = memory[source:source + length]
    return out


_live: weakref.WeakKeyDictionary[torch.nn.Module, PowerSGDHook] = weakref.WeakKeyDictionary()


def bucket_dtype(hook: Any, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype ``replicate(comm_hook=hook)`` all-reduces a gradient bucket of ``dtype`` in,
    one all-reduce of the whole bucket (``af.plan``'s rule): ``dtype`` without a hook or with
    torch's ``allreduce_hook``, float16 with ``fp16_compress_hook``, bfloat16 with
    ``bf16_compress_hook``; None for a hook whose collectives are its own (PowerSGD's, a
    wrapper, the user's)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    known = {None: dtype, default_hooks.allreduce_hook: dtype, default_hooks.fp16_compress_hook: torch.float16,
             default_hooks.bf16_compress_hook: torch.bfloat16}
    return known.get(hook)


def hook_name(hook: Any) -> str:
    """``module.qualname`` of a hook, for messages and records."""
    return f"{getattr(hook, '__module__', '?')}.{getattr(hook, '__qualname__', type(hook).__name__)}"


def register(ddp: DistributedDataParallel, replicate: Replicate) -> None:
    """Registers ``replicate.comm_hook`` on ``ddp``: a PowerSGD hook with a ``PowerSGDState``
    of ``replicate.comm_state``'s options (default process group), any other with state None.

    Raises:
        ValueError: options PowerSGDState does not take, or refuses; options for a hook that
            is not PowerSGD's.
        NotImplementedError: DDP refuses the hook on this process group (torch's
            ``bf16_compress_hook`` over gloo).
    """
    hook = replicate.comm_hook
    if hook is None:
        return
    options: dict[str, Any] = dict(replicate.comm_state)
    state: Any = None
    if hook in _POWERSGD:
        try:
            state = powersgd.PowerSGDState(process_group=None, **options)
        except (TypeError, ValueError) as e:
            raise ValueError(f"replicate(comm_state={options!r}): PowerSGDState refused it ({e}); its options are "
                             "matrix_approximation_rank, start_powerSGD_iter (> 1 with error feedback or warm "
                             "start), min_compression_rate, use_error_feedback, warm_start, "
                             "orthogonalization_epsilon, random_seed, compression_stats_logging_frequency, "
                             "batch_tensors_with_same_shape") from None
        wrapped = PowerSGDHook(hook, state, list(ddp.module.parameters()))
        _live[ddp] = wrapped
        ddp.register_comm_hook(state, wrapped)
        return
    if options:
        raise ValueError(f"replicate(comm_state={options!r}) holds PowerSGD's options, but comm_hook is "
                         f"{hook_name(hook)}, which takes none; leave comm_state out")
    try:
        ddp.register_comm_hook(state, hook)
    except TypeError as e:  # torch's bf16 hook over gloo: it needs NCCL
        raise NotImplementedError(f"replicate(comm_hook={hook_name(hook)}) on a {dist_backend(ddp)} process group: "
                                  f"DDP refused it ({e}); use fp16_compress_hook or PowerSGD there, or run on "
                                  "CUDA (NCCL)") from None


def dist_backend(ddp: DistributedDataParallel) -> str:
    """The name of the process group's backend DDP reduces over (``gloo``, ``nccl``)."""
    return str(ddp.process_group.name()) if hasattr(ddp.process_group, "name") else "torch.distributed"


def live_state(model: torch.nn.Module) -> PowerSGDHook | None:
    """The PowerSGD hook (with its state) of a DDP-wrapped (maybe compiled) model, or None."""
    return _live.get(getattr(model, "_orig_mod", model))


def record(hook: PowerSGDHook) -> PowerSGDMemory:
    """The live state as a record (its tensors referenced, not copied: a snapshot copies them)."""
    live = hook.state
    rng: Any = live.rng.get_state()  # ('MT19937', keys, pos, has_gauss, cached_gaussian)
    _, keys, pos, has_gauss, gauss = rng
    return PowerSGDMemory(
        iter=live.iter, error=dict(live.error_dict), p=dict(live.p_memory_dict), q=dict(live.q_memory_dict),
        rng_keys=torch.from_numpy(keys.astype(np.int64)), rng_pos=int(pos), rng_has_gauss=int(has_gauss),
        rng_gauss=float(gauss), numel_before=live.total_numel_before_compression,
        numel_after=live.total_numel_after_compression, next_stats_report=live.next_stats_report,
        layouts=dict(hook.layouts))


def load(hook: PowerSGDHook, memory: PowerSGDMemory, device: torch.device) -> None:
    """Puts ``memory`` into the live state (its tensors on ``device``)."""
    live = hook.state
    hook.layouts = {k: tuple(v) for k, v in memory.layouts.items()}
    live.iter = memory.iter
    live.error_dict = {k: v.to(device) for k, v in memory.error.items()}
    live.p_memory_dict = {k: v.to(device) for k, v in memory.p.items()}
    live.q_memory_dict = {k: v.to(device) for k, v in memory.q.items()}
    live.rng.set_state(("MT19937", memory.rng_keys.numpy().astype(np.uint32), memory.rng_pos,
                        memory.rng_has_gauss, memory.rng_gauss))
    live.total_numel_before_compression = memory.numel_before
    live.total_numel_after_compression = memory.numel_after
    live.next_stats_report = memory.next_stats_report


def attach(state: TrainState, model: torch.nn.Module, device: torch.device) -> TrainState:
    """``state`` with its ``transforms_state["comm_hook"]`` and the live hook state of
    ``model`` made one: a record already in the state (a loaded one) is put into the live
    state, else a record of the live state is added. A model without a PowerSGD hook: as is."""
    live = live_state(model)
    if live is None:
        return state
    memory = state.transforms_state.get("comm_hook")
    if isinstance(memory, PowerSGDMemory):
        load(live, memory, device)
        return state
    return state.with_transform_state(comm_hook=record(live))


def wrap_ddp(model: torch.nn.Module, replicate: Replicate, world_size: int,
             device_ids: list[int] | None = None) -> torch.nn.Module:
    """``model`` in ``DistributedDataParallel`` with ``replicate``'s options (one process: as is).

    DDP broadcasts rank 0's parameters and buffers at construction, so replicas start equal.
    ``replicate.comm_hook`` is registered on it (:func:`register`).

    Raises:
        ValueError: ``replicate.comm_state`` that its hook does not take.
        NotImplementedError: a hook DDP refuses on this process group (bf16 over gloo).
    """
    if world_size == 1:
        return model
    ddp = DistributedDataParallel(
        model,
        device_ids=device_ids,
        bucket_cap_mb=replicate.bucket_cap_mb,
        find_unused_parameters=replicate.find_unused_parameters,
        static_graph=replicate.static_graph,
        gradient_as_bucket_view=replicate.gradient_as_bucket_view,
    )
    register(ddp, replicate)
    return ddp


class DDP(ModelPhase):
    """``replicate()``'s model phase: the model the step calls wrapped for data parallelism by
    the backend (``DistributedDataParallel`` on CPU and CUDA, with ``comm_hook``; XLA's own),
    after sharding and before compilation, as PyTorch's DDP guidance asks.

    Not under a transform whose step function reduces the gradients itself
    (``reduces_gradients``: ``pipeline``, ``invariant``). A PowerSGD hook's state joins the
    TrainState (:func:`attach`).
    """

    name: ClassVar[str] = "replicate"

    def __init__(self, spec: Replicate):
        self.spec = spec

    @classmethod
    def of(cls, prep: Preparation) -> DDP | None:
        spec = prep.step.find(Replicate)
        if spec is None or any(t.reduces_gradients for t in prep.step.transforms):
            return None
        return cls(spec)

    def check(self, prep: Preparation) -> None:
        """Raises NotImplementedError where the backend cannot replicate as ``spec`` asks."""
        prep.hardware.check_replicate(self.spec)

    def apply(self, prep: Preparation) -> None:
        if prep.hardware.world_size > 1:
            mark_replicas(prep.state.model)  # one model: its buffers are rank 0's where it is read
        prep.model = prep.hardware.wrap_model(prep.model, self.spec)
        prep.state = attach(prep.state, prep.model, prep.hardware.device)
