"""What ``context_parallel`` does to a program: each batch's sequences cut over the mesh's
``"context"`` dimension, attention as torch's ring over it, as the ``Ring`` model phase.

The phase changes the program's forward, not the model: its ``loss_fn`` becomes a
``SplitSequences`` that cuts every tensor of the batch along the sequence dimension (rank
``r`` of ``c`` keeps parts ``r`` and ``2c - 1 - r`` of ``2c`` under load balancing, the
head-and-tail order of torch's ``_HeadTailLoadBalancer`` that torchtitan uses; part ``r`` of
``c`` without) and runs the user's ``loss_fn`` on its part with
``torch.nn.functional.scaled_dot_product_attention`` replaced by ``ring_attention``.

``ring_attention`` is torch's own ring (``torch.distributed.tensor.experimental.
_context_parallel._attention``: ``_templated_ring_attention`` and its backward, which pass
the keys and values around the group and merge the partial outputs by their log-sum-exp)
called with one attention kernel per device: on CUDA torch's own ring over memory-efficient
attention (``_scaled_dot_product_ring_efficient_attention``, the function torch's
``context_parallel()`` dispatches to); on the CPU, where torch registers no ring (its DTensor
dispatch stops at "``_scaled_dot_product_flash_attention_for_cpu`` does not have a sharding
strategy registered"), the same template handed the CPU flash kernel and its backward. An
``autograd.Function`` holds the two, so nothing global stays changed after the forward.

Gradients: the context ranks hold the same parameters and each back-propagates its part of
the loss, so their gradients are summed with the data-parallel ranks' (FSDP2 over shard x
context, ``Mesh.fsdp_mesh``; DDP over every rank under ``replicate``), and an ``af.Loss``'s
counts are summed over every rank, context ranks included: the gradient is the whole
sequence's.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from accelfn.distributed.phases import ModelPhase
from accelfn.transforms import Replicate, ShardParams
from accelfn.transforms.context_parallel import ContextParallel

if TYPE_CHECKING:
    from accelfn.distributed.phases import Preparation

#: the sequence dimension of attention's ``(batch, heads, seq, head width)`` tensors (torch's ring's)
_SEQ = 2


def _attention() -> Any:
    """torch's ring attention module (imported on first use: it imports DTensor)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring  # noqa: PLC2701

    return ring


# -- which positions of a sequence a rank keeps ---------------------------------------------


def positions(length: int, spec: ContextParallel, rank: int) -> torch.Tensor:
    """The positions of a sequence of ``length`` that context rank ``rank`` keeps, in order.

    Under ``load_balance``: parts ``rank`` and ``2 size - 1 - rank`` of ``2 size`` equal parts
    (torch's ``_HeadTailLoadBalancer``, the order torch's ring assumes); without, part ``rank``
    of ``size``.

    Raises:
        ValueError: ``length`` is not a multiple of ``spec.parts``.
    """
    if length % spec.parts:
        raise ValueError(
            f"context_parallel(size={spec.size}, load_balance={spec.load_balance}) cuts each sequence into "
            f"{spec.parts} equal parts, and this batch's sequences have length {length} (dimension {spec.seq_dim}), "
            f"which is not a multiple of {spec.parts}; pad or cut the sequences to a multiple of {spec.parts}"
            + (" (or set load_balance=False, which needs a multiple of the size only)" if spec.load_balance else "")
        )
    if not spec.load_balance:
        part = length // spec.size
        return torch.arange(rank * part, (rank + 1) * part)
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (  # noqa: PLC2701
        _HeadTailLoadBalancer,
    )

    order = _HeadTailLoadBalancer(length, spec.size, "cpu")._generate_indices()[0]  # noqa: SLF001  # torch's own
    part = length // spec.size
    return order[rank * part:(rank + 1) * part]


def split_batch(batch: Any, spec: ContextParallel, rank: int) -> Any:
    """``batch`` with every tensor of more than ``spec.seq_dim`` dimensions cut to the
    positions rank ``rank`` keeps (``positions``); other tensors and values unchanged.

    Raises:
        ValueError: tensors of different lengths along ``seq_dim``, no tensor to cut, or a
            length that does not divide (``positions``). Nothing is computed before.
    """
    leaves = [t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() > spec.seq_dim]
    lengths = sorted({t.shape[spec.seq_dim] for t in leaves})
    if not lengths:
        raise ValueError(
            f"context_parallel(seq_dim={spec.seq_dim}) cuts the batch's tensors along dimension {spec.seq_dim}, and "
            f"this batch has no tensor with more than {spec.seq_dim} dimensions; give the sequences as "
            "(batch, seq, ...) tensors, or set seq_dim to their sequence dimension")
    if len(lengths) > 1:
        raise ValueError(
            f"context_parallel(seq_dim={spec.seq_dim}) cuts every tensor of the batch with more than {spec.seq_dim} "
            f"dimensions along dimension {spec.seq_dim}, and this batch's have the lengths {lengths} there; give "
            "tokens, targets, position ids and masks the same sequence length (per-sample values as (batch,) tensors)")
    keep = positions(lengths[0], spec, rank)

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > spec.seq_dim:
            return value.index_select(spec.seq_dim, keep.to(value.device))
        return value

    return pytree.tree_map(cut, batch)


