"""``invariant``: the same training run, bit for bit, on any number of processes.

The record and its verb, the state it keeps (the open window's partial sums, the layout the
run was started with), and the pure rules every backend follows: which global micro-batch a
rank's micro-batch is, the RNG key of a micro-batch, and the canonical reduction tree over
the global micro-batch index (a binary counter, as in pairwise summation).

The tree: the micro-batches of an update are the leaves ``0 .. L-1`` in global order. Leaves
are pushed on a stack of complete nodes; whenever the two top nodes are siblings (the same
height, the lower one aligned to twice its size), they are replaced by their sum (the
lower-index node's tensor plus the higher's), so the stack holds at most ``log2(L) + 1``
nodes. At the end the stack is folded from its top: ``T_0 + (T_1 + (... + T_m))``. A rank
that holds ``A = 2^a`` consecutive leaves builds a complete node of height ``a``; the ranks'
nodes are then leaves of the same rule one level up (``distributed.canonical_all_reduce``),
so the sum is the same tree, hence the same bits, for every ``(W, A)`` with ``W * A = L``
and ``A`` a power of two (or ``W = 1``). For any other ``A`` each rank's stack holds the
complete subtrees inside its block; the ranks gather them all and push them in order, which
builds the same tree (``backends._invariant``): exact too, at the cost of an all-gather.

References:
    Higham, "The accuracy of floating point summation", SIAM J. Sci. Comput. 14(4), 1993
    (pairwise summation). Thakur, Rabenseifner, Gropp, "Optimization of collective
    communication operations in MPICH", IJHPCA 19(1), 2005 (recursive doubling).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import attrs
import torch

from accelfn.errors import TransformError, non_negative_int
from accelfn.step import Phase, TransformBase
from accelfn.transforms.data import ShardData
from accelfn.transforms.shard_params import ShardParams
from accelfn.transforms.tensor_parallel import TensorParallel

if TYPE_CHECKING:
    from accelfn.state import TrainState

#: layers whose output for one sample depends on the other samples of its batch
BATCH_COUPLED: tuple[type[torch.nn.Module], ...] = (
    torch.nn.modules.batchnorm._BatchNorm,  # noqa: SLF001  # BatchNorm1d/2d/3d, SyncBatchNorm, Lazy*
    torch.nn.modules.instancenorm._InstanceNorm,  # noqa: SLF001  # track_running_stats: batch means
)


def _module_types(value: object) -> tuple[type[torch.nn.Module], ...]:
    if not isinstance(value, tuple) or not all(isinstance(t, type) and issubclass(t, torch.nn.Module)
                                               for t in value):
        raise TypeError(f"invariant(batch_coupled=...) takes a tuple of torch.nn.Module subclasses, got {value!r}")
    return value


@attrs.frozen
class Invariant(TransformBase):
    """The same run, bit for bit, whatever the number of processes ``W`` and ``accumulate(A)``.

    For a fixed micro-batch size ``b`` (the DataLoader's ``batch_size``) and a fixed number
    ``L = W * A`` of micro-batches per update, every TrainState after every update is
    byte-identical for every ``(W, A)`` with ``W * A = L``, and so are
    the logged ``loss`` and ``grad_norm``, under ``replicate()`` or ``shard_params()`` (FSDP2,
    without offloading or HSDP). See docs/14-invariant.md for the conditions.

    Attributes:
        seed: keys the random draws of each micro-batch (dropout, ``loss_fn``'s use of
            torch's default generator, Python's ``random`` and NumPy's global generator) by
            ``(seed, epoch, global micro-batch index)``.
        batch_coupled: module types to refuse besides BatchNorm, SyncBatchNorm and
            InstanceNorm with running statistics: layers whose state or output depends on
            which micro-batches one process sees in which order (BatchNorm's running
            statistics are updated by each process from its own micro-batches only).
    """

    phase: ClassVar[Phase] = Phase.MODEL
    kind: ClassVar[str] = "invariant"
    verb: ClassVar[str] = "invariant"
    reduces_gradients: ClassVar[bool] = True

    seed: int = attrs.field(default=0, validator=non_negative_int)
    batch_coupled: tuple[type[torch.nn.Module], ...] = attrs.field(default=(), converter=_module_types)

    def conflicts_with(self, other: TransformBase) -> str | None:
        if isinstance(other, ShardParams) and (other.offload or other.shard_size is not None):
            return ("invariant() sums the whole gradients of every rank over a fixed tree, then keeps each "
                    "rank's shard; with shard_params(offload=True) or shard_params(shard_size=...) (HSDP) it "
                    "does not run yet: use shard_params() without them, or replicate()")
        if isinstance(other, TensorParallel):
            return ("invariant() sums each rank's whole gradients over a fixed tree of data-parallel ranks, and "
                    "tensor_parallel() splits layers over ranks; use one of them")
        if isinstance(other, ShardData) and other.split_batches:
            return ("invariant() assigns each rank its own contiguous block of micro-batches of the "
                    "DataLoader's batch_size; use shard_data() without split_batches=True")
        return None

    def init(self, state: TrainState) -> TrainState:
        check_model(state.model, self.batch_coupled)
        return state


@attrs.frozen(eq=False)
class Node:
    """A complete subtree of the reduction tree: the sum of leaves ``[start, start + 2**height)``.

    Attributes:
        start: the first leaf (global micro-batch of the update) it sums.
        height: ``log2`` of the number of leaves it sums.
        grads: the gradients, flattened into one tensor, shape ``(num_elements,)``.
        sums: float64 ``(2 + num_metrics,)``: the summed loss, the item (or sample) count,
            and each metric weighted by its count, of those leaves.
    """

    start: int
    height: int
    grads: torch.Tensor
    sums: torch.Tensor


@attrs.frozen(eq=False)
class TreeWindow:
    """An update in progress under ``invariant()``: ``transforms_state["tree_window"]``.

    Attributes:
        nodes: the stack of complete subtrees of this rank's leaves so far (lowest first).
        num_samples: samples this rank read in the window.
        metric_names: the names of the user's metrics, in the order of ``Node.sums``.
        num_items: an ``af.Loss``'s items this rank counted in the window (0 for a mean loss).
        pending: subtrees computed before a resume on another number of processes, pushed
            when this rank reaches their first leaf (lowest first).
        skip_until: the global micro-batch index before which this rank computes no leaf
            (they are in a pushed subtree, or in one another rank holds).
        item_counts: whether ``loss_fn`` returned an ``af.Loss`` (for a resumed window
            whose leaves this rank does not compute).
    """

    nodes: tuple[Node, ...]
    num_samples: int
    metric_names: tuple[str, ...] = ()
    num_items: float = 0.0
    pending: tuple[Node, ...] = ()
    skip_until: int = 0
    item_counts: bool = False


@attrs.frozen
class Layout:
    """What the guarantee is relative to: ``transforms_state["invariant"]``.

    Attributes:
        micro_batch_size: ``b``, samples per micro-batch.
        micro_batches_per_update: ``L = W * A``, micro-batches per update over all ranks.
    """

    micro_batch_size: int
    micro_batches_per_update: int


def invariant(*, seed: int = 0, batch_coupled: tuple[type[torch.nn.Module], ...] = ()) -> Invariant:
    """The same training run, bit for bit, on any number of processes.

    Under ``invariant()`` the data order, the random draws of each micro-batch and the
    summation order of the gradients depend only on the global micro-batch index, not on
    which process computes it; see :class:`Invariant` and docs/14-invariant.md.

    Args:
        seed: keys the random draws of each micro-batch (int >= 0).
        batch_coupled: more module types to refuse, as BatchNorm is.

    Returns:
        Invariant: the transform.

    Raises:
        ValueError: ``seed`` negative.
        TypeError: ``seed`` not an int, ``batch_coupled`` not a tuple of module types.

    References:
        Higham 1993 (pairwise summation); Thakur et al. 2005 (recursive doubling).

    Example:
        >>> import accelfn as af
        >>> af.invariant()
        Invariant(seed=0, batch_coupled=())
    """
    return Invariant(seed, batch_coupled)


def check_model(model: torch.nn.Module, extra: Sequence[type[torch.nn.Module]] = ()) -> None:
    """Raises TransformError naming the first batch-coupled layer of ``model``.

    Raises:
        TransformError: a BatchNorm/SyncBatchNorm/InstanceNorm with running statistics, or a
            module of one of the ``extra`` types.
    """
    refused = (*BATCH_COUPLED, *extra)
    for name, module in model.named_modules():
        if not isinstance(module, refused):
            continue
        if isinstance(module, torch.nn.modules.instancenorm._InstanceNorm) and not module.track_running_stats:  # noqa: SLF001
            continue
        raise TransformError(
            f"invariant() cannot hold for the layer {name or '<root>'!r} ({type(module).__name__}): its output or "
            "its running statistics depend on which samples share a micro-batch on a process. Replace it by a "
            "per-sample layer (GroupNorm, LayerNorm) or drop invariant()"
        )


def micro_batch_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of torch's generators for global micro-batch ``index`` of ``epoch`` (< 2**63)."""
    return ((seed * 1_000_003 + epoch) * 2**32 + index) % (2**63 - 1)


def global_index(epoch_micro_step: int, *, rank: int, world_size: int, num_micro_batches: int) -> int:
    """The global micro-batch index (in the epoch) of this rank's ``epoch_micro_step``-th micro-batch.

    Update ``u`` reads global micro-batches ``[u*W*A, (u+1)*W*A)``; rank ``r`` the block
    ``[u*W*A + r*A, u*W*A + (r+1)*A)``.
    """
    update, position = divmod(epoch_micro_step, num_micro_batches)
    return (update * world_size + rank) * num_micro_batches + position


def combine(low: Node, high: Node) -> Node:
    """The node above two siblings: ``low.grads + high.grads`` (elementwise, so the same bits
    whichever process adds them: IEEE addition is commutative)."""
    return Node(low.start, low.height + 1, low.grads.add_(high.grads), low.sums.add_(high.sums))


def push(nodes: tuple[Node, ...], node: Node, origin: int = 0) -> tuple[Node, ...]:
    """The stack after adding ``node`` (the next leaf, or a complete subtree): the binary counter.

    Two nodes are added only when they are siblings in the tree of the update whose first
    leaf is ``origin``: the same height ``h`` and the lower one starting at a multiple of
    ``2**(h+1)`` leaves from ``origin``. On a rank whose block starts there (or at any
    multiple of its size) that is every pair of equal height; a block of ``A`` leaves, ``A``
    not a power of two, keeps the nodes that straddle its edges apart, for the ranks to
    finish together (``backends._invariant``).
    """
    stack = [*nodes, node]
    while (len(stack) > 1 and stack[-2].height == stack[-1].height
           and (stack[-2].start - origin) % (2 ** (stack[-2].height + 1)) == 0):
        high = stack.pop()
        stack[-1] = combine(stack[-1], high)
    return tuple(stack)


def stack_sizes(*, rank: int, world_size: int, num_micro_batches: int) -> list[int]:
    """The subtrees the window's stack holds after each of ``rank``'s micro-batches of an
    update (``push``'s binary counter over its block), for ``af.plan``'s partial-sum bytes."""
    nodes: tuple[Node, ...] = ()
    sizes = []
    for position in range(num_micro_batches):
        index = global_index(position, rank=rank, world_size=world_size, num_micro_batches=num_micro_batches)
        nodes = push(nodes, Node(index, 0, torch.empty(0), torch.empty(0)))
        sizes.append(len(nodes))
    return sizes


def fold(nodes: Sequence[Node]) -> Node:
    """The stack's sum, folded from its top: ``T_0 + (T_1 + (... + T_m))``."""
    top = nodes[-1]
    for node in reversed(nodes[:-1]):
        top = Node(node.start, max(node.height, top.height) + 1, node.grads.add_(top.grads),
                   node.sums.add_(top.sums))
    return top


def redistribute(windows: Sequence[TreeWindow | None], *, layout: Layout, saved_position: int, saved_world_size: int,
                 rank: int, world_size: int) -> tuple[TreeWindow | None, int]:
    """This rank's share of an open window saved by ``saved_world_size`` processes, for
    ``world_size`` processes, and the position in the epoch it resumes at (the window's start).

    Every saved node is a complete subtree aligned to its size within the update (``A`` is a
    power of two), so it lies inside one new rank's block or covers whole blocks (for other
    ``A`` it may cover part of the next block: that block's rank skips those leaves): it goes
    to the rank whose block holds its first leaf; the ranks whose blocks it also covers skip
    them and add nothing (the tree then adds ``-0.0``, the exact identity of IEEE addition).

    Args:
        windows: each saved rank's window (None where it had none).
        layout: the run's ``Layout`` (``L = W * A`` the same before and after).
        saved_position: the saved ``epoch_micro_step`` (of each saved rank).
        saved_world_size, rank, world_size: the old world, and this rank's place in the new.

    Raises:
        ValueError: ``L`` does not divide by ``world_size``.
    """
    per_update = layout.micro_batches_per_update
    if per_update % world_size or per_update % saved_world_size:
        raise ValueError(f"invariant(): {per_update} micro-batches per update do not divide over {world_size} processes")
    saved_a, a = per_update // saved_world_size, per_update // world_size
    update = saved_position // saved_a
    position = update * a
    nodes = sorted((n for w in windows if w is not None for n in (*w.nodes, *w.pending)), key=lambda n: n.start)
    if not nodes:
        return None, position
    first = update * per_update + rank * a
    end = first + a
    mine = tuple(n for n in nodes if first <= n.start < end)
    covering = [n.start + 2**n.height for n in nodes if n.start < first < n.start + 2**n.height]
    known = next(w for w in windows if w is not None)
    window = TreeWindow(
        nodes=(), num_samples=0, metric_names=known.metric_names,
        num_items=float(sum(float(n.sums[1]) for n in mine)) if known.item_counts else 0.0,
        pending=mine, skip_until=min(covering[0], end) if covering else 0, item_counts=known.item_counts)
    return window, position
