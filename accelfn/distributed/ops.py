"""The collectives: gather, reduce, broadcast, pad, split and exchange over ``torch.distributed``.

Every function acts on the default process group when one is initialized with more than
one rank, and is the identity (or its one-rank equivalent) otherwise. Tensors must live on
the device the process group's backend expects (CPU for gloo, the rank's GPU for NCCL,
the XLA device for torch_xla's group); the backends' methods of the same names take care
of that.

Debug mode (``set_debug(True)``; a launch with ``ACCELFN_DEBUG_COLLECTIVES=1`` sets it, as
Accelerate's ``ACCELERATE_DEBUG_MODE`` does its operations' check): before each collective
the ranks exchange what they are about to do (the function, its reduce op or source rank,
the tensor's shape and dtype) and where they were called from, and where any rank differs
they all raise at once, naming each rank's call, instead of hanging until the timeout or
computing silently with mismatched ops (gloo and NCCL all-reduce a SUM on one rank with a
MAX on another without a word). It costs two all-gathers per collective; off, one test of
a flag. torch's own ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, which the backends switch on with
it, checks the collectives made outside this module (DDP's, FSDP's) at the c10d level:
their op types, shapes and dtypes, not their reduce ops.
"""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeGuard, TypeVar

import orjson
import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

ReduceOp = Literal["sum", "mean", "max", "min"]
REDUCE_OPS: tuple[str, ...] = ("sum", "mean", "max", "min")
T = TypeVar("T")

_debug = False  # set_debug: check each collective's call across ranks first
_PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep  # accelfn's own frames ...
_COLLECTIVES = str(Path(__file__).resolve().parent) + os.sep  # ... and this folder's, skipped in "where"


def set_debug(on: bool) -> None:
    """Turns the cross-rank check of every collective of this module on or off (the module's
    docstring); the backends turn it on for ``ACCELFN_DEBUG_COLLECTIVES=1``."""
    global _debug
    _debug = bool(on)


def debugging() -> bool:
    """True while the cross-rank check of the collectives is on (``set_debug``)."""
    return _debug


def _where() -> str:
    """Where the collective was called: the first caller outside ``accelfn/collectives``
    (and, when that is accelfn's own code, the first caller outside accelfn), as
    ``file:line (function)``, the file relative to the working directory when under it."""
    def shown(frame: Any) -> str:
        name = frame.f_code.co_filename
        relative = os.path.relpath(name) if name.startswith(os.getcwd() + os.sep) else name
        return f"{relative}:{frame.f_lineno} ({frame.f_code.co_name})"

    frame = sys._getframe(2)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_COLLECTIVES):
        frame = frame.f_back
    outside = frame
    while outside.f_back is not None and outside.f_code.co_filename.startswith(_PACKAGE):
        outside = outside.f_back
    if outside is frame or outside.f_code.co_filename.startswith(_PACKAGE):
        return shown(frame)
    return f"{shown(frame)}, from {shown(outside)}"


def _agree(call: str, **fields: Any) -> None:
    """Debug mode: raises ValueError on every rank when the ranks are about to make different
    collective calls (another function, reduce op, source rank, shape or dtype)."""
    mine = {"call": call, **fields}
    everyone = _all_json([mine, _where()])
    if all(what == everyone[0][0] for what, _ in everyone):
        return
    differ = [k for k in {k: None for what, _ in everyone for k in what}
              if any(what.get(k) != everyone[0][0].get(k) for what, _ in everyone)]
    calls: dict[str, list[int]] = {}
    for r, (what, where) in enumerate(everyone):
        shown = f"{what['call']}({', '.join(f'{k}={v!r}' for k, v in what.items() if k != 'call')}) at {where}"
        calls.setdefault(shown, []).append(r)
    listed = "; ".join(f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}: {shown}"
                       for shown, ranks in calls.items())
    raise ValueError(
        f"the ranks are making different collective calls (checked by ACCELFN_DEBUG_COLLECTIVES=1; they differ in "
        f"{', '.join(differ)}): {listed}. Every rank must make the same collective calls in the same order, with "
        "the same op, source rank, dtype and shape (gather: all but the first dimension)")


def _all_json(value: Any) -> list[Any]:
    """Every rank's JSON-able ``value`` over two all-gathers of the default group, outside the
    checked functions (debug mode's own exchange)."""
    data = orjson.dumps(value)
    device, n = default_device(), world_size()
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(n)]
    dist.all_gather(lengths, length)
    sizes = [int(x.item()) for x in lengths]
    buffer = torch.zeros(max(sizes), dtype=torch.uint8)
    buffer[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty_like(buffer, device=device) for _ in range(n)]
    dist.all_gather(parts, buffer.to(device))
    return [orjson.loads(p[:size].cpu().numpy().tobytes()) for p, size in zip(parts, sizes)]


def _described(tensor: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}


def is_dtensor(value: object) -> TypeGuard[DTensor]:
    """True for a ``DTensor`` (a tensor sharded over ranks, as FSDP2's parameters).

    ``torch.distributed.tensor`` is only looked up among the modules already imported: no
    DTensor can exist before it is, and importing it (with FSDP2 and DCP, which accelfn
    imports when it first shards or saves shards) takes about 0.7 s that every process
    start would otherwise pay.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its data seen as a plain tensor (or a DTensor of plain local shards), sharing its
    storage: for a tensor subclass that wraps one tensor of its own shape and dtype (torchao's
    float8 weights under float8 all-gathers, ``WeightWithDynamicFloat8CastTensor``, and the
    optimizer moments ``zeros_like`` makes of them), which safetensors cannot write.
    Any other tensor is returned as it is.
    """
    if is_dtensor(t):
        local = t.to_local()
        inner = _plain_local(local)
        if inner is local:
            return t
        return type(t).from_local(inner, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                  stride=t.stride())
    return _plain_local(t)


