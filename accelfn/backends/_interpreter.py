"""The generic phase interpreter: a Step, specialized once into a step function
(``InterpreterStepFn``, or ``PlainStepFn`` for a program whose transforms add nothing to a
step); the ``StepFn`` protocol every step function follows; and the one update tail
(``UpdateTail``) of every step function that applies its updates itself.

Every backend runs this code; a backend contributes only its primitives (device, autocast,
model wrapping, gradient reduction, graph cut). What the transforms ask for is resolved in
``InterpreterStepFn.__init__`` so that the per-micro-batch path does no dispatch on them.

Per micro-batch, in phase order::

    forward   autocast(compute dtype)            loss_fn(model, batch)
    backward  no_sync unless last of window      (S_i / R * loss_scale).backward()
    -- last micro-batch of the window only --
    sync      reduce_gradients (XLA; DDP and FSDP2 reduced during backward); all-reduce item counts
    unscale   grads *= correction / loss_scale   (fused with the non-finite check; under
              shard_params on each rank's shards, the verdict summed over ranks)
    clip      clip_grad_norm_ / clip_grad_value_ (sharded: one global norm over all shards)
    check     skip the update if a gradient is inf/NaN (fp16, skip_nonfinite)
    update    optimizer.step(); scheduler.step()
    adjust    loss scale, skip counters
    zero      optimizer.zero_grad(set_to_none=True)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

from accelfn import distributed
from accelfn.data.tree import map_tensors, num_samples
from accelfn.distributed import ddp, fsdp, grad_norm
from accelfn.errors import NonFiniteError
from accelfn.state import TrainState
from accelfn.step import NO_METRICS, Step, detach, unpack
from accelfn.transforms import (
    Accumulate,
    Clip,
    ClipValue,
    PowerSGDMemory,
    Replicate,
    ShardParams,
    SkipNonfinite,
    Window,
    WithPrecision,
    numerics,
)
from accelfn.transforms.precision import LossScale, Policy, SkipCount, parse_policy

if TYPE_CHECKING:
    from accelfn.backends.base import Backend
    from accelfn.distributed.phases import Preparation

_NULL = contextlib.nullcontext()
_FP32 = parse_policy("fp32")


def foreign_state() -> ValueError:
    return ValueError(
        "this step function was prepared for another TrainState's model; call "
        "backend.prepare(step, state) for this state"
    )


def _add(acc: torch.Tensor | float | None, value: torch.Tensor | float) -> torch.Tensor | float:
    return value if acc is None else acc + value


class StepFn(Protocol):
    """``step_fn(state, batch, *, flush=False) -> (state, metrics)``: one micro-batch of ``step``.

    What ``backend.prepare(step, state)`` returns: the interpreter's (``InterpreterStepFn``,
    ``PlainStepFn``), invariant's, the pipeline's or DeepSpeed's step function, chosen once.
    ``metrics`` is empty except after the last micro-batch of an accumulation window, where
    the optimizer update happened (or was skipped).

    Attributes:
        step: the program it runs (with what ``accelfn launch`` added).
    """

    step: Step

    def __call__(self, state: TrainState, batch: Any, *, flush: bool = False) -> tuple[TrainState, Mapping[str, Any]]:
        ...


class UpdateTail:
    """The end of every update a step function applies itself (the interpreter's, invariant's,
    the pipeline's): given the window's gradients on the parameters, in one place::

        sync      reduce_gradients (XLA; DDP and FSDP2 reduced during backward)
        unscale   grads *= correction / loss_scale   (fused with the non-finite check under
                  fp16 and skip_nonfinite; the verdict summed over ranks where each rank checked
                  only its part of the gradients: shards, a split, a stage)
        metrics   loss, lr (and lr/group{i}), num_samples, num_items, the user's means
        clip      the step function's norm (grad_norm, measured before clipping) / clip_value
        check     an update with inf/NaN gradients skipped: skip count, loss scale adjusted
        update    optimizer.step(); scheduler.step()
        zero      optimizer.zero_grad(set_to_none=True)
        advance   counters; the window's record dropped; a PowerSGD hook's state recorded
        errors    NonFiniteError after too many skips in a row, or a loss scale below its floor

    Args:
        backend: the backend (its reduce, graph cut).
        step: the program (its precision, clip, clip_value, skip_nonfinite).
        state: the state prepared (its optimizer and scheduler).
        grads: ``grads(params) -> tensors``: the gradients to unscale in place.
        clip_norm: ``clip_norm(params) -> norm``: clips and returns the total norm (``clip``).
        verdict_over_ranks: sum the non-finite verdict over every rank (each saw a part).
        skips_agree: every rank skips the same updates (the norm of a skipped update is left out).
        reduce_gradients: averages gradients over ranks before the update (XLA), or None.
        comm: a PowerSGD hook's live state, recorded after each update, or None.
    """

    def __init__(self, backend: Backend, step: Step, state: TrainState, *,
                 grads: Callable[[list[torch.Tensor]], list[torch.Tensor]],
                 clip_norm: Callable[[list[torch.Tensor]], torch.Tensor], verdict_over_ranks: bool,
                 skips_agree: bool, reduce_gradients: Callable[[list[torch.nn.Parameter]], None] | None = None,
                 comm: ddp.PowerSGDHook | None = None):
        precision, skip = step.find(WithPrecision), step.find(SkipNonfinite)
        self._backend = backend
        self._optimizer = state.optimizer
        self._scheduler = state.scheduler
        self.params = [p for group in state.optimizer.param_groups for p in group["params"]]
        self._num_groups = len(state.optimizer.param_groups)
        # several learning rates at the start: log each group's (a fixed set of names for the run)
        self._lr_per_group = len({float(g["lr"]) for g in state.optimizer.param_groups}) > 1
        policy = precision.policy if precision else _FP32
        self.scaling = policy.scaling
        self._clip, self._clip_value = step.find(Clip), step.find(ClipValue)
        self.guard = self.scaling is not None or skip is not None
        self._max_skips = (
            self.scaling.max_consecutive_skips if self.scaling is not None
            else skip.max_consecutive_skips if skip is not None else 0
        )
        self._grads = grads
        self._clip_norm = clip_norm
        self._verdict_over_ranks = verdict_over_ranks and backend.world_size > 1
        self._skips_agree = skips_agree
        self._reduce_gradients = reduce_gradients
        self._comm = comm
        self._graph_cut = backend.graph_cut

    def __call__(self, state: TrainState, correction: float | torch.Tensor, samples: int,
                 loss_mean: torch.Tensor | float, metric_means: Mapping[str, Any], *,
                 items: Any = None) -> tuple[TrainState, Mapping[str, Any]]:
        """The update of a closed window: ``correction`` divides the summed gradients into the
        window's mean; ``samples`` (``items``) are this rank's in the window."""
        params = self.params
        if self._reduce_gradients is not None:
            self._reduce_gradients(params)
        transforms_state = state.transforms_state
        loss_scale: LossScale | None = transforms_state["loss_scale"] if self.scaling is not None else None
        inv_scale = correction / loss_scale.scale if loss_scale is not None else correction

        found_inf = None
        if self.guard:
            found_inf = numerics.unscale_and_check(self._grads(params), inv_scale)
            if self._verdict_over_ranks:  # each rank checked only its part
                found_inf = self._backend.reduce(found_inf, "sum")
        elif isinstance(inv_scale, torch.Tensor) or inv_scale != 1.0:
            numerics.scale_(self._grads(params), inv_scale)

        # this rank's window means, the lr this update uses, and the window's sample count
        metrics: dict[str, Any] = {"loss": loss_mean, "lr": self._optimizer.param_groups[0]["lr"],
                                   "num_samples": samples}
        if self._num_groups > 1:
            metrics.update(self._group_lrs())
        if items is not None:  # an af.Loss's items in the window on this rank (tokens, say)
            metrics["num_items"] = items
        for name, value in metric_means.items():
            metrics[name] = detach(value)
        if self._clip is not None:
            metrics["grad_norm"] = self._clip_norm(params)
        elif self._clip_value is not None:
            torch.nn.utils.clip_grad_value_(params, self._clip_value.max_value)

        finite = True
        if found_inf is not None:
            finite = not bool(found_inf.item())  # the one host sync of a guarded update
            changes: dict[str, Any] = {"skips": transforms_state["skips"].record(finite)}
            metrics["skipped"] = 0 if finite else 1
            if not finite and self._skips_agree:  # the norm of non-finite gradients is no norm (docs/05)
                metrics.pop("grad_norm", None)
            if loss_scale is not None:
                metrics["loss_scale"] = loss_scale.scale
                changes["loss_scale"] = loss_scale.adjust(finite, self.scaling)  # type: ignore[arg-type]  # set whenever loss_scale is
            transforms_state = {**transforms_state, **changes}
        if finite:
            self._optimizer.step()
            if self._scheduler is not None:
                self._scheduler.step()
        self._optimizer.zero_grad(set_to_none=True)

        if "window" in transforms_state:
            transforms_state = {k: v for k, v in transforms_state.items() if k != "window"}
        if self._comm is not None:  # the hook's state after this update's synchronizing backward
            transforms_state = {**transforms_state, "comm_hook": ddp.record(self._comm)}
        new_state = state._advance(
            step=state.step + 1 if finite else state.step,
            micro_step=state.micro_step + 1,
            epoch_micro_step=state.epoch_micro_step + 1,
            transforms_state=transforms_state,
        )
        if self._graph_cut is not None:
            self._graph_cut()
        if found_inf is not None:
            self._check_skips(new_state)
        return new_state, metrics

    def _group_lrs(self) -> dict[str, Any]:
        """With several parameter groups: ``lr``, the learning rate of the first group this
        update changes (one with a gradient; group 0 if none has), and, when the groups'
        learning rates differed when the step function was made, ``lr/group{i}`` for each
        group ``i``. Read before ``zero_grad``, while the gradients show which groups the
        update uses. (With one group, ``lr`` is simply its learning rate.)
        """
        groups = self._optimizer.param_groups
        used = next((g for g in groups if any(p.grad is not None for p in g["params"])), groups[0])
        if not self._lr_per_group:
            return {"lr": used["lr"]}
        return {"lr": used["lr"], **{f"lr/group{i}": g["lr"] for i, g in enumerate(groups)}}

    def _check_skips(self, state: TrainState) -> None:
        skips: SkipCount = state.transforms_state["skips"]
        loss_scale: LossScale | None = state.transforms_state.get("loss_scale")
        if skips.consecutive >= self._max_skips:
            raise NonFiniteError(
                f"{skips.consecutive} optimizer updates in a row had inf/NaN gradients and were "
                f"skipped (step {state.step}); the loss or the model produces non-finite values. "
                "Check the data and the learning rate, compute the loss in fp32, or raise "
                "max_consecutive_skips"
            )
        if loss_scale is not None and loss_scale.scale < self.scaling.min_scale:  # type: ignore[union-attr]  # set with loss_scale
            raise NonFiniteError(
                f"the fp16 loss scale fell to {loss_scale.scale:g}, below its floor "
                f"{self.scaling.min_scale:g} (step {state.step}): the gradients are inf or NaN even "  # type: ignore[union-attr]  # as above
                "at a scale this small, so the loss itself is probably not finite (check the data and the "
                "learning rate), or the model overflows fp16: use with_precision('bf16'), or compute the "
                "loss in fp32"
            )


class InterpreterStepFn:
    """``step_fn(state, batch, *, flush=False) -> (state, metrics)``: one micro-batch.

    Made by ``backend.prepare(step, state)``. ``metrics`` is empty except after the last
    micro-batch of an accumulation window, where the optimizer update happened (or was
    skipped): then it holds ``loss`` (the window's mean), the user's metrics, ``lr``,
    ``num_samples`` (this rank's samples in the window), ``num_items`` (with an
    ``af.Loss``: this rank's counted items in the window), and as the transforms add them
    ``grad_norm``, ``loss_scale`` and ``skipped``. Values may be device tensors: reading
    them synchronizes, so read them only when logging.

    Args (of a call):
        state: the state this function was prepared for (or its successor).
        batch: one micro-batch, already on the backend's device.
        flush: close the accumulation window after this micro-batch even if it is not
            full (the loop passes True on the last micro-batch of an epoch).

    Raises (of a call):
        ValueError: the loss is not a scalar, or ``state`` belongs to another model.
        TypeError: ``loss_fn`` returned something other than a loss, ``(loss, metrics)`` or
            ``af.Loss``.
        NonFiniteError: too many consecutive updates skipped for non-finite gradients.
    """

    def __init__(self, backend: Backend, step: Step, state: TrainState, model: torch.nn.Module):
        accumulate = step.find(Accumulate)
        precision = step.find(WithPrecision)
        self.step = step
        self._backend = backend
        self._loss_fn = step.loss_fn
        self._model = model  # what the forward calls: DDP- or otherwise wrapped
        self._owner = state.model
        self._params = [p for group in state.optimizer.param_groups for p in group["params"]]
        self._n = accumulate.num_micro_batches if accumulate else 1
        self._policy: Policy = precision.policy if precision else _FP32
        self._scaling = self._policy.scaling
        self._clip = step.find(Clip)
        shard = step.find(ShardParams)
        replicated = step.find(Replicate) is not None and backend.world_size > 1
        # sharded: gradients are DTensor shards, reduce-scattered (averaged) during backward
        self._sharded = sharded = shard is not None and fsdp.is_sharded(state.model)
        # some parameters are DTensors (shard_params, tensor_parallel): gradients are taken shard by shard
        self._distributed_params = any(distributed.is_dtensor(p) for p in self._params)
        self._data_parallel = data_parallel = (replicated or sharded) and backend.world_size > 1
        self._world_size = backend.world_size if data_parallel else 1
        self._loss_kind_agreed = not data_parallel  # checked at the first micro-batch (_agree_loss_kind)
        sync_every = shard is not None and sharded and shard.reduce_every_micro_batch
        self._no_sync: Callable[[], Any] = (
            backend.no_sync(model) if data_parallel and not sync_every else lambda: _NULL)
        self._autocast = backend.autocast if self._policy.autocast else None
        self._cast_inputs = self._policy.casts_inputs
        self._graph_cut = backend.graph_cut
        # a PowerSGD hook's live state, and the record of it the state carries (distributed.ddp)
        self._comm = ddp.live_state(model) if replicated else None
        self._comm_record = state.transforms_state.get("comm_hook")
        # every rank skips the same updates (one rank, all-reduced gradients, or a sharded or
        # split model's inf check summed over ranks), so a skipped update's metrics can leave
        # grad_norm out without the ranks reducing different names
        self._tail = UpdateTail(
            backend, step, state, grads=self._grads, clip_norm=self._clip_grad_norm,
            verdict_over_ranks=self._distributed_params,
            skips_agree=data_parallel or backend.world_size == 1 or self._distributed_params,
            reduce_gradients=backend.reduce_gradients if replicated else None, comm=self._comm)

    # -- one micro-batch ---------------------------------------------------------------

    def __call__(self, state: TrainState, batch: Any, *, flush: bool = False) -> tuple[TrainState, Mapping[str, Any]]:
        if state.model is not self._owner:
            raise foreign_state()
        position = state.epoch_micro_step % self._n
        last = flush or position == self._n - 1
        if last and self._comm is not None and state.transforms_state.get("comm_hook") is not self._comm_record:
            self._load_comm_state(state)  # a state loaded or restored since: its hook state, before the hook runs
        if self._cast_inputs:
            dtype = self._policy.param_dtype
            batch = map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, batch)
        if position or not last:
            return self._window_part(state, batch, state.transforms_state.get("window") if position else None, last)
        samples = num_samples(batch)
        return self._whole_window(state, samples, self._forward(batch))

    def _whole_window(self, state: TrainState, samples: int,
                      out: tuple[torch.Tensor, Any, Mapping[str, Any], bool]) -> tuple[TrainState, Mapping[str, Any]]:
        """A window of one micro-batch, given its unpacked forward: backward, then update.

        ``R = C``, so the backward is of the plain (mean) loss.
        """
        loss, count, user_metrics, is_sum = out
        scale = state.transforms_state["loss_scale"].scale if self._scaling is not None else 1.0
        if is_sum:
            reference = self._reference(count, is_sum, loss)
            (loss * (scale / reference)).backward()
            world, global_count = self._global_count(count, is_sum, loss)
            correction = numerics.window_correction(reference, world, global_count)
            mean = numerics.window_mean(loss.detach(), world, global_count)
            if user_metrics:
                user_metrics = {k: numerics.window_mean(detach(v) * count, world, global_count)
                                for k, v in user_metrics.items()}
        else:
            (loss * scale if scale != 1.0 else loss).backward()
            correction, mean = 1.0, loss.detach()
        return self._update(state, correction, samples, mean, user_metrics, items=count if is_sum else None)

    def _forward(self, batch: Any) -> tuple[torch.Tensor, Any, Mapping[str, Any], bool]:
        if self._autocast is not None:
            with self._autocast(self._policy):
                out = unpack(self._loss_fn(self._model, batch))
        else:
            out = unpack(self._loss_fn(self._model, batch))
        if not self._loss_kind_agreed:
            self._agree_loss_kind(out[3])
        return out

    def _agree_loss_kind(self, is_sum: bool) -> None:
        """Raises on every rank unless all ranks' first ``loss_fn`` result is of one kind.

        An ``af.Loss`` adds all-reduces of its counts that a plain (mean) loss does not: with
        the kinds mixed across data-parallel ranks, one rank's count would pair with another's
        gradients and the job would wait out the process-group timeout. One all-reduce of two
        numbers, before the first backward of the run, finds it out instead.
        """
        self._loss_kind_agreed = True
        if not distributed.all_same([int(is_sum)], device=self._backend.collective_device):
            raise ValueError(
                f"loss_fn returned an af.Loss on some ranks and a plain loss on others (this is rank "
                f"{self._backend.rank}: {'an af.Loss' if is_sum else 'a plain loss'}); the ranks reduce "
                "an af.Loss's counts together, so loss_fn must return the same kind on every rank"
            )

    def _window_part(self, state: TrainState, batch: Any, window: Window | None,
                     last: bool) -> tuple[TrainState, Mapping[str, Any]]:
        """A micro-batch of a window of several: accumulate, and close the window if ``last``."""
        samples = num_samples(batch)
        with _NULL if last else self._no_sync():
            loss, count, user_metrics, is_sum = self._forward(batch)
            if count is None:
                count = samples
            reference = window.reference if window is not None else self._reference(count, is_sum, loss)
            scale = state.transforms_state["loss_scale"].scale if self._scaling is not None else 1.0
            # backward of S_i / R * scale, where S_i = l_i * b_i for a mean loss
            coefficient = (scale / reference) if is_sum else (count / reference * scale)
            if isinstance(coefficient, torch.Tensor) or coefficient != 1.0:
                (loss * coefficient).backward()
            else:
                loss.backward()

        # the logged loss: one tensor op per micro-batch (S_i in units of the first weight)
        if window is None:
            unit, loss_sum = (1.0 if is_sum else max(count, 1)), loss.detach()
        else:
            unit, weight = window.unit, (1.0 if is_sum else count / window.unit)
            loss_sum = (
                window.loss_sum + loss.detach()
                if weight == 1.0
                else window.loss_sum.add(loss.detach(), alpha=weight)
            )
        total_count = _add(window.count if window else None, count)
        metric_sums = self._add_metrics(window, user_metrics, count)
        total_samples = samples + (window.num_samples if window else 0)
        if not last:
            new_window = Window(reference, total_count, total_samples, loss_sum, unit, metric_sums)
            if self._graph_cut is not None:
                self._graph_cut()
            return state._advance(
                step=state.step,
                micro_step=state.micro_step + 1,
                epoch_micro_step=state.epoch_micro_step + 1,
                transforms_state={**state.transforms_state, "window": new_window},
            ), NO_METRICS
        world, global_count = self._global_count(total_count, is_sum, loss)
        correction = numerics.window_correction(reference, world, global_count)
        if is_sum:  # the update's loss over the window's items on every rank (unit is 1)
            user_means = {k: numerics.window_mean(v, world, global_count) for k, v in metric_sums.items()}
            mean_loss = numerics.window_mean(loss_sum, world, global_count)
        else:
            user_means = {k: v / total_count for k, v in metric_sums.items()}
            mean_loss = loss_sum * (unit / total_count)
        return self._update(state, correction, total_samples, mean_loss, user_means,
                            items=total_count if is_sum else None)

    def _reference(self, count: Any, is_sum: bool, loss: torch.Tensor) -> float | torch.Tensor:
        # Under replicate, an af.Loss's counts differ across ranks, but R must be the same
        # number everywhere (DDP averages S_i / R over ranks). Any such R is exact; 1 costs
        # nothing, but under fp16 it would back-propagate the *summed* loss, C times the
        # gradients of a mean and C times likelier to overflow the loss scale. There R is
        # n times the ranks' mean count (one scalar all-reduce per window), as one big
        # batch would have it. Mean losses have equal sample counts on every rank.
        if is_sum and self._data_parallel:
            if self._scaling is None:
                return 1.0
            local = torch.as_tensor(count, dtype=torch.float32, device=loss.device)
            mean_count = self._backend.all_reduce_sum(local) / self._world_size
            return numerics.window_reference(self._n, mean_count)
        return numerics.window_reference(self._n, count)

    def _global_count(self, count: Any, is_sum: bool, loss: torch.Tensor) -> tuple[int, Any]:
        """``(W, sum(C))`` of the window: an ``af.Loss``'s counts are summed over the ``W``
        ranks (one all-reduce); a mean loss's samples are this rank's (``W = 1``: DDP's
        average over ranks is already the mean of equal-sized rank means)."""
        if is_sum and self._data_parallel:
            global_count = self._backend.all_reduce_sum(
                torch.as_tensor(count, dtype=torch.float64, device=loss.device))
            return self._world_size, global_count
        return 1, count

    def _add_metrics(self, window: Window | None, metrics: Mapping[str, Any], count: Any) -> Mapping[str, Any]:
        if not metrics:
            return window.metric_sums if window else NO_METRICS
        previous = window.metric_sums if window else NO_METRICS
        return {k: _add(previous.get(k), detach(v) * count) for k, v in metrics.items()}

    # -- the last micro-batch of a window: sync, unscale, clip, check, update ----------

    def _update(self, state: TrainState, correction: float | torch.Tensor, samples: int,
                loss_mean: torch.Tensor | float, metric_means: Mapping[str, Any], *,
                items: Any = None) -> tuple[TrainState, Mapping[str, Any]]:
        new_state, metrics = self._tail(state, correction, samples, loss_mean, metric_means, items=items)
        if self._comm is not None:  # the record this update left: not loaded into the hook again
            self._comm_record = new_state.transforms_state.get("comm_hook")
        return new_state, metrics

    def _clip_grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        """``clip``: the gradients' total norm (returned), and each gradient scaled to it."""
        assert self._clip is not None
        if self._distributed_params:
            return grad_norm.clip_grad_norm(params, self._clip.max_norm, self._clip.norm_type,
                                        self._backend.collective_device)
        return torch.nn.utils.clip_grad_norm_(params, self._clip.max_norm, self._clip.norm_type)

    def _load_comm_state(self, state: TrainState) -> None:
        memory = state.transforms_state.get("comm_hook")
        if isinstance(memory, PowerSGDMemory):
            ddp.load(self._comm, memory, self._backend.device)  # type: ignore[arg-type]  # set with _comm
        self._comm_record = memory

    def _grads(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients to scale in place: under sharding, each DTensor's local shard."""
        if self._distributed_params:
            return grad_norm.local_gradients(params)
        return [p.grad for p in params if p.grad is not None]

class PlainStepFn(InterpreterStepFn):
    """``InterpreterStepFn`` for a program whose transforms add nothing to a step (``step_function``).

    One micro-batch per update, no loss scale, clip or non-finite check, no gradient
    reduction: forward, backward, then the update tail, with none of the interpreter's
    branches. An ``af.Loss`` takes the general path (its count normalizes the gradient).
    """

    def __call__(self, state: TrainState, batch: Any, *, flush: bool = False) -> tuple[TrainState, Mapping[str, Any]]:
        if state.model is not self._owner:
            raise foreign_state()
        samples = num_samples(batch)
        out = unpack(self._loss_fn(self._model, batch))
        loss, _, user_metrics, is_sum = out
        if not self._loss_kind_agreed:  # sharded, several processes: the first call only
            self._agree_loss_kind(is_sum)
        if is_sum:
            return self._whole_window(state, samples, out)
        loss.backward()
        return self._tail(state, 1.0, samples, loss.detach(), user_metrics)


def step_function(backend: Backend, prep: Preparation) -> StepFn:
    """The interpreter's step function of ``prep``'s program: a PlainStepFn where nothing acts
    between backward and update (one micro-batch per update, no loss scale, clip, non-finite
    check, autocast, input cast, explicit gradient reduction or graph cut), else an
    InterpreterStepFn."""
    step = prep.step
    accumulate, precision = step.find(Accumulate), step.find(WithPrecision)
    policy = precision.policy if precision else _FP32
    plain = ((accumulate is None or accumulate.num_micro_batches == 1) and policy.scaling is None
             and not policy.autocast and not policy.casts_inputs and step.find(SkipNonfinite) is None
             and step.find(Clip) is None and step.find(ClipValue) is None and backend.graph_cut is None
             and not (step.find(Replicate) is not None and backend.world_size > 1))
    return (PlainStepFn if plain else InterpreterStepFn)(backend, step, prep.state, prep.model)
