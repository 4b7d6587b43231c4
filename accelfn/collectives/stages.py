"""The stages of a pipelined model as checkpoints and exports see them: which names the
whole model has, which ranks hold its stages, and the one collective that joins them.

``backend.prepare`` cuts a model for ``af.pipeline`` and leaves on it a :class:`StageLayout`
(the attribute ``ATTRIBUTE``); every rank's model then holds only its own stages'
parameters, under the whole model's names. A checkpoint is written by every rank, its own
stages (``checkpoint._pipelined``); an export joins the stages of the pipeline that holds
rank 0 (data rank 0) onto rank 0 (:func:`gather_bytes`), so what it writes is the whole
model's weights; a load keeps of a checkpoint what this rank's stages hold.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.distributed as dist

#: the attribute of a pipelined model holding its StageLayout
ATTRIBUTE = "_accelfn_stage_layout"


@attrs.frozen(eq=False)
class StageLayout:
    """Where the parts of a pipelined model live.

    Attributes:
        keys: the whole model's ``state_dict`` keys, in its order.
        param_names: the whole optimizer's parameter names, per param group, in its order.
        group: the process group of this rank's pipeline (one rank per pipe position).
        ranks: the global ranks of that pipeline, by pipe position.
        data_rank: this rank's data-parallel rank (0: the pipeline that holds rank 0).
    """

    keys: tuple[str, ...]
    param_names: tuple[tuple[str, ...], ...]
    group: Any
    ranks: tuple[int, ...]
    data_rank: int


def stage_layout(model: torch.nn.Module) -> StageLayout | None:
    """The StageLayout ``model`` was cut with (``af.pipeline``), or None."""
    return getattr(model, ATTRIBUTE, None)


def gather_bytes(payload: torch.Tensor, layout: StageLayout) -> list[torch.Tensor] | None:
    """Every stage's ``payload`` (a 1-D uint8 CPU tensor) of the pipeline that holds rank 0,
    in pipe order, on rank 0; None on its other ranks. Two collectives over that pipeline's
    group (its ranks call it; the other pipelines do not)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(layout.group) == "nccl" \
        else torch.device("cpu")
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in layout.ranks]
    dist.all_gather(lengths, length, group=layout.group)
    longest = int(max(int(n) for n in lengths))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:payload.numel()] = payload.to(device)
    first = layout.ranks[0]
    received = [torch.empty_like(padded) for _ in layout.ranks] if dist.get_rank() == first else None
    dist.gather(padded, received, dst=first, group=layout.group)
    if received is None:
        return None
    return [r[:int(n)].cpu() for r, n in zip(received, lengths)]
