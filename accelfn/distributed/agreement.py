"""The cross-rank rules, each written once: do all ranks hold the same values, does any rank
ask, did rank 0 (or every rank) succeed, did every rank arrive at the same call, and a
decision agreed one round late without waiting.

Each rule is one small collective on the default process group and means the same in a
world of one process, where it costs nothing. A rule that fails raises on every rank with
the same message, so that no rank goes on into a collective the others never reach.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from accelfn.distributed.ops import broadcast_object, default_device, exchange, rank, reduce, world_size


def extremes(values: Sequence[int | float], *, device: torch.device | None = None
             ) -> tuple[list[float], list[float]]:
    """``(lowest, highest)`` over ranks of each of ``values`` (one all-reduce of ``[v, -v]``).

    The values agree on every rank exactly when ``lowest == highest``; the two say how far
    apart they are, for a message.

    Args:
        values: this rank's numbers (the same count on every rank); ints travel as int64,
            anything else as float64.
        device: the device the group reduces tensors on (``default_device()`` if None).
    """
    if world_size() == 1:
        return list(values), list(values)
    device = default_device() if device is None else device
    integral = all(isinstance(v, int) for v in values)
    signed = [*values, *(-v for v in values)]
    both = reduce(torch.tensor(signed, dtype=torch.int64 if integral else torch.float64, device=device),
                  "max").tolist()
    return [-v for v in both[len(values):]], both[:len(values)]


def all_same(values: Sequence[int | float], *, device: torch.device | None = None) -> bool:
    """True if every rank holds the same ``values`` (``extremes``)."""
    lowest, highest = extremes(values, device=device)
    return lowest == highest


def any_rank(flag: bool, *, device: torch.device | None = None) -> bool:
    """True on every rank if ``flag`` is True on any rank (one all-reduce of one number): a
    rank that asks to stop, or has a batch left, decides for all."""
    if world_size() == 1:
        return bool(flag)
    device = default_device() if device is None else device
    return bool(reduce(torch.tensor([int(bool(flag))], dtype=torch.int64, device=device), "max").item())


def outcome_of_rank_0(failure: BaseException | None, error: Callable[[], BaseException], *,
                      device: torch.device | None = None) -> None:
    """Rank 0's outcome, told to every rank: each rank raises its own ``failure`` if it has
    one, and otherwise ``error()`` when rank 0 failed (a collective: call it on every rank).

    For work only rank 0 does (writing a checkpoint's files): the others must not go on as
    if it succeeded.

    Raises:
        BaseException: ``failure``, or ``error()`` on the other ranks when rank 0 failed.
    """
    if world_size() > 1:
        succeeded = bool(exchange(failure is None, device=device)[0])
        if failure is None and not succeeded:
            raise error()
    if failure is not None:
        raise failure


def failures(message: str | None, *, device: torch.device | None = None) -> list[str]:
    """Every rank's failure, in rank order, on every rank (a collective): each rank gives its
    own ``message`` (None: it succeeded), and all get the same list, empty when no rank
    failed, so that all of them go on or stop together; a message several ranks give (a
    failure every rank saw) is listed once. Say which rank in the message.
    """
    return list(dict.fromkeys(m for m in exchange(message, device=device) if m is not None))


class ArrivalError(RuntimeError):
    """Some rank did not reach a collective the others reached (see ``arrive``)."""


#: this process's count of passed ``arrive`` checks (the same on every rank)
_arrivals = 0


def arrive(what: str, timeout_s: float | None = None, *, detail: str = "") -> None:
    """Waits at most ``timeout_s`` seconds for every rank to reach this call too.

    A collective called inside ``if backend.is_main_process:`` would otherwise wait the
    whole process-group timeout for ranks that never come and die of a raw gloo error, or
    pair with another collective a rank runs meanwhile. Each rank marks its arrival in the
    process group's key-value store (``torch.distributed.Store``); rank 0 waits for every
    mark, then lets all go. Nothing else pairs with it, and a failed check leaves nothing
    behind, so the next call checks again. Does nothing in a world of one process (or
    where the process group has no store).

    Args:
        what: the API the ranks must all call, e.g. ``"af.save"`` (named in the error).
        detail: what must agree too, e.g. the checkpoint's path: a rank that arrived at
            another call (``af.save`` of another path, or ``af.evaluate``) is named.
        timeout_s: how long a rank waits for the others (seconds); by default a tenth of
            the process group's timeout (``accelfn launch --timeout-s``, 600 s by default).

    Raises:
        ArrivalError: on rank 0, the ranks that did not arrive within ``timeout_s``
            (named); on another rank, rank 0 did not arrive; on every rank, some rank
            arrived at another call (each rank's named).
    """
    global _arrivals
    n = world_size()
    if n == 1:
        return
    try:  # torch's own accessor (private, stable since 1.x); a group without a store is not checked
        default_store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return
    store = dist.PrefixStore("accelfn/arrive/", default_store)
    # the store's timeout is the process group's (``Store.timeout``, missing from torch's stubs)
    group_timeout: datetime.timedelta = default_store.timeout  # type: ignore[attr-defined]
    timeout = group_timeout / 10 if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    timeout_s, me = timeout.total_seconds(), rank()
    mark = f"{_arrivals}/{me}"
    call = f"{what}({detail})" if detail else what
    store.set(mark, call)
    try:
        if me == 0:
            marks = [f"{_arrivals}/{r}" for r in range(n)]
            try:
                store.wait(marks, timeout)
            except dist.DistError:
                missing = ", ".join(str(r) for r, m in enumerate(marks) if not store.check([m]))
                raise ArrivalError(
                    f"{what} was called on rank 0, but rank(s) {missing} did not call it within {timeout_s:g} s: "
                    f"{what} is a collective, call it on every rank (not inside `if backend.is_main_process:`)"
                ) from None
            called = [store.get(m).decode() for m in marks]
            others = [f"rank {r}: {c}" for r, c in enumerate(called) if c != call]
            verdict = ""
            if others:  # every rank arrived, but at another call: collectives would pair wrongly
                verdict = (f"{call} was called on rank 0 while other ranks called something else "
                           f"({'; '.join(others)}): {what} is a collective, call it on every rank at the same "
                           "point of the script (not inside `if backend.is_main_process:`)")
            store.set(f"{_arrivals}/go", verdict)
            if verdict:
                for m in marks:
                    store.delete_key(m)
                if _arrivals:
                    store.delete_key(f"{_arrivals - 1}/go")
                _arrivals += 1  # every rank arrived: this round is over on all of them
                raise ArrivalError(verdict)
            for m in marks:
                store.delete_key(m)
            if _arrivals:
                store.delete_key(f"{_arrivals - 1}/go")
        else:
            try:
                store.wait([f"{_arrivals}/go"], timeout)
            except dist.DistError:
                raise ArrivalError(
                    f"{what} was called on rank {me}, but rank 0 did not call it within {timeout_s:g} s: {what} is "
                    "a collective, call it on every rank (if rank 0 was only busier, raise the collective "
                    "timeout: accelfn launch --timeout-s)"
                ) from None
            verdict = store.get(f"{_arrivals}/go").decode()
            if verdict:
                _arrivals += 1  # every rank arrived: this round is over on all of them
                raise ArrivalError(verdict)
    except ArrivalError:
        store.delete_key(mark)  # as if this call never happened: the next one checks afresh
        raise
    _arrivals += 1


class Agreement:
    """A decision agreed one round late, without waiting: the maximum over ranks of each
    round's proposals.

    Each round every rank proposes an int (a signal number, a "checkpoint is due" flag).
    The all-reduce of round k runs asynchronously on a dedicated gloo group over CPU tensors
    (whatever the training backend), and its result is read at round k+1, when it has long
    arrived: the hot loop neither blocks nor touches the device, and since every rank reads
    the same result at the same round, all act at the same micro-batch. In a world of one
    process the proposal is the decision, at once.

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


def first_item(item: Any, present: bool, *, rank: int, device: torch.device | None = None) -> tuple[bool, Any]:
    """Whether any rank has an item, and the item this rank starts from: its own, or, when it has
    none, a copy of the lowest such rank's (sent once, pickled, its tensors on the CPU): the
    first round of keeping ranks' items in step (``Backend.lockstep``).

    Raises:
        RuntimeError: on every rank, when some rank has no item and the first item of the rank
            that would send it cannot be pickled (the error named).
    """
    (lowest,), (highest,) = extremes([int(present)], device=device)
    if not highest or lowest:  # nobody has one, or everybody does: one all-reduce
        return bool(highest), item
    src = exchange(present, device=device).index(True)
    payload, message = None, None
    if rank == src:
        try:
            payload = tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), item)
            pickle.dumps(payload)
        except Exception as e:  # noqa: BLE001  # told to every rank below
            message = (f"rank {src}'s first item must be sent to the ranks that have none, but it cannot be "
                       f"pickled ({type(e).__name__}: {e}); give every rank at least one item")
    failed = failures(message, device=device)
    if failed:
        raise RuntimeError(failed[0])
    sent = broadcast_object(payload, src)
    return True, item if present else sent


def same_length(num_batches: int | None, verb: str, *, device: torch.device | None = None) -> None:
    """Raises on every rank unless every rank has the same number of batches (or all an unknown
    number): under ``verb()`` every update's collectives pair the ranks up (one all-reduce).

    Raises:
        ValueError: naming the fewest and the most batches.
    """
    (shortest,), (longest,) = extremes([-1 if num_batches is None else num_batches], device=device)
    if longest != shortest:
        raise ValueError(
            f"under {verb}() every rank must run the same number of micro-batches, but the "
            f"ranks' data have between {shortest} and {longest} batches per epoch (-1: unknown); "
            "add af.shard_data() to split one dataset evenly over the ranks"
        )
