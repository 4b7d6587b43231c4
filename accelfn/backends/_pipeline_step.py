"""The step function of a pipelined program: ``accumulate(n)``'s micro-batches kept until the
window closes, then run through a ``torch.distributed.pipelining`` schedule, and the update.

Per window (``n`` micro-batches of ``b_i`` samples, ``N = sum(b_i)`` on this data rank)::

    schedule   ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B, scale_grads=False,
               loss of micro-batch i on the last stage: loss_fn(output_i, targets_i) * b_i / N
               (times the loss scale under fp16)
               (one schedule run per run of equal-shaped micro-batches: its buffers are shaped once)
    data       each stage's gradients averaged over its replicas (replicate(): one all-reduce)
    unscale    fp16: the loss was scaled on the last stage; gradients unscaled and checked
    check      skip_nonfinite, fp16: any inf/NaN gradient on any rank skips the update everywhere
               (one all-reduce); fp16's loss scale then adjusts alike on every rank
    clip       the norm over every stage: sum of |g|^p over the pipe group (one all-reduce)
    update     optimizer.step(); scheduler.step(); zero_grad(set_to_none=True)
    metrics    the window's mean loss, broadcast from the last stage over the pipe group

The gradient is ``sum_i b_i / N * grad(loss_i)``: that of one batch of the ``N`` samples.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from accelfn import collectives
from accelfn.backends import _pipeline
from accelfn.backends._interpreter import StepFn, foreign_state
from accelfn.errors import NonFiniteError
from accelfn.state import TrainState
from accelfn.step import NO_METRICS, Loss, Step
from accelfn.transforms import (
    Accumulate,
    Clip,
    ClipValue,
    Pipeline,
    SkipNonfinite,
    WithPrecision,
    numerics,
    parse_policy,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from accelfn.backends.base import Backend

#: the shapes and dtypes of one micro-batch's inputs and targets: one schedule per such key and count
Key = tuple[int, tuple[tuple[tuple[int, ...], torch.dtype], ...]]


def _key(count: int, inputs: tuple[torch.Tensor, ...], targets: torch.Tensor) -> Key:
    return count, tuple((tuple(t.shape), t.dtype) for t in (*inputs, targets))


class PipelineStepFn(StepFn):
    """``step_fn(state, batch, *, flush=False) -> (state, metrics)`` of a pipelined program.

    Made by ``backend.prepare(step, state)``. A micro-batch that does not close the window
    is only kept (no forward yet: the schedule needs the window's micro-batches together);
    the one that closes it runs the schedule and the update, and returns ``loss`` (the
    window's mean over this data rank's samples, equal on every stage), ``lr``,
    ``num_samples``, with ``clip`` the ``grad_norm`` over all stages (left out of a skipped
    update), with fp16 ``loss_scale``, and with fp16 or ``skip_nonfinite`` ``skipped``.

    Raises (of a call):
        TypeError: a batch that is not ``(inputs, targets)``; a ``loss_fn`` that returns
            an ``af.Loss``, metrics, or not a scalar tensor that requires grad (on every
            rank, at the first update).
        ValueError: ``state`` belongs to another model, or is mid-window without this step
            function's kept micro-batches.
        NonFiniteError: too many consecutive updates skipped for non-finite gradients.
    """

    def __init__(self, backend: Backend, step: Step, state: TrainState, mesh: DeviceMesh,  # noqa: PLW0231
                 stages: list[tuple[int, torch.fx.GraphModule]]):  # StepFn's own fields are not this one's
        pp = step.find(Pipeline)
        assert pp is not None
        accumulate, precision = step.find(Accumulate), step.find(WithPrecision)
        self.step = step
        self._backend = backend
        self._pp = pp
        self._owner = state.model
        self._optimizer = state.optimizer
        self._scheduler = state.scheduler
        self._params = [p for g in state.optimizer.param_groups for p in g["params"]]
        self._n = accumulate.num_micro_batches if accumulate is not None else 1
        self._policy = precision.policy if precision is not None else parse_policy("fp32")
        self._clip, self._clip_value = step.find(Clip), step.find(ClipValue)
        self._skip = step.find(SkipNonfinite)
        self._scaling = self._policy.scaling  # fp16: the loss scaled on the last stage, unscaled after
        self._max_skips = (self._scaling.max_consecutive_skips if self._scaling is not None
                           else self._skip.max_consecutive_skips if self._skip is not None else 0)
        self._scale = 1.0
        self._user_loss = step.loss_fn
        self._stages = stages
        self._indices = [i for i, _ in stages]
        self._first = 0 in self._indices
        self._last = pp.num_stages - 1 in self._indices
        self._pipe = mesh["pipe"].get_group()
        self._data = mesh["data"].get_group() if mesh["data"].size() > 1 else None
        self._data_size = mesh["data"].size()
        self._last_rank = dist.get_global_rank(self._pipe, pp.size - 1)
        self._schedules: dict[Key, Any] = {}
        self._pending: list[tuple[tuple[torch.Tensor, ...], torch.Tensor]] = []
        self._window_samples = 1
        self._failure: str | None = None
        self._checked = False

    # -- one micro-batch ---------------------------------------------------------------

    def __call__(self, state: TrainState, batch: Any, *, flush: bool = False) -> tuple[TrainState, Mapping[str, Any]]:
        if state.model is not self._owner:
            raise foreign_state()
        position = state.epoch_micro_step % self._n
        if position == 0:
            self._pending = []
        elif len(self._pending) != position:
            raise ValueError(
                f"this pipelined step function holds {len(self._pending)} micro-batches of the open window, and "
                f"the state is at its micro-batch {position}: a pipelined window is run by the step function "
                "that began it; close windows before saving (checkpoints save between updates)")
        inputs, targets = _pipeline.split_batch(batch)
        if self._policy.casts_inputs:
            inputs = tuple(t.to(self._policy.param_dtype) if t.is_floating_point() else t for t in inputs)
        self._pending.append((inputs, targets))
        if not (flush or position == self._n - 1):
            return state._advance(step=state.step, micro_step=state.micro_step + 1,
                                  epoch_micro_step=state.epoch_micro_step + 1,
                                  transforms_state=state.transforms_state), NO_METRICS
        pending, self._pending = self._pending, []
        samples = sum(int(t.shape[0]) for _, t in pending)
        self._scale = state.transforms_state["loss_scale"].scale if self._scaling is not None else 1.0
        loss = self._run(pending, samples)
        return self._apply(state, loss, samples)

    # -- the schedule --------------------------------------------------------------------

    def _loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        """The schedule's loss of one micro-batch: the user's, weighted by its share of the window."""
        out = self._user_loss(output, targets)  # (output, targets) under pipeline
        if self._failure is None:
            self._failure = _wrong_loss(out)
        if self._failure is not None or not isinstance(out, torch.Tensor):  # the schedule goes on; raised after
            if isinstance(output, torch.Tensor):
                return output.float().sum() * 0.0
            return torch.zeros((), requires_grad=True)
        return out * (targets.shape[0] / self._window_samples * self._scale)

    def _schedule(self, key: Key) -> Any:
        """The schedule of ``key[0]`` micro-batches of ``key``'s shapes (made once, on stages of
        its own). 1F1B needs at least ``size`` micro-batches, interleaved 1F1B a multiple of
        ``size``: a run with fewer (an epoch's last window, its smaller last batch) goes
        all-forwards-then-all-backwards (GPipe, or LoopedBFS on several stages per rank)
        instead, which computes the same gradients."""
        if key not in self._schedules:
            from torch.distributed.pipelining import (
                PipelineStage,
                Schedule1F1B,
                ScheduleGPipe,
                ScheduleInterleaved1F1B,
                ScheduleLoopedBFS,
            )

            device = self._backend.device
            stages = [PipelineStage(module, i, self._pp.num_stages, device, group=self._pipe)
                      for i, module in self._stages]
            count, size, kind = key[0], self._pp.size, self._pp.schedule
            if kind == "interleaved_1f1b":
                multi = ScheduleInterleaved1F1B if count % size == 0 else ScheduleLoopedBFS
                self._schedules[key] = multi(list[Any](stages), count, loss_fn=self._loss, scale_grads=False)
            else:
                single = Schedule1F1B if kind == "1f1b" and count >= size else ScheduleGPipe
                self._schedules[key] = single(stages[0], count, loss_fn=self._loss, scale_grads=False)
        return self._schedules[key]

    def _run(self, pending: list[tuple[tuple[torch.Tensor, ...], torch.Tensor]], samples: int) -> torch.Tensor:
        """Runs the window's micro-batches; returns the window's mean loss (0 but on the last stage)."""
        self._window_samples = samples
        total = torch.zeros((), dtype=torch.float32, device=self._backend.device)
        runs: list[list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]] = []
        for item in pending:  # runs of equal shapes: the last, smaller batch of an epoch runs on its own
            if runs and _key(1, *item) == _key(1, *runs[-1][0]):
                runs[-1].append(item)
            else:
                runs.append([item])
        autocast = (self._backend.autocast(self._policy) if self._policy.autocast else contextlib.nullcontext())
        for run in runs:
            schedule = self._schedule(_key(len(run), *run[0]))
            inputs = tuple(torch.cat([x[k] for x, _ in run]) for k in range(len(run[0][0])))
            targets = torch.cat([t for _, t in run])
            losses: list[torch.Tensor] = []
            with autocast:
                if self._first:
                    schedule.step(*inputs, target=targets if self._last else None,
                                  losses=losses if self._last else None, return_outputs=False)
                elif self._last:
                    schedule.step(target=targets, losses=losses, return_outputs=False)
                else:
                    schedule.step(return_outputs=False)
            for value in losses:
                total = total + value.detach().float() / self._scale
        if not self._checked:  # the first update: a loss_fn of the wrong form fails on every rank
            self._checked = True
            failed = collectives.failures(self._failure, device=self._backend.collective_device)
            if failed:
                raise TypeError(failed[0])
        return total

    # -- the update ------------------------------------------------------------------------

    def _apply(self, state: TrainState, loss: torch.Tensor, samples: int) -> tuple[TrainState, Mapping[str, Any]]:
        params = [p for p in self._params if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]
        if self._data is not None and grads:  # replicate(): each stage's gradients averaged over its replicas
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self._data)
            flat /= self._data_size
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        dist.broadcast(loss, src=self._last_rank, group=self._pipe)  # the last stage's loss, on every stage
        metrics: dict[str, Any] = {"loss": loss, "lr": self._optimizer.param_groups[0]["lr"], "num_samples": samples}
        finite, transforms_state = True, state.transforms_state
        if self._skip is not None or self._scaling is not None:  # one verdict: each rank saw its stage only
            if self._scaling is not None:
                bad = numerics.unscale_and_check(grads, 1.0 / self._scale).reshape(()).clamp(max=1.0) if grads \
                    else torch.zeros((), device=self._backend.device)
            else:
                bad = torch.zeros((), dtype=torch.float32, device=self._backend.device)
                for g in grads:
                    bad = torch.maximum(bad, (~torch.isfinite(g)).any().float())
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            finite = not bool(bad.item())
            transforms_state = {**transforms_state, "skips": transforms_state["skips"].record(finite)}
            metrics["skipped"] = 0 if finite else 1
            if self._scaling is not None:
                metrics["loss_scale"] = self._scale
                transforms_state["loss_scale"] = transforms_state["loss_scale"].adjust(finite, self._scaling)
        if self._clip is not None:
            norm = self._global_norm(grads, self._clip.norm_type)
            torch.nn.utils.clip_grads_with_norm_(params, self._clip.max_norm, norm)
            if finite:  # the norm of non-finite gradients is no norm (docs/05)
                metrics["grad_norm"] = norm
        elif self._clip_value is not None:
            torch.nn.utils.clip_grad_value_(params, self._clip_value.max_value)
        if finite:
            self._optimizer.step()
            if self._scheduler is not None:
                self._scheduler.step()
        self._optimizer.zero_grad(set_to_none=True)
        new_state = state._advance(step=state.step + 1 if finite else state.step, micro_step=state.micro_step + 1,
                                   epoch_micro_step=state.epoch_micro_step + 1, transforms_state=transforms_state)
        if self._max_skips and transforms_state["skips"].consecutive >= self._max_skips:
            raise NonFiniteError(
                f"{transforms_state['skips'].consecutive} optimizer updates in a row had inf/NaN gradients and were "
                f"skipped (step {new_state.step}); the loss or the model produces non-finite values. Check the data "
                "and the learning rate, or raise max_consecutive_skips")
        if self._scaling is not None and transforms_state["loss_scale"].scale < self._scaling.min_scale:
            raise NonFiniteError(
                f"the fp16 loss scale fell to {transforms_state['loss_scale'].scale:g}, below its floor "
                f"{self._scaling.min_scale:g} (step {new_state.step}): the gradients are inf or NaN even at a scale "
                "this small; check the data and the learning rate, or use with_precision('bf16')")
        return new_state, metrics

    def _global_norm(self, grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        """The ``norm_type``-norm of every stage's gradients together (one all-reduce over the pipe group)."""
        device = self._backend.device
        if math.isinf(norm_type):
            local = torch.stack([g.detach().abs().max().float() for g in grads]).max() if grads else \
                torch.zeros((), device=device)
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self._pipe)
            return local
        norms = [torch.linalg.vector_norm(g.detach(), norm_type).float() for g in grads]
        local = (torch.stack(norms) ** norm_type).sum() if norms else torch.zeros((), device=device)
        dist.all_reduce(local, group=self._pipe)
        return local ** (1.0 / norm_type)


