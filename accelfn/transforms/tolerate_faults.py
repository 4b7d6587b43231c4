"""``tolerate_faults``: per-update fault tolerance over replica groups, on torchft.

A job of ``replica_groups`` groups, each a launch of its own (one process or many, training
the same program under ``replicate()``): every update the live groups form a quorum at
torchft's lighthouse; a group that died is left out of the next update while the others
train on without restarting, and a group that comes back (or a new one) copies a live
group's whole TrainState before it joins. The record and its verb; the pure rule of which
micro-batches each group computes (``share``); the rest is ``distributed.fault_tolerance``
(torchft's Manager, process groups, the live transfer of the state) and the step function
in ``backends/_tolerant_step.py``.

References:
    torchft, PyTorch's per-step fault tolerance: https://github.com/pytorch/torchft (its
    ``Manager``, lighthouse and reconfigurable process groups).
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from accelfn.errors import count_at_least_one, finite_positive
from accelfn.step import Phase, TransformBase
from accelfn.transforms.context_parallel import ContextParallel
from accelfn.transforms.deepspeed import DeepSpeed
from accelfn.transforms.pipeline import Pipeline
from accelfn.transforms.shard_params import ShardParams
from accelfn.transforms.tensor_parallel import TensorParallel


def _lighthouse(instance: object, attribute: attrs.Attribute, value: str | None) -> None:
    if value is not None and (not isinstance(value, str) or ":" not in value):
        raise TypeError(f"tolerate_faults(lighthouse=...) must be None or the lighthouse's address "
                        f"'http://HOST:PORT', got {value!r}")


@attrs.frozen
class TolerateFaults(TransformBase):
    """Per-update fault tolerance over ``replica_groups`` copies of the job, on torchft.

    Every update starts with a quorum of the live replica groups (torchft's lighthouse and
    ``Manager``): the update's micro-batches are computed by the groups in the quorum and
    summed over them (torchft's reconfigurable process group), and each group applies the
    update only if every exchange succeeded (``Manager.should_commit``); otherwise the same
    update is computed again with the next quorum (a replay: at most that update's
    micro-batches). A group behind the others (restarted, or new) first copies a live group's
    whole TrainState (model, optimizer, scheduler, counters, data position, RNG and
    transform states) over the network, never from a checkpoint.

    Under ``invariant()`` the groups in the quorum share all of the update's micro-batches
    and add them in the canonical tree: the run is the same bits whichever groups were
    alive. Without it each group computes its own fixed part, and a missing group's part
    of an update is not computed (the update's batch shrinks by it); see
    docs/16-fault-tolerance.md.

    Attributes:
        replica_groups: the groups of the whole job, numbered 0..N-1 (each launch's
            ``--replica-group``): without ``invariant()``, group ``g`` computes the ``g``-th
            of ``N`` parts of every update's micro-batches.
        min_replicas: the fewest groups an update may be applied by (fewer: the groups wait,
            replaying the update, until enough are back).
        timeout_s: how long an exchange between groups (the gradients' sum, the copy of a
            state) may take before the update is replayed without the groups it waited for.
        quorum_timeout_s: how long a group waits for a quorum (the lighthouse, and at least
            ``min_replicas`` groups) before it fails.
        lighthouse: the lighthouse's address ``http://HOST:PORT``; None: ``TORCHFT_LIGHTHOUSE``
            (which ``accelfn launch --lighthouse`` sets).
    """

    phase: ClassVar[Phase] = Phase.MODEL
    kind: ClassVar[str] = "tolerate_faults"
    verb: ClassVar[str] = "tolerate_faults"
    reduces_gradients: ClassVar[bool] = True

    replica_groups: int = attrs.field(validator=count_at_least_one)
    min_replicas: int = attrs.field(default=1, validator=count_at_least_one)
    timeout_s: float = attrs.field(default=60.0, validator=finite_positive)
    quorum_timeout_s: float = attrs.field(default=120.0, validator=finite_positive)
    lighthouse: str | None = attrs.field(default=None, validator=_lighthouse)

    def __attrs_post_init__(self) -> None:
        if self.min_replicas > self.replica_groups:
            raise ValueError(f"tolerate_faults(min_replicas={self.min_replicas}): must be at most "
                             f"replica_groups={self.replica_groups}")

    def conflicts_with(self, other: TransformBase) -> str | None:
        if isinstance(other, ShardParams):
            return ("tolerate_faults() replicates whole copies of the state over replica groups, and shard_params() "
                    "inside a group is not built yet; use replicate() in each group")
        if isinstance(other, (TensorParallel, ContextParallel, Pipeline, DeepSpeed)):
            return (f"tolerate_faults() replicates whole copies of the model over replica groups, and "
                    f"{other.verb}() splits one over ranks, which is not built with it; use replicate()")
        return None


def share(position_count: int, index: int, parts: int) -> range:
    """The micro-batches (positions ``0..position_count-1`` of a process's window) that part
    ``index`` of ``parts`` computes: contiguous, the parts' sizes differing by at most one,
    ``[index * count // parts, (index + 1) * count // parts)``.

    Example:
        >>> [list(share(5, i, 2)) for i in range(2)]
        [[0, 1], [2, 3, 4]]
    """
    return range(index * position_count // parts, (index + 1) * position_count // parts)


def tolerate_faults(replica_groups: int, *, min_replicas: int = 1, timeout_s: float = 60.0,
                    quorum_timeout_s: float = 120.0, lighthouse: str | None = None) -> TolerateFaults:
    """Per-update fault tolerance over ``replica_groups`` replica groups (torchft).

    Compose it with ``replicate()``; start each group with ``accelfn launch --replica-group
    I --lighthouse HOST:PORT`` (one of them, or a lighthouse of its own, serving it:
    ``--serve-lighthouse``). A group that dies is left out of the next update and the others
    go on without a restart; one that comes back copies a live group's TrainState and joins.
    See :class:`TolerateFaults` and docs/16-fault-tolerance.md.

    Args:
        replica_groups: the groups of the whole job (int >= 1).
        min_replicas: the fewest groups an update is applied by (1..replica_groups).
        timeout_s: seconds an exchange between groups may take (finite, > 0).
        quorum_timeout_s: seconds a group waits for a quorum before it fails (finite, > 0).
        lighthouse: ``http://HOST:PORT`` of torchft's lighthouse; None: ``TORCHFT_LIGHTHOUSE``.

    Returns:
        TolerateFaults: the transform.

    Raises:
        TypeError: a count that is not an int, a lighthouse that is not an address.
        ValueError: a count below 1, ``min_replicas`` above ``replica_groups``, a timeout
            that is not a finite number > 0.

    References:
        torchft (https://github.com/pytorch/torchft): Manager, lighthouse, process groups.

    Example:
        >>> import accelfn as af
        >>> af.tolerate_faults(2)
        TolerateFaults(replica_groups=2, min_replicas=1, timeout_s=60.0, quorum_timeout_s=120.0, lighthouse=None)
    """
    return TolerateFaults(replica_groups, min_replicas, timeout_s, quorum_timeout_s, lighthouse)
