"""``count_updates``: how many optimizer updates ``run`` applies, per epoch and in total."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import attrs

from accelfn.backends.base import Backend
from accelfn.data.blocks import epoch_length
from accelfn.state import TrainState, require_state
from accelfn.step import Step
from accelfn.transforms.deepspeed import micro_batches_per_update


@attrs.frozen
class UpdateCount:
    """What ``count_updates`` returns.

    Attributes:
        per_epoch: optimizer updates in each epoch: ``ceil(micro_batches_per_epoch / n)``
            under ``accumulate(n)`` (an epoch's last, partial window is one more update);
            None for data of unknown length.
        total: optimizer updates of the whole job: ``epochs * per_epoch``, capped at
            ``max_steps``; counted from a given ``state``'s position, the step the job ends at.
        micro_batches_per_epoch: this process's micro-batches in each epoch (after sharding),
            or None for data of unknown length.
    """

    per_epoch: int | None
    total: int
    micro_batches_per_epoch: int | None


def count_updates(step: Step, data: Iterable[Any], *, backend: Backend, epochs: int | None = 1,
                  max_steps: int | None = None, state: TrainState | None = None) -> UpdateCount:
    """The optimizer updates ``run(step, state, data, backend=backend, epochs=epochs,
    max_steps=max_steps)`` applies, per epoch and in total, counted from the start of training.

    Exactly what ``run`` does, with the same sharding (``shard_data``'s padding or
    ``drop_last``, the DataLoader's ``drop_last``), the same world size and the partial
    accumulation window flushed at each epoch's end, so a learning-rate schedule sized by
    ``total`` (``OneCycleLR(total_steps=...)``, a linear warm-up and decay) ends exactly at
    the last update. Updates that fp16 skips for overflow are counted but do not step the
    scheduler, so the schedule never runs past its end. Nothing is read from ``data`` and no
    collective is called.

    Args:
        step: the program (its ``shard_data``, ``accumulate`` or DeepSpeed's
            ``gradient_accumulation_steps``, and the mesh its ``tensor_parallel``/``pipeline``
            make: the ranks of one group read one data shard; under ``invariant()`` its
            blocks, ``floor(N / (W A b))`` updates an epoch, decide the count).
        data: the DataLoader or sized iterable ``run`` will read.
        backend: the backend ``run`` will use (its rank and world size shard the data; under
            ``accelfn plan`` it stands for rank 0 of the planned world, as ``af.plan`` counts).
        epochs: total epochs of the job, or None to train until ``max_steps``.
        max_steps: total optimizer updates of the job, or None for no limit.
        state: a state part-way through the job (a resumed one): ``total`` is then
            ``state.step`` plus the updates left from its position (its epoch and the
            micro-batches of it consumed), which is where ``run`` stops even when the
            checkpoint was written by another number of processes (whose updates were of
            other sizes). None: from the start of training.

    Returns:
        UpdateCount: ``per_epoch``, ``total`` and ``micro_batches_per_epoch``.

    Raises:
        TypeError: ``step`` is not a Step, ``backend`` not a backend, or ``state`` not a TrainState.
        ValueError: ``epochs``/``max_steps`` below 1, both None, or ``data`` of unknown length
            (an IterableDataset or a generator) without ``max_steps``.

    Example:
        >>> import torch, accelfn as af
        >>> data = torch.utils.data.DataLoader(torch.randn(200, 4), batch_size=8)  # 25 batches
        >>> step = af.accumulate(2)(af.train_step(lambda m, x: m(x).pow(2).mean()))
        >>> af.count_updates(step, data, backend=af.backends.CPU(), epochs=3)
        UpdateCount(per_epoch=13, total=39, micro_batches_per_epoch=25)
    """
    if not isinstance(step, Step):
        raise TypeError(f"count_updates() takes a Step first (af.train_step(loss_fn)), got {type(step).__name__}")
    if not isinstance(backend, Backend):
        raise TypeError(f"count_updates(backend=...) must be a backend such as af.backends.auto(), got {backend!r}")
    if state is not None:
        require_state("af.count_updates(..., state=...)", state)
    for name, value in (("epochs", epochs), ("max_steps", max_steps)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"count_updates({name}={value!r}): must be an int >= 1 or None")
    if epochs is None and max_steps is None:
        raise ValueError("count_updates(epochs=None) counts until max_steps, so it needs max_steps=<total updates>")
    # the data shard this rank reads (under `accelfn plan`, rank 0 of the planned world)
    data_rank, data_world = backend.mesh(step).data_coordinates(backend.rank)
    micro_batches = epoch_length(data, step, rank=data_rank, world_size=data_world)
    if micro_batches is None:
        if max_steps is None:
            raise ValueError(
                f"count_updates(): the number of batches of {type(data).__name__} is not known in advance (an "
                "IterableDataset or a generator), so neither is the number of updates; give the data a length, "
                "or train by steps: run(..., epochs=None, max_steps=N) applies exactly N updates"
            )
        return UpdateCount(per_epoch=None, total=max_steps, micro_batches_per_epoch=None)
    n = micro_batches_per_update(step)
    per_epoch = math.ceil(micro_batches / n)  # an epoch's partial last window is one more update
    if epochs is None:
        total = max_steps
    elif state is None:
        total = epochs * per_epoch if max_steps is None else min(epochs * per_epoch, max_steps)
    else:  # the current epoch's windows not begun or not closed, then whole epochs
        left = 0 if state.epoch >= epochs else (
            per_epoch - min(state.epoch_micro_step // n, per_epoch) + (epochs - state.epoch - 1) * per_epoch)
        total = state.step + left if max_steps is None else min(state.step + left, max_steps)
    return UpdateCount(per_epoch=per_epoch, total=total, micro_batches_per_epoch=micro_batches)  # type: ignore[arg-type]
