"""The step function of a program under ``invariant()``: per micro-batch keyed RNG, a binary
counter of partial gradient sums, one canonical sum over ranks, one scaling by ``1/N``.

Per micro-batch ``k`` (its global index in the epoch, ``transforms.invariant.global_index``)::

    rng       torch's generators, Python's random and NumPy's global one seeded from
              (seed, epoch, k); restored afterwards
    forward   autocast(compute dtype)            loss_fn(model, batch)
    backward  of the summed loss (af.Loss's total; a mean loss as it is: every micro-batch
              holds b samples), times the loss scale
    leaf      the gradients flattened into one buffer, pushed on the stack (binary counter)
    -- last micro-batch of the window only --
    fold      the stack's sum: this rank's subtree
    reduce    distributed.canonical_all_reduce (butterfly; no DDP, whose order is not fixed)
    scale     grads *= 1/N, N the global item count (L micro-batches for a mean loss)
    then      unscale, clip, check, update, adjust, zero as StepFn does

The model is not wrapped in DDP: ``prepare`` broadcasts rank 0's parameters and buffers once
(as DDP does when it wraps), and the canonical sum keeps the copies equal bit for bit.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch
import torch.distributed as dist

from accelfn import distributed
from accelfn.backends._interpreter import _NULL, InterpreterStepFn, UpdateTail, foreign_state
from accelfn.data.tree import map_tensors, num_samples
from accelfn.distributed import fsdp
from accelfn.errors import TransformError
from accelfn.state import TrainState
from accelfn.step import NO_METRICS, Step, detach
from accelfn.transforms.invariant import (
    Invariant,
    Layout,
    Node,
    TreeWindow,
    fold,
    global_index,
    micro_batch_seed,
    push,
)

if TYPE_CHECKING:
    from accelfn.backends.base import Backend

WINDOW = "tree_window"
LAYOUT = "invariant"


class InvariantStepFn(InterpreterStepFn):
    """``step_fn(state, batch, *, flush=False) -> (state, metrics)`` under ``invariant()``.

    As :class:`InterpreterStepFn`, but the update's gradient is summed over the global micro-batches
    in one tree that does not depend on the world size (module docstring). Metrics are the
    update's over all ranks (``loss``, the user's metrics, ``grad_norm``: the same value on
    every rank); ``num_samples`` and ``num_items`` are this rank's, as elsewhere.

    Raises (of a call):
        TransformError: the run was started with another micro-batch size or number of
            micro-batches per update (``W * A``) than this one (a resume that cannot be exact).
        As :class:`InterpreterStepFn`.
    """

    def __init__(self, backend: Backend, step: Step, state: TrainState, model: torch.nn.Module):
        super().__init__(backend, step, state, model)
        spec = step.find(Invariant)  # None only for tolerate_faults' step function without invariant()
        self._seed = spec.seed if spec is not None else 0
        self._rank, self._world = backend.rank, backend.world_size
        self._data_parallel = self._world > 1
        # every rank holds the same gradients (no reduce_gradients: the canonical sum replaces it)
        self._tail = UpdateTail(backend, step, state, grads=self._grads, clip_norm=self._clip_grad_norm,
                                verdict_over_ranks=self._distributed_params, skips_agree=True)
        # the count of either kind travels in the tree's sums, so no collective waits on it, but the
        # kinds must agree (a mean loss adds 1 per micro-batch, an af.Loss its count): checked when
        # the first window closes, where every rank arrives (one whose leaves a resumed subtree
        # holds runs no forward), before the first update
        self._loss_kind_agreed = True  # not at the first forward (StepFn._forward)
        self._kinds_checked = self._world == 1
        self._cuda = backend.device.type == "cuda"
        self._layout: Layout | None = None
        self._flat_dtype = functools.reduce(torch.promote_types, (p.dtype for p in self._params))
        # A not a power of two on several ranks: blocks straddle subtrees; gathered (_gathered)
        self._gather = self._world > 1 and self._n & (self._n - 1) != 0
        # shard_params(): FSDP2's reduce-scatter off; whole gradients taken after each backward
        # (backends._fsdp_grads), this rank's pieces of the canonical sum handed back as DTensors
        self._whole_grads: list[torch.Tensor] | None = None
        self._no_sync = ((lambda: fsdp.no_gradient_sync(state.model)) if self._sharded and self._world > 1
                         else (lambda: _NULL))

    def __call__(self, state: TrainState, batch: Any, *, flush: bool = False) -> tuple[TrainState, Mapping[str, Any]]:
        if state.model is not self._owner:
            raise foreign_state()
        n = self._n
        position = state.epoch_micro_step % n
        last = flush or position == n - 1
        # closed by each update; at a window's first micro-batch only one resumed on another world size
        window: TreeWindow | None = state.transforms_state.get(WINDOW)
        samples = num_samples(batch)
        if self._layout is None:
            state = self._check_layout(state, samples)
        if self._cast_inputs:
            dtype = self._policy.param_dtype
            batch = map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, batch)
        index = global_index(state.epoch_micro_step, rank=self._rank, world_size=self._world, num_micro_batches=n)
        scale = state.transforms_state["loss_scale"].scale if self._scaling is not None else 1.0
        if window is not None and (window.pending and window.pending[0].start == index or index < window.skip_until):
            if self._sharded and self._world > 1:  # FSDP2's all-gathers pair up only if every rank runs them
                self._forward_backward(batch, state.epoch, index, scale)
                self._take_grads()  # in a resumed subtree already: dropped
            return self._resumed_leaf(state, window, index, last)
        loss, count, user_metrics, is_sum = self._forward_backward(batch, state.epoch, index, scale)
        if window is not None and window.nodes and is_sum != window.item_counts:
            raise ValueError("loss_fn returned an af.Loss for a micro-batch and a plain loss for another of the same "
                             "update; return the same kind for every micro-batch")
        weight = count if is_sum else 1.0
        names = tuple(sorted(user_metrics)) if user_metrics else ()
        if window is not None and window.nodes and names != window.metric_names:
            raise ValueError(f"loss_fn returned the metrics {list(names)} on a micro-batch and "
                             f"{list(window.metric_names)} on an earlier one of the same update; return the same names")
        sums = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=loss.device).reshape(())
                            for v in (loss.detach(), weight, *(detach(user_metrics[k]) * weight for k in names))])
        leaf = Node(index, 0, self._take_grads(), sums)
        nodes = push(window.nodes if window is not None else (), leaf, self._origin(index))
        items = (window.num_items if window is not None else 0.0) + (float(count) if is_sum else 0.0)
        total_samples = samples + (window.num_samples if window is not None else 0)
        resumed = (window.pending, window.skip_until) if window is not None else ((), 0)
        return self._close_or_keep(state, TreeWindow(nodes, total_samples, names, items, *resumed, item_counts=is_sum),
                                   last)

    def _forward_backward(self, batch: Any, epoch: int, index: int,
                          scale: float) -> tuple[torch.Tensor, Any, Mapping[str, Any], bool]:
        """The forward and backward of global micro-batch ``index``, its random draws keyed."""
        cpu_rng, py_rng, np_rng = torch.get_rng_state(), random.getstate(), np.random.get_state()
        cuda_rng = torch.cuda.get_rng_state() if self._cuda else None
        seed = micro_batch_seed(self._seed, epoch, index)
        torch.default_generator.manual_seed(seed)  # torch.manual_seed also seeds every lazy device: 0.8 ms
        random.seed(seed)
        np.random.seed(seed % 2**32)
        if self._cuda:
            torch.cuda.default_generators[torch.cuda.current_device()].manual_seed(seed)
        try:
            with self._no_sync():
                loss, count, user_metrics, is_sum = self._forward(batch)
                (loss * scale if scale != 1.0 else loss).backward()
        finally:
            torch.set_rng_state(cpu_rng)
            random.setstate(py_rng)
            np.random.set_state(np_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng)
        return loss, count, user_metrics, is_sum

    def _resumed_leaf(self, state: TrainState, window: TreeWindow, index: int,
                      last: bool) -> tuple[TrainState, Mapping[str, Any]]:
        """A micro-batch of a window resumed on another number of processes: a subtree saved
        from its leaves is pushed at its first leaf, and leaves inside it are not computed."""
        nodes, pending, skip_until = window.nodes, window.pending, window.skip_until
        if pending and pending[0].start == index:
            node, pending = pending[0], pending[1:]
            nodes, skip_until = push(nodes, node, self._origin(index)), node.start + 2**node.height
        return self._close_or_keep(state, attrs.evolve(window, nodes=nodes, pending=pending, skip_until=skip_until),
                                   last)

    def _close_or_keep(self, state: TrainState, window: TreeWindow,
                       last: bool) -> tuple[TrainState, Mapping[str, Any]]:
        """The state after a micro-batch: the window kept, or closed by the update."""
        if not last:
            return state._advance(step=state.step, micro_step=state.micro_step + 1,
                                  epoch_micro_step=state.epoch_micro_step + 1,
                                  transforms_state={**state.transforms_state, WINDOW: window}), NO_METRICS
        names, is_sum, items, total_samples = window.metric_names, window.item_counts, window.num_items, window.num_samples
        if not self._kinds_checked:
            self._kinds_checked = True
            self._agree_loss_kind(is_sum)
        if self._gather:  # A not a power of two: the ranks' subtrees finished together
            root = fold(self._gathered(window.nodes, len(names)))
            grads, totals = root.grads, root.sums
        else:
            root = fold(window.nodes) if window.nodes else self._identity(len(names))
            grads, totals = distributed.canonical_all_reduce([root.grads, root.sums])
        global_count = float(totals[1])
        correction = 1.0 / global_count if global_count > 0 else 0.0
        self._put_grads(grads)
        means = (totals * correction).to(torch.float32)
        user_means = {k: means[2 + i] for i, k in enumerate(names)}
        if WINDOW in state.transforms_state:
            state = attrs.evolve(state, transforms_state={k: v for k, v in state.transforms_state.items()
                                                          if k != WINDOW})
        try:
            return self._update(state, correction, total_samples, means[0], user_means,
                                items=items if is_sum else None)
        finally:
            self._whole_grads = None

    def _origin(self, index: int) -> int:
        """The first global micro-batch of the update that holds micro-batch ``index``."""
        per_update = self._world * self._n
        return index // per_update * per_update

    def _gathered(self, nodes: tuple[Node, ...], num_metrics: int) -> tuple[Node, ...]:
        """Every rank's subtrees (an all-gather, padded to the longest stack), pushed in order
        of their first leaf: the update's stack, the same bits on every rank and as one rank
        pushing every leaf (``push`` adds siblings only)."""
        device = self._params[0].device
        numel = sum(p.numel() for p in self._params)
        count = torch.tensor([len(nodes)], dtype=torch.int64, device=device)
        counts = [torch.empty_like(count) for _ in range(self._world)]
        dist.all_gather(counts, count)
        most = max(int(c) for c in counts)
        meta = torch.zeros((most, 2), dtype=torch.int64, device=device)
        grads = torch.zeros((most, numel), dtype=self._flat_dtype, device=device)
        sums = torch.zeros((most, 2 + num_metrics), dtype=torch.float64, device=device)
        for i, node in enumerate(nodes):
            meta[i, 0], meta[i, 1] = node.start, node.height
            grads[i], sums[i] = node.grads, node.sums
        parts = []
        for local in (meta, grads, sums):
            received = [torch.empty_like(local) for _ in range(self._world)]
            dist.all_gather(received, local)
            parts.append(received)
        found = sorted(((int(m[i, 0]), int(m[i, 1]), g[i], s[i])
                        for m, g, s, c in zip(*parts, counts) for i in range(int(c))), key=lambda n: n[0])
        stack: tuple[Node, ...] = ()
        for start, height, g, s in found:
            stack = push(stack, Node(start, height, g, s), self._origin(start))
        return stack

    def _identity(self, num_metrics: int) -> Node:
        """A rank's subtree when another rank holds all of its leaves: ``-0.0`` everywhere,
        the exact identity of IEEE addition (``x + -0.0 == x`` for every ``x``, ``-0.0`` too)."""
        numel = sum(p.numel() for p in self._params)
        return Node(0, 0, torch.full((numel,), -0.0, dtype=self._flat_dtype, device=self._params[0].device),
                    torch.full((2 + num_metrics,), -0.0, dtype=torch.float64, device=self._params[0].device))

    def _take_grads(self) -> torch.Tensor:
        """The parameters' gradients flattened into one new buffer (zeros where none); the
        parameters' ``.grad`` (under ``shard_params()``, FSDP2's whole gradients) set to None,
        so the next backward writes fresh ones."""
        if self._sharded and self._world > 1:
            grads = fsdp.take_unsharded_grads(self._owner, self._params)
        else:
            grads = [p.grad for p in self._params]
            for p in self._params:
                p.grad = None
        return torch.cat([(g if g is not None else self._zeros(p)).reshape(-1) for g, p in zip(grads, self._params)])

    def _zeros(self, param: torch.Tensor) -> torch.Tensor:
        return torch.zeros(param.shape, dtype=param.dtype, device=self._params[0].device)

    def _put_grads(self, flat: torch.Tensor) -> None:
        """Each parameter's gradient: its part of ``flat`` (a view where the dtypes agree);
        under ``shard_params()`` this rank's piece of it, and the whole parts kept for
        scaling and clipping (``_grads``, ``_clip_grad_norm``)."""
        offset, wholes = 0, []
        for p in self._params:
            numel = p.numel()
            wholes.append(flat[offset:offset + numel].view(p.shape).to(p.dtype))
            offset += numel
        if self._sharded and self._world > 1:
            for p, whole in zip(self._params, wholes):
                p.grad = fsdp.local_piece(whole, p)
            self._whole_grads = wholes
        else:
            for p, whole in zip(self._params, wholes):
                p.grad = whole

    def _grads(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients to scale in place: under ``shard_params()`` the whole ones, whose
        views the shards' gradients are (so the norm below reads scaled values)."""
        if self._whole_grads is not None:
            return self._whole_grads
        return super()._grads(params)

    def _clip_grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        """Under ``shard_params()``, the norm of the whole canonical gradient, which every
        rank holds, taken as ``clip_grad_norm_`` takes it on an unsharded model (the same
        bits: no sum of per-shard partial norms, whose grouping would follow the world
        size), and the whole gradients scaled by its coefficient."""
        whole = self._whole_grads
        if whole is None:
            return super()._clip_grad_norm(params)
        assert self._clip is not None
        total = torch.nn.utils.get_total_norm(whole, self._clip.norm_type)
        coefficient = torch.clamp(self._clip.max_norm / (total + 1e-6), max=1.0)
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in whole:
            groups.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), group in groups.items():
            torch._foreach_mul_(group, coefficient.to(device))
        return total

    def _check_layout(self, state: TrainState, samples: int) -> TrainState:
        """Records ``Layout(b, W * A)`` in a fresh run; raises if a resumed run's differs."""
        layout = Layout(samples, self._world * self._n)
        saved = state.transforms_state.get(LAYOUT)
        if saved is not None and saved != layout:
            raise TransformError(
                f"this run was started under invariant() with micro-batches of {saved.micro_batch_size} samples and "
                f"{saved.micro_batches_per_update} micro-batches per update (processes x accumulate), and resumes with "
                f"{layout.micro_batch_size} and {layout.micro_batches_per_update} ({self._world} x accumulate({self._n})): "
                "the guarantee holds for the same b and W * A only; keep the DataLoader's batch_size and set "
                f"accumulate({saved.micro_batches_per_update} // processes)"
            )
        self._layout = layout
        if saved is None:
            state = state.with_transform_state(**{LAYOUT: layout})
        return state
