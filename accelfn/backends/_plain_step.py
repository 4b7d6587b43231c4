"""The step function of a program whose transforms add nothing to a step, and the choice
between it and the general interpreter."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from accelfn.backends._interpreter import StepFn, foreign_state
from accelfn.backends._loss_output import detach, unpack
from accelfn.backends._primitives import Primitives
from accelfn.data.tree import num_samples
from accelfn.state import TrainState
from accelfn.step import Step


class PlainStepFn(StepFn):
    """``StepFn`` for a program whose transforms add nothing to a step (``StepFn.plain``).

    One micro-batch per update, no loss scale, clip or non-finite check, no gradient
    reduction: forward, backward, update, zero, with none of the interpreter's branches.
    An ``af.Loss`` takes the general path (its count normalizes the gradient).
    """

    def __call__(self, state: TrainState, batch: Any, *, flush: bool = False) -> tuple[TrainState, Mapping[str, Any]]:
        if state.model is not self._owner:
            raise foreign_state()
        samples = num_samples(batch)
        out = unpack(self._loss_fn(self._model, batch))
        loss, _, user_metrics, is_sum = out
        if not self._loss_kind_agreed:  # sharded, several processes: the first call only
            self._agree_loss_kind(is_sum, loss.device)
        if is_sum:
            return self._whole_window(state, samples, out)
        loss.backward()
        optimizer = self._optimizer
        metrics: dict[str, Any] = {"loss": loss.detach(), "lr": optimizer.param_groups[0]["lr"], "num_samples": samples}
        if self._num_groups > 1:
            metrics.update(self._group_lrs())
        if user_metrics:
            for name, value in user_metrics.items():
                metrics[name] = detach(value)
        optimizer.step()
        if self._scheduler is not None:
            self._scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return state._advance(step=state.step + 1, micro_step=state.micro_step + 1,
                              epoch_micro_step=state.epoch_micro_step + 1,
                              transforms_state=state.transforms_state), metrics


def step_function(backend: Primitives, step: Step, state: TrainState, model: torch.nn.Module) -> StepFn:
    """``step`` specialized for ``backend`` and ``state``: a PlainStepFn where nothing acts per step."""
    general = StepFn(backend, step, state, model)
    return PlainStepFn(backend, step, state, model) if general.plain else general
