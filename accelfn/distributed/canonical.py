"""A sum over ranks in one fixed tree, so that its bits do not depend on the world size; and
``invariant()``'s model phase, which replicates the model without DDP (``Replicas``).

``canonical_all_reduce`` adds the ranks' tensors as the binary counter of
``accelfn.transforms.invariant`` adds leaves: the world is cut into blocks of
``2^j`` consecutive ranks, one per set bit of ``W`` (largest first); inside a block, recursive
doubling (butterfly: round ``k`` pairs rank ``r`` with ``r XOR 2^k``, and both add the two
subtrees, whose sum is the same bits whichever side computes it, IEEE addition being
commutative) leaves every rank of the block with the block's complete tree; the blocks'
roots are then broadcast and folded from the last: ``B_0 + (B_1 + (... + B_m))``. For a
power-of-two ``W`` there is a single block and no broadcast.

Unlike the backend's all-reduce (ring, or tree by message size, in an order neither fixed
nor exposed), the order of every addition is a function of the rank alone.

References:
    Thakur, Rabenseifner, Gropp, "Optimization of collective communication operations in
    MPICH", IJHPCA 19(1), 2005 (recursive doubling).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist

from accelfn.distributed.agreement import all_same
from accelfn.distributed.ops import is_dtensor, mark_replicas, rank, world_size
from accelfn.distributed.phases import ModelPhase
from accelfn.transforms import Invariant

if TYPE_CHECKING:
    from accelfn.distributed.phases import Hardware, Preparation


def blocks(world: int) -> list[tuple[int, int]]:
    """``(first rank, size)`` of each power-of-two block of ``world`` ranks, largest first."""
    out, start = [], 0
    for bit in reversed(range(world.bit_length())):
        size = 1 << bit
        if world & size:
            out.append((start, size))
            start += size
    return out


def canonical_all_reduce(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The sum over ranks of each of ``tensors``, added in the canonical tree (see module doc).

    Args:
        tensors: this rank's tensors (any shapes; the same shapes and dtypes on every rank),
            on the device of the process group's backend. They are overwritten.

    Returns:
        list[torch.Tensor]: the sums, the same bits on every rank.

    Communication per rank: ``log2(W)`` exchanges of the whole tensors for a power-of-two
    ``W`` (a ring all-reduce moves ``2 (W - 1) / W`` of them), plus one broadcast per
    further block otherwise.

    References:
        Thakur et al. 2005 (recursive doubling).
    """
    out = list(tensors)
    world = world_size()
    if world == 1:
        return out
    me = rank()
    layout = blocks(world)
    first, size = next((s, n) for s, n in layout if s <= me < s + n)
    distance = 1
    while distance < size:
        partner = me ^ distance
        received = [torch.empty_like(t) for t in out]
        ops = [dist.P2POp(dist.isend, t, partner) for t in out] + [
            dist.P2POp(dist.irecv, r, partner) for r in received]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        out = [t.add_(r) for t, r in zip(out, received)]
        distance <<= 1
    if len(layout) == 1:
        return out
    roots = []
    for start, _ in layout:
        root = out if start == first else [torch.empty_like(t) for t in out]
        for t in root:
            dist.broadcast(t, src=start)
        roots.append(root)
    top = roots[-1]
    for root in reversed(roots[:-1]):
        top = [a + b for a, b in zip(root, top)]
    return top


class Replicas(ModelPhase):
    """``invariant()``'s model phase, in ``replicate``'s row: no DDP (the canonical sum replaces
    its all-reduce); rank 0's parameters and buffers broadcast once (as DDP does when it
    wraps; a model ``shard_params`` sharded was broadcast before sharding), and a warning where
    a condition of the guarantee is not met here (:func:`check_conditions`)."""

    name: ClassVar[str] = "invariant"

    @classmethod
    def of(cls, prep: Preparation) -> Replicas | None:
        return cls() if prep.step.find(Invariant) is not None else None

    def check(self, prep: Preparation) -> None:
        check_conditions(prep.hardware)

    def apply(self, prep: Preparation) -> None:
        if prep.hardware.world_size > 1:
            if not any(is_dtensor(p) for p in prep.state.model.parameters()):  # sharded: broadcast before
                broadcast_model(prep.state.model)
            mark_replicas(prep.state.model)


def check_conditions(context: Hardware) -> None:
    """Warns (on the main process) where a condition of ``invariant()``'s guarantee is not met
    here: ranks with different numbers of intra-op threads (a collective), or CUDA without
    deterministic algorithms. What no process can see (the thread count of another run) the
    docs ask for."""
    threads = torch.get_num_threads()
    same = all_same([threads], device=context.collective_device) if context.world_size > 1 else True
    problems = [] if same else [f"the processes run different numbers of intra-op threads (this one {threads})"]
    if context.device.type == "cuda" and not torch.are_deterministic_algorithms_enabled():
        problems.append("torch.use_deterministic_algorithms(True) is not set, so CUDA kernels may add in any order")
    if problems and context.rank == 0:
        warnings.warn(f"invariant(): {'; '.join(problems)}: the run is correct but may differ bit for bit from "
                      "the same run on another number of processes (docs/14-invariant.md, Conditions)",
                      RuntimeWarning, stacklevel=5)


def broadcast_model(model: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers copied into every rank's model, in place (a collective)."""
    if world_size() == 1:
        return
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)