# -- attention as a ring ----------------------------------------------------------------------


@contextlib.contextmanager
def _options(load_balance: bool) -> Iterator[None]:
    """torch's ring options for one call: the head-and-tail layout or not, fp32 merges."""
    options = _attention()._cp_options  # noqa: SLF001
    before = (options.enable_load_balance, options.convert_to_f32)
    options.enable_load_balance, options.convert_to_f32 = load_balance, True
    try:
        yield
    finally:
        options.enable_load_balance, options.convert_to_f32 = before


def _cpu_forward(mesh: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                 scale: float | None) -> tuple[torch.Tensor, ...]:
    """The CPU shim: torch's ring template with the CPU flash kernel (``(out, lse)``)."""
    ring = _attention()
    return ring._templated_ring_attention(  # noqa: SLF001
        mesh.get_group(), _SEQ, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
        q, k, v, is_causal=is_causal, dropout_p=0.0, scale=scale)


def _cpu_backward(mesh: Any, grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  saved: tuple[torch.Tensor, ...], is_causal: bool, scale: float | None) -> tuple[torch.Tensor, ...]:
    out, lse = saved
    return _attention()._templated_ring_attention_backward(  # noqa: SLF001
        mesh.get_group(), _SEQ, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad, "grad_out", q, k, v, out, lse, is_causal, dropout_p=0.0, scale=scale)


def _cuda_forward(mesh: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                  scale: float | None) -> tuple[torch.Tensor, ...]:
    """torch's own ring over memory-efficient attention (``(out, lse, philox seed, offset)``)."""
    return _attention()._scaled_dot_product_ring_efficient_attention(  # noqa: SLF001
        mesh, q, k, v, None, True, 0.0, is_causal, scale=scale)


def _cuda_backward(mesh: Any, grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   saved: tuple[torch.Tensor, ...], is_causal: bool, scale: float | None) -> tuple[torch.Tensor, ...]:
    out, lse, seed, offset = saved
    return _attention()._scaled_dot_product_ring_efficient_attention_backward(  # noqa: SLF001
        mesh, grad, q, k, v, None, out, lse, seed, offset, 0.0, (True, True, True, False), is_causal, scale=scale)


#: per device type: the ring's forward (``(out, *saved)``) and backward (``(dq, dk, dv, ...)``)
KERNELS: dict[str, tuple[Callable[..., tuple[torch.Tensor, ...]], Callable[..., tuple[torch.Tensor, ...]]]] = {
    "cpu": (_cpu_forward, _cpu_backward),
    "cuda": (_cuda_forward, _cuda_backward),
}


class _Ring(torch.autograd.Function):
    """Attention of the local queries over the whole group's keys and values, and its backward."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: Any,
                is_causal: bool, scale: float | None, load_balance: bool) -> torch.Tensor:
        forward, _ = KERNELS[q.device.type]
        with _options(load_balance and is_causal):
            out, *saved = forward(mesh, q, k, v, is_causal, scale)
        kept = (out, *saved[:3]) if q.device.type == "cuda" else (out, saved[0])
        ctx.save_for_backward(q, k, v, *kept)
        ctx.args = (mesh, is_causal, scale, load_balance and is_causal)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, *saved = ctx.saved_tensors
        mesh, is_causal, scale, load_balance = ctx.args
        _, backward = KERNELS[q.device.type]
        with _options(load_balance):
            dq, dk, dv, *_ = backward(mesh, grad.contiguous(), q, k, v, tuple(saved), is_causal, scale)
        return dq, dk, dv, None, None, None, None


def ring_attention(mesh: Any, load_balance: bool) -> Callable[..., torch.Tensor]:
    """``scaled_dot_product_attention`` over the 1-D ``mesh`` (the context group) for queries,
    keys and values ``(batch, heads, seq, head width)`` holding this rank's part of each
    sequence (laid out as ``positions`` gives it): exactly attention over the whole sequence.

    Raises (from the returned function):
        NotImplementedError: an ``attn_mask``, ``dropout_p`` > 0 in training, tensors not 4-D,
            queries and keys of different lengths, or a device without a ring kernel.
    """

    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False) -> torch.Tensor:
        refusals = (("an attn_mask (only is_causal=True or no mask)", attn_mask is not None),
                    (f"dropout_p={dropout_p}", bool(dropout_p)),
                    (f"{query.dim()}-D tensors (only (batch, heads, seq, head width))", query.dim() != 4),
                    ("keys of another length than the queries (self-attention only)",
                     query.dim() == 4 and key.shape[_SEQ] != query.shape[_SEQ]),
                    (f"the {query.device.type} device", query.device.type not in KERNELS))
        refused = next((what for what, applies in refusals if applies), None)
        if refused is not None:
            raise NotImplementedError(
                f"context_parallel(): scaled_dot_product_attention runs as a ring over the context ranks, which "
                f"does not take {refused}; express the mask as is_causal=True, drop the dropout, or leave "
                "context_parallel() out")
        if enable_gqa and key.shape[1] != query.shape[1]:  # grouped-query attention: each key head serves a group
            key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
            value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
        out = _Ring.apply(query, key, value, mesh, is_causal, scale, load_balance)
        return out

    return attention


@contextlib.contextmanager
def attention_as_ring(attention: Callable[..., torch.Tensor]) -> Iterator[None]:
    """``torch.nn.functional.scaled_dot_product_attention`` is ``attention`` within (as torch's
    ``context_parallel()`` patches it), and torch's own again after."""
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


