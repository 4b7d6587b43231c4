"""``deepspeed()`` interpreted: a DeepSpeed engine built from the TrainState, and the step
function that drives it one micro-batch at a time.

``prepare`` hands the state's model, optimizer and scheduler to ``deepspeed.initialize``
with the configuration ``engine_config`` fills in from the program (accumulation, clipping,
precision, micro-batch size). The TrainState keeps the same model object (DeepSpeed
partitions a stage-3 model's parameters in place) and the same optimizer (DeepSpeed points
its groups at its fp32 partitions); the engine is kept on the model (``engine_of``), where
the checkpoint code finds it.

Per micro-batch::

    boundary  engine.set_gradient_accumulation_boundary(last of window)
    forward   loss_fn(engine, batch)                 (inputs cast to bf16/fp16 when enabled)
    backward  engine.backward(loss * b_i / (n * b_0), scale_wrt_gas=False)
    step      engine.step()                          (the update at the boundary: unscale,
                                                      clip, overflow check, optimizer and
                                                      scheduler step, zero grad)

DeepSpeed is imported on first use: it is an optional dependency (``accelfn[deepspeed]``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from accelfn.data.tree import map_tensors, num_samples
from accelfn.state import ENGINE_OWNED, TrainState
from accelfn.step import NO_METRICS, Step, detach, unpack
from accelfn.transforms import Accumulate, Clip, Window
from accelfn.transforms.deepspeed import DeepSpeed, engine_config
from accelfn.transforms.precision import Policy

if TYPE_CHECKING:
    from accelfn.backends.base import Backend

#: the attribute of a model prepared with ``deepspeed()`` that holds its engine
ENGINE_ATTRIBUTE = "_accelfn_deepspeed_engine"


def import_deepspeed() -> Any:
    """The ``deepspeed`` module.

    Raises:
        NotImplementedError: DeepSpeed is not installed.
    """
    try:
        import deepspeed
    except ImportError as e:
        raise NotImplementedError(
            f"af.deepspeed(...) needs DeepSpeed, which is not installed here ({e}); install it with "
            "`pip install --no-build-isolation 'accelfn[deepspeed]'` (next to the torch you have), or "
            "use af.shard_params() (FSDP2) instead"
        ) from e
    return deepspeed


def engine_of(model: torch.nn.Module) -> Any:
    """The DeepSpeed engine ``model`` was prepared with, or None."""
    return getattr(model, ENGINE_ATTRIBUTE, None)


def partitions_parameters(model: torch.nn.Module) -> bool:
    """True when ``model`` was prepared with ZeRO stage 3 (its forward all-gathers parameters)."""
    engine = engine_of(model)
    return engine is not None and engine.zero_optimization_stage() == 3


def prepare(backend: Backend, step: Step, state: TrainState, policy: Policy,
            ds: DeepSpeed) -> tuple[TrainState, DeepSpeedStepFn]:
    """Builds the engine for ``state`` (once per model) and the step function.

    Raises:
        NotImplementedError: DeepSpeed is not installed.
        ValueError: the model was prepared with another DeepSpeed config before.
    """
    deepspeed = import_deepspeed()
    accumulate = step.find(Accumulate)
    n = accumulate.num_micro_batches if accumulate is not None else ds.num_micro_batches or 1
    engine = engine_of(state.model)
    config = engine_config(ds, num_micro_batches=n, clip=step.find(Clip), precision=policy.name,
                           micro_batch_size=1, world_size=backend.world_size)
    if engine is None:
        deepspeed.init_distributed(dist_backend="gloo" if backend.device.type == "cpu" else "nccl",
                                   auto_mpi_discovery=False, verbose=False)
        engine, _, _, _ = deepspeed.initialize(model=state.model, optimizer=state.optimizer,
                                               lr_scheduler=state.scheduler, config=config)
        setattr(state.model, ENGINE_ATTRIBUTE, engine)
        setattr(state.model, ENGINE_OWNED, True)
        engine._accelfn_config = json.dumps(config, sort_keys=True)  # noqa: SLF001  # ours
    elif engine._accelfn_config != json.dumps(config, sort_keys=True):  # noqa: SLF001  # ours
        raise ValueError(
            "this state's model was prepared with another DeepSpeed configuration (or other accumulate/"
            "clip/precision transforms); an engine is built once per model: give the step the transforms "
            "it was prepared with, or build the state again (a new model and optimizer)"
        )
    return state, DeepSpeedStepFn(backend, step, state, engine, n, config)


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

    def __init__(self, backend: Backend, step: Step, state: TrainState, engine: Any, n: int,
                 config: Mapping[str, Any]):
        self.step = step
        self._backend = backend
        self._engine = engine
        self._owner = state.model
        self._loss_fn = step.loss_fn
        self._n = n
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
        engine.step()
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
        metrics: dict[str, Any] = {"loss": loss_sum / total, "lr": engine.get_lr()[0], "num_samples": total_samples}
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
