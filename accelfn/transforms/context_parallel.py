"""``context_parallel``: context parallelism, each sequence split over ``size`` ranks.

``size`` is the mesh's ``context`` dimension (``distributed.mesh``), between the data and
tensor dimensions: the ranks of one context group read the same batch, and each keeps its
part of every sequence (the batch's tensors cut along ``seq_dim``). Attention is the one
place a token needs the others: ``scaled_dot_product_attention`` runs as a ring over the
group, each rank's queries meeting every rank's keys and values in turn, the partial
results merged by their log-sum-exp (torch's own ring,
``torch.distributed.tensor.experimental``). Everything else (embeddings, MLPs, norms, the
loss) is per token and runs on the local part only, so activations shrink by ``size``.

Under a causal mask the later parts of a sequence attend to more keys than the earlier ones;
with ``load_balance`` each rank holds two parts, one from the head and its mirror from the
tail of the sequence (torchtitan's head-and-tail split), so every rank does the same work.

The context ranks' gradients are summed like data-parallel ranks': the context dimension is
folded into the data-parallel one the program names, as torchtitan does (``shard_params``:
FSDP2 over shard x context; ``replicate``: DDP over every rank), and an ``af.Loss``'s counts
are summed over the group too, so the gradient is that of the whole sequence.

References:
    Liu et al., "Ring Attention with Blockwise Transformers for Near-Infinite Context", 2023.
    Brandon et al., "Striped Attention: Faster Ring Attention for Causal Transformers", 2023
    (load balancing a causal ring). torchtitan ``distributed/context_parallel``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from accelfn.errors import boolean, check_int, wrong_type
from accelfn.step import Phase, TransformBase
from accelfn.transforms.compile import Compile
from accelfn.transforms.deepspeed import DeepSpeed
from accelfn.transforms.invariant import Invariant
from accelfn.transforms.pipeline import Pipeline


def _int_at_least(minimum: int, what: str) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong_type("context_parallel", attribute.name, f"an int >= {minimum} ({what})", value)
        check_int("context_parallel", attribute.name, value, minimum=minimum)

    return check


@attrs.frozen
class ContextParallel(TransformBase):
    """Context parallelism: each sequence split over groups of ``size`` ranks.

    See :func:`context_parallel`.

    Attributes:
        size: the ranks one sequence is split over.
        load_balance: split causal sequences head-and-tail (two mirrored parts per rank).
        seq_dim: the dimension of the batch's tensors that holds the sequence.
    """

    phase: ClassVar[Phase] = Phase.MODEL
    kind: ClassVar[str] = "context_parallel"
    verb: ClassVar[str] = "context_parallel"
    couples_ranks: ClassVar[bool] = True

    size: int = attrs.field(validator=_int_at_least(1, "the ranks one sequence is split over"))
    load_balance: bool = attrs.field(default=True, validator=boolean)
    seq_dim: int = attrs.field(default=1, validator=_int_at_least(1, "the sequence dimension; 0 is the batch's"))

    @property
    def parts(self) -> int:
        """The parts each sequence is cut into: ``2 size`` with ``load_balance``, else ``size``."""
        return 2 * self.size if self.load_balance else self.size

    def conflicts_with(self, other: TransformBase) -> str | None:
        refused = {
            Pipeline: "context_parallel() with pipeline() is not built yet: the stages would have to split their "
                      "activations' sequences too; use one of them",
            DeepSpeed: "context_parallel() with deepspeed() is not supported: DeepSpeed's engine reduces the "
                       "gradients over its own data-parallel group, which has no context dimension; use "
                       "shard_params() (FSDP2 over the context ranks too)",
            Invariant: "context_parallel() with invariant() is not built: the ring's merge of partial attention "
                       "has no canonical order; use one of them",
            Compile: "context_parallel() with compile() is not built yet: the ring's collectives run in eager "
                     "mode between the compiled parts; drop compile(), or compile the model's blocks yourself",
        }
        for kind, reason in refused.items():
            if isinstance(other, kind):
                return reason
        return None


def context_parallel(*, size: int, load_balance: bool = True, seq_dim: int = 1) -> ContextParallel:
    """Context parallelism: each batch's sequences split over ``size`` ranks, attention as a ring.

    The ranks of one context group read the same batches; each keeps ``1/size`` of every
    sequence: every tensor of the batch with more than ``seq_dim`` dimensions is cut along
    ``seq_dim`` (all of them must have the same length there: tokens, targets, position ids,
    masks), and tensors with fewer dimensions (one label per sample) are kept whole. The
    model's ``torch.nn.functional.scaled_dot_product_attention`` calls (``is_causal=True`` or
    no mask; ``(batch, heads, seq, head width)``) run as a ring over the group, exactly equal
    to attention over the whole sequence; every other layer sees the local tokens only.
    Anything that depends on a token's position must read it from the batch (position ids
    split with the tokens), not from the local length.

    The context ranks' gradients are reduced with the data-parallel ones, so the program
    needs ``shard_params()`` (FSDP2 over shard x context, as torchtitan folds it) or
    ``replicate()`` (DDP over every rank). With world size ``W`` and ``tensor_parallel(size=t)``,
    ``W / (size * t)`` data shards are read.

    Args:
        size: the ranks one sequence is split over, >= 1; the world size must be a
            multiple of ``size`` (times ``tensor_parallel``'s size).
        load_balance: cut each sequence into ``2 size`` parts and give rank ``r`` parts ``r``
            and ``2 size - 1 - r`` (the head-and-tail split of torchtitan, torch's
            ``_HeadTailLoadBalancer``), so that under a causal mask every rank computes as
            many query-key pairs; False gives rank ``r`` the ``r``-th of ``size`` contiguous
            parts (the last rank then does most of the causal attention).
        seq_dim: the sequence dimension of the batch's tensors, >= 1 (dimension 0 is the
            batch's): ``(batch, seq)`` tokens have it at 1.

    Returns:
        ContextParallel: the transform.

    Raises:
        TypeError: ``size`` or ``seq_dim`` not an int, ``load_balance`` not a bool.
        ValueError: ``size`` < 1, ``seq_dim`` < 1. Later, from ``prepare``: no ``shard_params()``
            or ``replicate()`` on several context ranks; from the step, before its forward (the
            state unchanged): a sequence length that does not divide into ``2 size`` parts
            (``size`` without ``load_balance``), or tensors of the batch with different lengths
            along ``seq_dim``.
        NotImplementedError: from the step's forward, an attention with an explicit mask,
            dropout, or keys of another length than the queries.

    Example:
        >>> import accelfn as af
        >>> af.context_parallel(size=2)
        ContextParallel(size=2, load_balance=True, seq_dim=1)
    """
    return ContextParallel(size, load_balance, seq_dim)
