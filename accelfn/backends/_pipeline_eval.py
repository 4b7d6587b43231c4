"""The forward of a pipelined model outside training (``af.evaluate``): the stages run
forward only, through the schedule's forward-only path (``schedule.eval``), and the last
stage's output is broadcast over the pipe group, so that every rank's ``fn`` sees it.

``_pipeline_step.prepare`` leaves on the cut model its ``(stage index, module)`` pairs and
its pipe group (:data:`ATTRIBUTE`, a plain attribute: not a submodule, so the model's
``state_dict`` is unchanged). Per call, on every rank of one pipeline::

    schedule   ScheduleGPipe (ScheduleLoopedBFS with several stages per rank) of one
               micro-batch, made once per input shape on stages of its own, .eval(*inputs)
    output     the last stage's output: its shape and dtype, then its values, broadcast
               from the last stage over the pipe group (two broadcasts)
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.distributed as dist

#: the attribute of a cut model holding its _Stages
ATTRIBUTE = "_accelfn_pipeline_stages"
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8, torch.int16)
_MAX_DIMS = 8


@attrs.define(eq=False)
class _Stages:
    """This rank's stages of a cut model, and what running them forward needs."""

    stages: list[tuple[int, torch.fx.GraphModule]]
    num_stages: int
    group: Any
    last_rank: int
    device: torch.device
    schedules: dict[Any, Any] = attrs.Factory(dict)


def keep(model: torch.nn.Module, stages: list[tuple[int, torch.fx.GraphModule]], num_stages: int, group: Any,
         last_rank: int, device: torch.device) -> None:
    """Leaves on ``model`` what :func:`forward_of` needs (a plain attribute, not a submodule)."""
    object.__setattr__(model, ATTRIBUTE, _Stages(stages, num_stages, group, last_rank, device))


class PipelinedForward:
    """``forward(*inputs) -> output``: the whole model's forward of a pipelined model, on
    every rank of its pipeline (a collective over the pipe group).

    ``af.evaluate`` hands it to ``fn`` in place of the model: ``fn(model, batch)`` calls
    ``model(inputs)`` as for an unsharded model. Every rank of a pipeline must call it
    alike (the same number of times, with inputs of the same shapes: they read the same data).

    Args (of a call):
        *inputs: the model's positional arguments, tensors of shape ``(batch, ...)``, on the
            backend's device (the first stage reads them; the other stages' are ignored but for
            their shapes).

    Returns:
        The last stage's output, shape ``(batch, ...)``, the same on every rank of the pipeline.

    Raises:
        TypeError: an input that is not a tensor, or keyword arguments.
        ValueError: an output of more than 8 dimensions or of an unusual dtype.
    """

    def __init__(self, model: torch.nn.Module, stages: _Stages):
        self.module = model
        self._stages = stages

    def __call__(self, *inputs: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs or not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
            raise TypeError("a pipelined model's forward takes its inputs as positional tensors (batch first), "
                            "without keyword arguments: call model(inputs) or model(*inputs) in fn")
        s = self._stages
        indices = [i for i, _ in s.stages]
        schedule = self._schedule(tuple((tuple(t.shape), t.dtype) for t in inputs))
        output = schedule.eval(*inputs) if 0 in indices else schedule.eval()
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=s.device)
        if s.num_stages - 1 in indices:
            output = output.detach()
            if output.ndim > _MAX_DIMS or output.dtype not in _DTYPES:
                raise ValueError(f"af.evaluate of a pipelined model: the last stage's output has shape "
                                 f"{tuple(output.shape)} and dtype {output.dtype}; at most {_MAX_DIMS} dimensions "
                                 "of a usual dtype are broadcast to the other stages")
            header[0], header[1] = output.ndim, _DTYPES.index(output.dtype)
            header[2:2 + output.ndim] = torch.tensor(output.shape, dtype=torch.int64)
        dist.broadcast(header, src=s.last_rank, group=s.group)
        ndim = int(header[0])
        if s.num_stages - 1 not in indices:
            shape = [int(n) for n in header[2:2 + ndim]]
            output = torch.empty(shape, dtype=_DTYPES[int(header[1])], device=s.device)
        output = output.contiguous()
        dist.broadcast(output, src=s.last_rank, group=s.group)
        return output

    def _schedule(self, key: Any) -> Any:
        """The forward-only schedule of one micro-batch of ``key``'s input shapes (made once)."""
        s = self._stages
        if key not in s.schedules:
            from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleLoopedBFS

            stages = [PipelineStage(module, i, s.num_stages, s.device, group=s.group) for i, module in s.stages]
            s.schedules[key] = (ScheduleGPipe(stages[0], 1) if len(stages) == 1
                                else ScheduleLoopedBFS(list[Any](stages), 1))
        return s.schedules[key]


def forward_of(model: torch.nn.Module) -> PipelinedForward | None:
    """The pipelined forward of ``model`` (cut by ``af.pipeline``), or None for another model."""
    stages = getattr(model, ATTRIBUTE, None)
    return None if stages is None else PipelinedForward(model, stages)