def _plain_local(t: torch.Tensor) -> torch.Tensor:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if type(t) in (torch.Tensor, torch.nn.Parameter) or not is_traceable_wrapper_subclass(t):
        return t
    names, _ = t.__tensor_flatten__()
    inner = getattr(t, names[0]) if len(names) == 1 else None
    if not isinstance(inner, torch.Tensor) or inner.shape != t.shape or inner.dtype != t.dtype:
        return t
    return _plain_local(inner)


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


def barrier() -> None:
    """Waits until every rank reaches this call."""
    if world_size() > 1:
        if _debug:
            _agree("barrier")
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
    if _debug:
        _agree("reduce", op=op, **_described(tensor))
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
        if _debug:
            _agree("broadcast", src=src, **_described(tensor))
        dist.broadcast(out, src=src)
    return out


#: the attribute ``backend.prepare`` sets on a model whose copies on the ranks are one model
_REPLICAS = "_accelfn_replicas"


def mark_replicas(module: torch.nn.Module) -> None:
    """Records that ``module``'s copies on every rank are one model (``replicate`` or
    ``shard_params``): ``sync_buffers`` then makes their buffers rank 0's."""
    setattr(module, _REPLICAS, True)


def sync_buffers(module: torch.nn.Module, device: torch.device | None = None) -> None:
    """Rank 0's buffers (BatchNorm's running statistics, ...) copied into every rank's copy
    of ``module``, in place, when ``mark_replicas`` marked it and the world has several
    ranks; else nothing. A collective: every rank calls it at the same point.

    Each rank's last training forward updates its own buffers from its own batch, so the
    copies drift apart between DDP's broadcasts (at the start of each training forward) and
    FSDP2 never broadcasts them: whatever reads "the model" (evaluation, a checkpoint, an
    export, a hook) takes rank 0's, as DDP's next forward would. One broadcast per buffer
    dtype (the buffers flattened together), on ``device`` (the process group's; default:
    ``default_device()``).
    """
    if world_size() == 1:
        return
    replicas = getattr(module, _REPLICAS, False)
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for buffer in module.buffers() if replicas or _debug else ():
        if is_dtensor(buffer):  # sharded: each rank holds its own part
            continue
        groups.setdefault(buffer.dtype, []).append(buffer)
    if _debug:
        _agree("sync_buffers", replicas=replicas,
               buffers={str(d).removeprefix("torch."): sum(b.numel() for b in bs) for d, bs in groups.items()})
    if not replicas:
        return
    device = device if device is not None else default_device()
    for dtype, buffers in groups.items():
        flat = torch.cat([b.detach().reshape(-1).to(device) for b in buffers])
        dist.broadcast(flat, src=0)
        offset = 0
        with torch.no_grad():
            for b in buffers:
                b.copy_(flat[offset:offset + b.numel()].view(b.shape))
                offset += b.numel()


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
    if n > 1 and _debug:
        _agree("pad_across_processes", dim=dim, ndim=tensor.ndim, dtype=str(tensor.dtype).removeprefix("torch."))
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
    if _debug:
        _agree("gather", trailing_shape=list(tensor.shape[1:]), dtype=str(tensor.dtype).removeprefix("torch."))
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
    if _debug:
        _agree("gather_object")
    out: list[Any] = [None] * n
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank ``src``'s picklable ``obj`` on every rank (``torch.distributed.broadcast_object_list``;
    pickled: for the job's own data, never for files)."""
    if world_size() == 1:
        return obj
    if _debug:
        _agree("broadcast_object", src=src)
    box: list[Any] = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


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


def exchange(value: Any, *, device: torch.device | None = None) -> list[Any]:
    """Every rank's JSON-able ``value``, in rank order, on every rank, without pickle.

    ``torch.distributed``'s ``*_object`` collectives pickle what they send; this sends the
    value's JSON (orjson) in a uint8 tensor over two all-gathers (lengths, then bytes).

    Args:
        value: data orjson can write (dicts, lists, str, numbers, bool, None).
        device: the device the group exchanges tensors on (``default_device()`` if None).

    Raises:
        TypeError: ``value`` is not JSON-able (orjson's).
    """
    data = orjson.dumps(value)
    if world_size() == 1:
        return [orjson.loads(data)]
    if _debug:
        _agree("exchange")
    device = default_device() if device is None else device
    payload = torch.frombuffer(bytearray(struct.pack("<Q", len(data)) + data), dtype=torch.uint8).to(device)
    lengths = gather(torch.tensor([payload.numel()], dtype=torch.int64, device=device)).cpu().tolist()
    gathered = gather(payload).cpu().numpy().tobytes()
    values, offset = [], 0
    for n in lengths:
        (length,) = struct.unpack_from("<Q", gathered, offset)
        values.append(orjson.loads(gathered[offset + 8:offset + 8 + length]))
        offset += n
    return values