def _wrong_loss(out: Any) -> str | None:
    """Why ``loss_fn(output, targets)``'s result cannot be a pipelined loss, or None."""
    if isinstance(out, tuple) or isinstance(out, Loss):
        what = "an af.Loss" if isinstance(out, Loss) else "a tuple (loss, metrics)"
        return (f"under pipeline(), loss_fn(output, targets) returned {what}; return a scalar mean loss tensor "
                "(af.Loss and metrics are not supported with pipeline() yet)")
    if not isinstance(out, torch.Tensor) or out.numel() != 1 or not out.requires_grad:
        what = (f"a tensor of shape {tuple(out.shape)}" + ("" if out.requires_grad else " that does not require grad")
                if isinstance(out, torch.Tensor) else type(out).__name__)
        return (f"under pipeline(), loss_fn(output, targets) must return a scalar mean loss tensor computed from "
                f"output (the last stage's output), got {what}")
    return None


def prepare(backend: Backend, step: Step, state: TrainState, policy: Any,
            pp: Pipeline) -> tuple[TrainState, PipelineStepFn]:
    """``backend.prepare`` of a pipelined program: checked, then rank 0's model broadcast,
    placed, cut into stages and pruned to this rank's, and the step function.

    Raises:
        ValueError, NotImplementedError: from ``_pipeline.check`` and ``_pipeline.cut``, and
            for a model on the meta device, before anything changes.
    """
    _pipeline.check(pp, backend.world_size, backend.device)
    if any(t.is_meta for t in [*state.model.parameters(), *state.model.buffers()]):
        raise NotImplementedError(
            "pipeline() of a model built on the meta device is not built yet (each rank would fill only its "
            "stages); build the model on the CPU: prepare cuts it and each rank keeps only its stages")
    _pipeline.check_not_cut(state.model)
    _pipeline.cut(state.model, pp)  # every error of the cut, before anything changes
    mesh = _pipeline.world_mesh(backend.device, backend.world_size, pp)
    backend._place_state(state, policy)
    for tensor in [*state.model.parameters(), *state.model.buffers()]:  # every rank starts from rank 0's model
        dist.broadcast(tensor.data, src=0)
    for transform in step.transforms:
        state = transform.init(state)
    stages = _pipeline.prepare_model(state.model, state.optimizer, pp, backend.rank, backend.world_size, mesh)
    return state, PipelineStepFn(backend, step, state, mesh, stages)
