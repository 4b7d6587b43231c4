"""Collectives over ``torch.distributed``, working unchanged on a world of size 1.

Every function acts on the default process group when one is initialized with more than
one rank, and is the identity (or its one-rank equivalent) otherwise. Tensors must live on
the device the process group's backend expects (CPU for gloo, the rank's GPU for NCCL,
the XLA device for torch_xla's group); the backends' methods of the same names take care
of that.
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeGuard, TypeVar

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

ReduceOp = Literal["sum", "mean", "max", "min"]
REDUCE_OPS: tuple[str, ...] = ("sum", "mean", "max", "min")
T = TypeVar("T")


def is_dtensor(value: object) -> TypeGuard[DTensor]:
    """True for a ``DTensor`` (a tensor sharded over ranks, as FSDP2's parameters).

    ``torch.distributed.tensor`` is only looked up among the modules already imported: no
    DTensor can exist before it is, and importing it (with FSDP2 and DCP, which accelfn
    imports when it first shards or saves shards) takes about 0.7 s that every process
    start would otherwise pay.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def world_size() -> int:
    """The number of ranks of the default group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in the default group (0 without one)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def default_device() -> torch.device:
    """The device the default group's backend exchanges tensors on: this process's current
    GPU for NCCL, the CPU otherwise (gloo, or a world of one)."""
    if world_size() > 1 and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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


def barrier() -> None:
    """Waits until every rank reaches this call."""
    if world_size() > 1:
        dist.barrier()


def reduce(tensor: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor:
    """All-reduces ``tensor`` across ranks and returns the result (the input is not changed).

    Args:
        tensor: any shape; integer tensors are averaged in float64 for ``"mean"``.
        op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.

    Returns:
        torch.Tensor: same shape as ``tensor``; the same value on every rank.

    Raises:
        ValueError: an unknown ``op``.
        TypeError: ``tensor`` is not a tensor.
    """
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce(op={op!r}): accepted values are {', '.join(map(repr, REDUCE_OPS))}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"reduce() takes a tensor, got {type(tensor).__name__}")
    out = tensor.detach().clone()
    if op == "mean" and not out.is_floating_point():
        out = out.to(torch.float64)
    n = world_size()
    if n == 1:
        return out
    torch_op = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM,
                "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    dist.all_reduce(out, op=torch_op)
    return out / n if op == "mean" else out


def broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Returns rank ``src``'s ``tensor`` on every rank (shapes must agree).

    Raises:
        ValueError: ``src`` is not a rank of the group.
    """
    n = world_size()
    if not 0 <= src < n:
        raise ValueError(f"broadcast(src={src}): ranks are 0..{n - 1}")
    out = tensor.detach().clone()
    if n > 1:
        dist.broadcast(out, src=src)
    return out


def pad_across_processes(
    tensor: torch.Tensor, *, dim: int = 0, pad_index: float = 0, pad_first: bool = False
) -> torch.Tensor:
    """Pads ``tensor`` along ``dim`` to the largest size any rank has there.

    Args:
        tensor: this rank's tensor; all ranks must agree on the number of dimensions.
        dim: the dimension to pad.
        pad_index: the fill value.
        pad_first: pad at the start instead of the end.
    """
    n = world_size()
    if n == 1 or tensor.ndim == 0:
        return tensor
    size = torch.tensor([tensor.shape[dim]], device=tensor.device, dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(n)]
    dist.all_gather(sizes, size)
    longest = int(max(s.item() for s in sizes))
    if longest == tensor.shape[dim]:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = longest - tensor.shape[dim]
    fill = tensor.new_full(shape, pad_index)
    return torch.cat([fill, tensor] if pad_first else [tensor, fill], dim=dim)


def gather(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenates every rank's ``tensor`` along dim 0, in rank order.

    Leading dimensions may differ across ranks (lengths 2 and 3 give 5); the other
    dimensions and the dtype must agree. A 0-d tensor is gathered as one element per rank.

    Returns:
        torch.Tensor: shape ``(sum of leading sizes, *tensor.shape[1:])`` on every rank.

    Raises:
        ValueError: on every rank, when the ranks' tensors differ in a dimension other than
            the first or in dtype (the message lists each rank's shape and dtype).
    """
    if tensor.ndim == 0:
        tensor = tensor.reshape(1)
    n = world_size()
    if n == 1:
        return tensor.detach().clone()
    tensor = tensor.detach().contiguous()
    local = torch.tensor(_describe(tensor), device=tensor.device, dtype=torch.int64)
    descriptions = [torch.zeros_like(local) for _ in range(n)]
    dist.all_gather(descriptions, local)
    described = [d.tolist() for d in descriptions]
    if any(d[1:] != described[0][1:] for d in described):
        shapes = ", ".join(f"rank {r}: {_shown(d)}" for r, d in enumerate(described))
        raise ValueError(f"gather(): the ranks' tensors must agree in every dimension but the first and in "
                         f"dtype; got {shapes}")
    lengths = [d[0] for d in described]
    longest = max(lengths)
    padded = tensor
    if tensor.shape[0] < longest:
        fill = tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))
        padded = torch.cat([tensor, fill])
    parts = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:length] for p, length in zip(parts, lengths)])


#: dimensions after the first that ``gather`` compares one by one (and the rest by their product)
_DESCRIBED_DIMS = 6
_DTYPES = tuple(sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))


def _describe(tensor: torch.Tensor) -> list[int]:
    """``[first dim, ndim, dtype index, numel of the rest, dims 1..6 zero-padded]``."""
    rest = tensor.shape[1:]
    dims = list(rest[:_DESCRIBED_DIMS]) + [0] * max(0, _DESCRIBED_DIMS - len(rest))
    return [tensor.shape[0], tensor.ndim, _DTYPES.index(tensor.dtype), rest.numel(), *dims]


def _shown(description: list[int]) -> str:
    first, ndim, dtype, _, *dims = description
    shape = (first, *dims[: ndim - 1], *(["..."] if ndim - 1 > _DESCRIBED_DIMS else []))
    return f"shape {tuple(shape)} {str(_DTYPES[dtype]).removeprefix('torch.')}"


def gather_object(obj: T) -> list[T]:
    """Every rank's picklable ``obj``, in rank order (``torch.distributed.all_gather_object``)."""
    n = world_size()
    if n == 1:
        return [obj]
    out: list[Any] = [None] * n
    dist.all_gather_object(out, obj)
    return out


def split_between_processes(inputs: Sequence[T] | torch.Tensor | dict[str, Any], *, rank_: int | None = None,
                            world_size_: int | None = None) -> Any:
    """This rank's contiguous part of ``inputs`` (a sequence, tensor, or dict of them).

    Parts differ in length by at most one; earlier ranks get the longer parts. A dict is
    split value by value.
    """
    r = rank() if rank_ is None else rank_
    n = world_size() if world_size_ is None else world_size_
    if isinstance(inputs, dict):
        return {k: split_between_processes(v, rank_=r, world_size_=n) for k, v in inputs.items()}
    length = len(inputs)
    base, extra = divmod(length, n)
    start = r * base + min(r, extra)
    stop = start + base + (1 if r < extra else 0)
    return inputs[start:stop]