# -- the program's forward and the phase ------------------------------------------------------


class SplitSequences:
    """The program's ``loss_fn`` under ``context_parallel``: the batch cut to this rank's part
    of each sequence (``split_batch``), then the user's ``loss_fn`` with attention as a ring.

    A first forward that calls ``torch.nn.functional.scaled_dot_product_attention`` nowhere is
    said once (a ``UserWarning``): attention computed another way (by hand, or through a name
    imported from torch before the step ran) would see this rank's part of each sequence only.

    Attributes:
        loss_fn: the user's ``loss_fn(model, batch)``.
        spec: the transform.
        rank: this rank's place along the context dimension.
    """

    def __init__(self, loss_fn: Callable[..., Any], spec: ContextParallel, rank: int, mesh: Any):
        self.loss_fn, self.spec, self.rank = loss_fn, spec, rank
        ring = ring_attention(mesh, spec.load_balance)
        self._calls = 0
        self._checked = False

        def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
            self._calls += 1
            return ring(*args, **kwargs)

        self._attention = counted
        self.__name__ = getattr(loss_fn, "__name__", type(loss_fn).__name__)
        self.__qualname__ = getattr(loss_fn, "__qualname__", self.__name__)

    def __call__(self, model: torch.nn.Module, batch: Any) -> Any:
        part = split_batch(batch, self.spec, self.rank)
        with attention_as_ring(self._attention):
            out = self.loss_fn(model, part)
        if not self._checked:
            self._checked = True
            if not self._calls:
                warnings.warn(
                    f"context_parallel(size={self.spec.size}): the forward called no "
                    "torch.nn.functional.scaled_dot_product_attention, so nothing ran as a ring; attention "
                    "computed another way sees only this rank's part of each sequence. Call "
                    "F.scaled_dot_product_attention (looked up at call time), or leave context_parallel() out",
                    UserWarning, stacklevel=2)
        return out


def folds_into(step: Any) -> type | None:
    """The data-parallel transform the context ranks' gradients are reduced by: ``ShardParams``
    (FSDP2 over shard x context) or ``Replicate`` (DDP over every rank), or None."""
    return next((kind for kind in (ShardParams, Replicate) if step.find(kind) is not None), None)


class Ring(ModelPhase):
    """``context_parallel()``'s model phase: the program's forward splits each sequence over the
    mesh's ``"context"`` dimension and runs attention as a ring (``SplitSequences``); the
    gradients are reduced by ``shard_params`` or ``replicate`` over the context ranks too.

    On a context dimension of one rank (``size=1``, or one process) the program is unchanged.
    """

    name: ClassVar[str] = "context_parallel"

    def __init__(self, spec: ContextParallel):
        self.spec = spec

    @classmethod
    def of(cls, prep: Preparation) -> Ring | None:
        spec = prep.step.find(ContextParallel)
        return None if spec is None else cls(spec)

    def check(self, prep: Preparation) -> None:
        """Raises ValueError without ``shard_params()`` or ``replicate()`` on several context
        ranks; NotImplementedError on a device without a ring kernel."""
        if prep.mesh.context == 1:
            return
        if folds_into(prep.step) is None:
            raise ValueError(
                f"context_parallel(size={self.spec.size}): the context ranks each back-propagate part of every "
                "sequence, and their gradients must be summed; add shard_params() (FSDP2 over the data and context "
                "ranks, as torchtitan folds them) or replicate() (DDP over every rank)")
        if prep.hardware.device.type not in KERNELS:
            raise NotImplementedError(
                f"the {prep.hardware.name} backend does not support context_parallel(): its ring attention runs "
                f"on {' and '.join(KERNELS)} only; use the cpu or cuda backend")

    def apply(self, prep: Preparation) -> None:
        if prep.mesh.context == 1:
            return
        mesh = prep.mesh.device_mesh(prep.hardware.device, "context")
        rank = prep.mesh.coordinates(prep.hardware.rank)["context"]
        prep.step = attrs.evolve(prep.step, loss_fn=SplitSequences(prep.step.loss_fn, self.spec, rank, mesh))
        prep.forward_is_collective = True
