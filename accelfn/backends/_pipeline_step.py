"""The step function of a pipelined program: ``accumulate(n)``'s micro-batches kept until the
window closes, then run through a ``torch.distributed.pipelining`` schedule, and the update.

Per window (``n`` micro-batches of ``b_i`` samples, ``N = sum(b_i)`` on this data rank)::

    schedule   ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B, scale_grads=False,
               loss of micro-batch i on the last stage: loss_fn(output_i, targets_i) * b_i / N,
               or of an af.Loss(total_i, C_i): total_i / N (any positive divisor is exact, the
               correction divides it out; N keeps magnitudes per sample) (times the loss scale
               under fp16)
               (one schedule run per run of equal-shaped micro-batches: its buffers are shaped once)
    window     [N, sum C_i, summed loss, summed metrics * weight] broadcast from the last stage
               over the pipe group (one broadcast); af.Loss: sum C summed over the replicas
    correct    af.Loss: each stage's gradients times N * W / sum C (0 for a window without items),
               before the replicas' average: each replica's own N divided out
    data       each stage's gradients averaged over its replicas (replicate(): one all-reduce)
    tail       the interpreter's UpdateTail: fp16's unscale (the loss was scaled on the last
               stage) and the non-finite check, one verdict over every rank (one all-reduce),
               so fp16's loss scale adjusts alike on every rank; clip by the norm over every
               stage (sum of |g|^p over the pipe group, one all-reduce); optimizer and scheduler
               step, zero_grad; the metrics: the window's mean loss and the user's metrics
               (sample-weighted, af.Loss: item-weighted), from the broadcast: the same on every stage

The gradient is ``sum_i b_i / N * grad(loss_i)``: that of one batch of the ``N`` samples; of
an af.Loss, ``sum_{r,i} grad(total_ri) / sum_{r,i} C_ri`` over the ``W`` replicas: that of the
window's summed loss divided by its items, as one process would have it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist

from accelfn import distributed
from accelfn.backends._interpreter import UpdateTail, foreign_state
from accelfn.distributed import grad_norm, pipeline
from accelfn.state import TrainState
from accelfn.step import NO_METRICS, detach, unpack
from accelfn.transforms import (
    Accumulate,
    Clip,
    Pipeline,
    WithPrecision,
    numerics,
    parse_policy,
)

if TYPE_CHECKING:
    from accelfn.backends.base import Backend
    from accelfn.distributed.phases import Preparation

#: the shapes and dtypes of one micro-batch's inputs and targets: one schedule per such key and count
Key = tuple[int, tuple[tuple[tuple[int, ...], torch.dtype], ...]]


def _key(count: int, inputs: tuple[torch.Tensor, ...], targets: torch.Tensor) -> Key:
    return count, tuple((tuple(t.shape), t.dtype) for t in (*inputs, targets))


class PipelineStepFn:
    """``step_fn(state, batch, *, flush=False) -> (state, metrics)`` of a pipelined program.

    Made by ``backend.prepare(step, state)``. A micro-batch that does not close the window
    is only kept (no forward yet: the schedule needs the window's micro-batches together);
    the one that closes it runs the schedule and the update, and returns ``loss`` (the
    window's mean over this data rank's samples, of an ``af.Loss`` this rank's share as
    elsewhere, equal on every stage), the user's metrics (equal on every stage), ``lr``,
    ``num_samples``, with an ``af.Loss`` ``num_items``, with ``clip`` the ``grad_norm`` over all stages (left out of a skipped
    update), with fp16 ``loss_scale``, and with fp16 or ``skip_nonfinite`` ``skipped``.

    Raises (of a call):
        TypeError: a batch that is not ``(inputs, targets)``; a ``loss_fn`` that returns
            no scalar tensor that requires grad, ``(loss, metrics)`` or ``af.Loss`` (on every
            rank, at the first update), or later another kind or other metric names than
            at the first update (on every rank).
        ValueError: ``state`` belongs to another model, or is mid-window without this step
            function's kept micro-batches.
        NonFiniteError: too many consecutive updates skipped for non-finite gradients.
    """

    def __init__(self, backend: Backend, prep: Preparation):
        step, state, mesh = prep.step, prep.state, prep.mesh
        pp = step.find(Pipeline)
        assert pp is not None
        accumulate, precision = step.find(Accumulate), step.find(WithPrecision)
        self.step = step
        self._backend = backend
        self._pp = pp
        self._owner = state.model
        self._params = [p for g in state.optimizer.param_groups for p in g["params"]]
        self._n = accumulate.num_micro_batches if accumulate is not None else 1
        self._policy = precision.policy if precision is not None else parse_policy("fp32")
        self._clip = step.find(Clip)
        self._scaling = self._policy.scaling  # fp16: the loss scaled on the last stage, unscaled after
        self._scale = 1.0
        self._user_loss = step.loss_fn
        self._stages = prep.stages
        self._indices = [i for i, _ in prep.stages]
        self._first = 0 in self._indices
        self._last = pp.num_stages - 1 in self._indices
        self._pipe = mesh.group(backend.device, "pipe")
        self._data = mesh.group(backend.device, "replicate")
        self._data_size = mesh.data_size
        self._last_rank = mesh.ranks_along("pipe", backend.rank)[-1]
        # each rank holds one stage's gradients: the non-finite verdict is summed over every rank
        self._tail = UpdateTail(backend, step, state, grads=lambda params: [p.grad for p in params if p.grad is not None],
                                clip_norm=self._clip_grad_norm, verdict_over_ranks=True, skips_agree=True)
        self._schedules: dict[Key, Any] = {}
        self._pending: list[tuple[tuple[torch.Tensor, ...], torch.Tensor]] = []
        self._window_samples = 1
        self._failure: str | None = None
        self._checked = False
        self._is_sum = False  # agreed at the first update: an af.Loss, and the metric names
        self._names: tuple[str, ...] = ()
        self._sums = _Sums()
        self._calls: list[tuple[torch.Tensor, Any, dict[str, torch.Tensor], bool, int]] = []

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
        inputs, targets = pipeline.split_batch(batch)
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
        window = self._run(pending, samples)
        return self._apply(state, window, samples)

    # -- the schedule --------------------------------------------------------------------

    def _loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        """The schedule's loss of one micro-batch (last stage): the user's, weighted by its
        share of the window (a mean loss) or divided by the window's samples (an af.Loss);
        its loss, count and metrics kept for ``_add``."""
        out = self._user_loss(output, targets)  # (output, targets) under pipeline
        if self._failure is None:
            self._failure = _wrong_loss(out)
        if self._failure is not None:  # the schedule goes on; raised after
            if isinstance(output, torch.Tensor):
                return output.float().sum() * 0.0
            return torch.zeros((), requires_grad=True)
        loss, count, metrics, is_sum = unpack(out)
        kept = {k: detach(v).float() for k, v in metrics.items()}
        self._calls.append((loss.detach().float(), detach(count), kept, is_sum, targets.shape[0]))
        if is_sum:
            return loss * (self._scale / self._window_samples)
        return loss * (targets.shape[0] / self._window_samples * self._scale)

    def _add(self, calls: list[tuple[torch.Tensor, Any, dict[str, torch.Tensor], bool, int]]) -> None:
        """Adds a schedule run's micro-batches to the window's sums: the last ``len(run)`` calls
        of the loss, as the schedule's first run of a shape calls it once before them on
        stand-in outputs (to infer the gradients' shapes)."""
        sums = self._sums
        for loss, count, metrics, is_sum, samples in calls:
            if sums.first:
                sums.first, sums.is_sum, sums.names = False, is_sum, tuple(sorted(metrics))
            if is_sum != sums.is_sum or tuple(sorted(metrics)) != sums.names:
                sums.mismatch = True
            weight = count if is_sum else samples
            sums.count = sums.count + weight
            sums.total = sums.total + loss * (1.0 if is_sum else weight)
            for name, value in metrics.items():
                sums.metrics[name] = sums.metrics.get(name, 0.0) + value * weight

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
        """Runs the window's micro-batches; returns the window's sums from the last stage,
        ``[R, sum C, summed loss, *summed metrics]`` (float64), on every stage."""
        self._window_samples = samples
        self._sums = _Sums()
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
            with autocast:
                if self._first:
                    schedule.step(*inputs, target=targets if self._last else None, return_outputs=False)
                elif self._last:
                    schedule.step(target=targets, return_outputs=False)
                else:
                    schedule.step(return_outputs=False)
            if self._last:
                self._add(self._calls[len(self._calls) - len(run):])
            self._calls = []
        if not self._checked:  # the first update: a loss_fn of the wrong form fails on every rank
            self._checked = True
            self._agree()
        sums = self._sums
        device = self._backend.device
        window = torch.zeros(4 + len(self._names), dtype=torch.float64, device=device)
        if self._last:
            mismatch = sums.mismatch or sums.is_sum != self._is_sum or sums.names != self._names
            values = [float(mismatch), float(samples), sums.count, sums.total,
                      *[sums.metrics.get(k, 0.0) for k in self._names]]
            window = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(())
                                  for v in values])
        dist.broadcast(window, src=self._last_rank, group=self._pipe)
        if bool(window[0]):
            raise TypeError(
                "under pipeline(), loss_fn(output, targets) returned another kind of loss or other metric names "
                f"in this window than at the first update ({'an af.Loss' if self._is_sum else 'a loss'} with "
                f"{list(self._names)}); return the same kind and metric names in every window")
        return window[1:]

    def _agree(self) -> None:
        """At the first update: every rank's failure raised on every rank; the kind of loss
        and the metric names of the last stages, the same on every rank (one exchange)."""
        sums = self._sums
        mine = [self._failure, list(sums.names), sums.is_sum] if self._last else [self._failure, None, None]
        seen = distributed.exchange(mine, device=self._backend.collective_device)
        failed = list(dict.fromkeys(f for f, _, _ in seen if f is not None))
        if failed:
            raise TypeError(failed[0])
        kinds = {(tuple(names), is_sum) for _, names, is_sum in seen if names is not None}
        if len(kinds) > 1:
            raise TypeError(f"under pipeline(), loss_fn returned other kinds or metric names on the last stages of "
                            f"the replicas ({sorted(kinds)}); return the same on every rank")
        (self._names, self._is_sum), = kinds

    # -- the update ------------------------------------------------------------------------

    def _apply(self, state: TrainState, window: torch.Tensor, samples: int) -> tuple[TrainState, Mapping[str, Any]]:
        params = [p for p in self._params if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]
        reference, count, total = window[0], window[1].clone(), window[2]
        items = None
        if self._is_sum:  # the window's items over every replica; each replica's own R divided out
            items = count.clone()
            if self._data is not None:
                dist.all_reduce(count, group=self._data)
            correction = torch.as_tensor(numerics.window_correction(reference, self._data_size, count))
            if grads:
                numerics.scale_(grads, correction.to(grads[0].dtype))
            share = torch.as_tensor(numerics.window_mean(window[2:], self._data_size, count))
            loss, user = share[0].float(), share[1:]
        else:
            loss, user = (total / count).float(), window[3:] / count
        if self._data is not None and grads:  # replicate(): each stage's gradients averaged over its replicas
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self._data)
            flat /= self._data_size
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        user_means = dict(zip(self._names, (value.float() for value in user)))
        return self._tail(state, 1.0, samples, loss, user_means, items=items)  # the tail unscales

    def _clip_grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        """``clip``: the norm over every stage's gradients (returned), and each gradient scaled to it."""
        assert self._clip is not None
        present = [p for p in params if p.grad is not None]
        norm = self._global_norm([p.grad for p in present if p.grad is not None], self._clip.norm_type)
        torch.nn.utils.clip_grads_with_norm_(present, self._clip.max_norm, norm)
        return norm

    def _global_norm(self, grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        """The ``norm_type``-norm of every stage's gradients together (one all-reduce over the pipe group)."""
        local = grad_norm.local_norm(grads, norm_type, self._backend.device)
        if math.isinf(norm_type):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self._pipe)
            return local
        local = local ** norm_type
        dist.all_reduce(local, group=self._pipe)
        return local ** (1.0 / norm_type)


@attrs.define
class _Sums:
    """A window's sums on the last stage, added to by each micro-batch's loss."""

    first: bool = True
    is_sum: bool = False
    names: tuple[str, ...] = ()
    count: float | torch.Tensor = 0.0
    total: float | torch.Tensor = 0.0
    metrics: dict[str, Any] = attrs.Factory(dict)
    mismatch: bool = False


def _wrong_loss(out: Any) -> str | None:
    """Why ``loss_fn(output, targets)``'s result cannot be a pipelined loss, or None."""
    try:
        unpack(out)
    except (TypeError, ValueError) as e:
        return f"under pipeline(), loss_fn(output, targets): {e}"
    return None
