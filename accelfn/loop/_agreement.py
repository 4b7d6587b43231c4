"""Agreeing on a small host-side decision across ranks, one round late, without waiting.

Each round every rank proposes an int (a signal number, a "checkpoint is due" flag); the
ranks agree on the maximum. The all-reduce of round k runs asynchronously on a dedicated
gloo group over CPU tensors (whatever the training backend), and its result is read at
round k+1, when it has long arrived: the hot loop neither blocks nor touches the device,
and since every rank reads the same result at the same round, all act at the same
micro-batch. In a world of one process the proposal is the decision, at once.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


class Agreement:
    """The maximum over ranks of each round's proposals.

    Every rank must call ``propose`` the same number of times, and ``close`` at the end.

    Args:
        world_size: the number of ranks; 1 needs no communication.
        timeout_s: how long a round may wait for the slowest rank (seconds).
    """

    def __init__(self, world_size: int, timeout_s: float):
        self._group = None
        self._work = None
        self._buffers = (torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
        self._round = 0
        self._last = 0
        if world_size > 1:
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    def propose(self, value: int) -> int:
        """Proposes ``value`` for this round; returns the agreed maximum of the previous
        round (0 for the first), or ``value`` itself in a world of one process."""
        if self._group is None:
            return value
        agreed = self._finish()
        buffer = self._buffers[self._round % 2]
        buffer[0] = value
        self._work = dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._round += 1
        return agreed

    def _finish(self) -> int:
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._last = int(self._buffers[(self._round - 1) % 2][0])
        return self._last

    def close(self, *, wait: bool = True) -> None:
        """Completes the round in flight and frees the group; with ``wait=False`` (a rank
        failed and may never answer) it only lets go of them."""
        group, self._group = self._group, None
        if group is None or not wait:
            return
        self._finish()
        dist.destroy_process_group(group)
