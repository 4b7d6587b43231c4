"""The step function of a ``deepspeed()`` program: the engine the ``Engine`` phase built
(``distributed.deepspeed``), driven one micro-batch at a time.

Per micro-batch::

    boundary  engine.set_gradient_accumulation_boundary(last of window)
    forward   loss_fn(engine, batch)                 (inputs cast to bf16/fp16 when enabled)
    backward  engine.backward(loss * b_i / (n * b_0), scale_wrt_gas=False)
    step      engine.step()                          (the update at the boundary: unscale,
                                                      clip, overflow check, optimizer and
                                                      scheduler step, zero grad)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from accelfn.data.tree import map_tensors, num_samples
from accelfn.distributed.deepspeed import CheckpointView, window_size
from accelfn.distributed.phases import Preparation
from accelfn.state import OPTIMIZER_VIEW, TrainState
from accelfn.step import NO_METRICS, detach, unpack
from accelfn.transforms import Window
from accelfn.transforms.deepspeed import DeepSpeed

if TYPE_CHECKING:
    from accelfn.backends.base import Backend


class DeepSpeedStepFn:
    """``step_fn(state, batch, *, flush=False) -> (state, metrics)`` driving a DeepSpeed engine.

    Metrics after the last micro-batch of a window: ``loss`` (the window's mean on this
    rank), the user's metrics (window means), ``lr``, ``num_samples``, and ``grad_norm``
    (with ``clip``), ``loss_scale`` and ``skipped`` (with fp16). A window closed early
    (``flush``, the end of an epoch) is averaged over ``n`` micro-batches, as DeepSpeed's
    ``gradient_accumulation_steps`` averages it.

    Raises (of a call):
        ValueError: ``state`` belongs to another model.
        NotImplementedError: an ``af.Loss`` under ``accumulate(n > 1)`` (its window's global
            item count is known only after the window's backwards, which DeepSpeed has
            already reduced).
    """

    def __init__(self, backend: Backend, prep: Preparation):
        step, state, engine = prep.step, prep.state, prep.engine
        spec = step.find(DeepSpeed)
        assert spec is not None and engine is not None
        config: Mapping[str, Any] = json.loads(engine._accelfn_config)  # noqa: SLF001  # ours
        self.step = step
        self._view: CheckpointView = getattr(state.model, OPTIMIZER_VIEW)
        self._backend = backend
        self._engine = engine
        self._owner = state.model
        self._loss_fn = step.loss_fn
        self._n = window_size(step, spec)
        self._clip = config.get("gradient_clipping", 0.0) > 0
        self._fp16 = config.get("fp16", {}).get("enabled") is True
        dtype = (torch.bfloat16 if config.get("bf16", {}).get("enabled") is True
                 else torch.float16 if self._fp16 else None)
        self._input_dtype = dtype
        self._world_size = backend.world_size

    def __call__(self, state: TrainState, batch: Any, *, flush: bool = False) -> tuple[TrainState, Mapping[str, Any]]:
        if state.model is not self._owner:
            raise ValueError("this step function was prepared for another TrainState's model; call "
                             "backend.prepare(step, state) for this state")
        engine = self._engine
        position = state.epoch_micro_step % self._n
        last = flush or position == self._n - 1
        window: Window | None = state.transforms_state.get("window") if position else None
        if self._input_dtype is not None:
            dtype = self._input_dtype
            batch = map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, batch)
        samples = num_samples(batch)
        engine.set_gradient_accumulation_boundary(last)
        loss, count, user_metrics, is_sum = unpack(self._loss_fn(engine, batch))
        if is_sum:
            coefficient, count = self._sum_coefficient(loss, count), count
        else:
            count = samples
            reference = window.reference if window is not None else self._n * samples
            coefficient = count / reference
        engine.backward(loss * coefficient if coefficient != 1.0 else loss, scale_wrt_gas=False)
        lr = engine.get_lr()[0]  # the rate this update uses: engine.step() steps the scheduler after it
        engine.step()
        self._view.open_window = not last
        weight = count if not is_sum else 1.0
        loss_sum = loss.detach().float() * weight + (window.loss_sum if window is not None else 0.0)
        metric_sums = {k: detach(v) * weight + (window.metric_sums[k] if window is not None else 0.0)
                       for k, v in user_metrics.items()}
        total = count + (window.count if window is not None else 0)
        total_samples = samples + (window.num_samples if window is not None else 0)
        if not last:
            new_window = Window(window.reference if window is not None else self._n * samples, total,
                                total_samples, loss_sum, 1.0, metric_sums)
            return state._advance(step=state.step, micro_step=state.micro_step + 1,
                                  epoch_micro_step=state.epoch_micro_step + 1,
                                  transforms_state={**state.transforms_state, "window": new_window}), NO_METRICS
        applied = bool(engine.was_step_applied())
        metrics: dict[str, Any] = {"loss": loss_sum / total, "lr": lr, "num_samples": total_samples}
        if is_sum:
            metrics["num_items"] = total
        for name, value in metric_sums.items():
            metrics[name] = value / total
        if self._clip and applied:
            norm = engine.get_global_grad_norm()
            if norm is not None:
                metrics["grad_norm"] = float(norm)
        if self._fp16:
            metrics["loss_scale"] = float(getattr(engine.optimizer, "cur_scale", float("nan")))
            metrics["skipped"] = 0 if applied else 1
        transforms_state = {k: v for k, v in state.transforms_state.items() if k != "window"}
        return state._advance(step=state.step + 1 if applied else state.step, micro_step=state.micro_step + 1,
                              epoch_micro_step=state.epoch_micro_step + 1,
                              transforms_state=transforms_state), metrics

    def _sum_coefficient(self, loss: torch.Tensor, count: Any) -> Any:
        """``W / sum(C)`` for an ``af.Loss`` of a one-micro-batch window: DeepSpeed averages the
        ranks' gradients, so each rank's summed loss is weighted by the world's item count."""
        if self._n > 1:
            raise NotImplementedError(
                "af.Loss under deepspeed() with accumulate(n > 1) is not supported: the window's item count "
                "over all ranks is known only after its backwards, which DeepSpeed has already reduced. "
                "Return a mean loss, or use one micro-batch per update"
            )
        total = torch.as_tensor(count, dtype=torch.float64, device=loss.device)
        if self._world_size > 1:
            total = self._backend.all_reduce_sum(total)
        return (self._world_size / total.clamp(min=1.0)).to(loss.dtype)


