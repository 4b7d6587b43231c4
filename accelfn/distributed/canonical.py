"""A sum over ranks in one fixed tree, so that its bits do not depend on the world size.

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

from collections.abc import Sequence

import torch
import torch.distributed as dist

from accelfn.distributed.ops import rank, world_size


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
