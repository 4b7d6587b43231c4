"""Collectives over ``torch.distributed`` and the cross-rank rules built on them, working
unchanged on a world of one process; the process context every backend is."""

from accelfn.distributed.agreement import (
    Agreement,
    ArrivalError,
    all_same,
    any_rank,
    arrive,
    extremes,
    failures,
    first_item,
    outcome_of_rank_0,
    same_length,
)
from accelfn.distributed.canonical import canonical_all_reduce
from accelfn.distributed.context import ProcessContext
from accelfn.distributed.ops import (
    REDUCE_OPS,
    ReduceOp,
    barrier,
    broadcast,
    broadcast_object,
    default_device,
    exchange,
    gather,
    gather_object,
    is_dtensor,
    mark_replicas,
    pad_across_processes,
    plain,
    rank,
    reduce,
    split_between_processes,
    sync_buffers,
    world_size,
)

__all__ = [
    "REDUCE_OPS", "Agreement", "ArrivalError", "ProcessContext", "ReduceOp", "all_same", "any_rank", "arrive",
    "barrier", "broadcast", "broadcast_object", "default_device", "exchange", "extremes", "failures", "gather",
    "gather_object", "is_dtensor", "mark_replicas", "outcome_of_rank_0", "pad_across_processes", "plain", "rank", "reduce",
    "same_length", "first_item", "split_between_processes", "sync_buffers", "world_size",
    "canonical_all_reduce",
]
