"""``tolerate_faults``' model phase and this replica group's link to the others, on torchft.

Each replica group is a job of its own (its own launch, process group and store); the groups
meet every update at torchft's lighthouse. ``Replicas`` is the phase (a row of
``backends._phases.PHASES``): it checks the program and the launch, then builds the
``Link``: torchft's ``Manager`` (the quorum at the start of each update, the vote on whether
to apply it), its reconfigurable gloo process group across the groups (this group's rank
``r`` with every other group's rank ``r``), a store for this group that the quorum's
process groups meet at, and the transport a healing group fetches a live group's state
through (``_state_transport``).

A healing group takes a live group's whole TrainState. Packing and checking one is the
checkpoint's business, a layer above this one: ``accelfn.checkpoint`` registers its
``StateTransfer`` here when it is imported (``register_transfer``).

torchft's step counter is set before each quorum to this rank's ``micro_step`` (the same on
every group at the same update: each group reads every micro-batch of every update), so the
quorum's ``max_step`` names the furthest state, and a group whose count is lower heals.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from accelfn.distributed.phases import ModelPhase
from accelfn.errors import LaunchError, TransformError
from accelfn.state import TrainState
from accelfn.transforms import Accumulate, Invariant, Replicate, TolerateFaults

if TYPE_CHECKING:
    from accelfn.distributed.phases import Hardware, Preparation


#: torchft's ``quorum_retries``: a lighthouse that does not answer is asked again this many times,
#: backing off, before the quorum fails (a lighthouse restarted at its address in the meantime is
#: found again: measured, one down for 5 s delayed the next update by 18 s); ``TORCHFT_QUORUM_RETRIES``
#: overrides it
QUORUM_RETRIES = 20


class StateTransfer(Protocol):
    """How a replica group's TrainState travels to a healing group (``accelfn.checkpoint``'s)."""

    def pack(self, state: TrainState) -> torch.Tensor:
        """``state`` as bytes in a ``uint8`` tensor (nothing in it changes)."""
        ...

    def unpack(self, state: TrainState, data: torch.Tensor, *, source: str) -> TrainState:
        """``data`` (from ``pack`` on another group) checked against ``state`` and put into it.

        Raises:
            CheckpointError: ``data`` does not decode, or does not fit ``state`` (named by ``source``).
        """
        ...


_transfer: list[StateTransfer] = []


def register_transfer(transfer: StateTransfer) -> None:
    """Makes ``transfer`` the way states travel between replica groups (``accelfn.checkpoint``
    registers its own when imported)."""
    _transfer[:] = [transfer]


class ReplicaError(RuntimeError):
    """An exchange between replica groups failed (reported to torchft's Manager: the update is
    not applied, and is computed again with the next quorum)."""


class Link:
    """This replica group's torchft Manager, process group across groups, store and transport.

    Args:
        spec: the program's ``tolerate_faults``.
        hardware: this process's place in its group (rank, world size, device).
        group: this group's index (``ACCELFN_REPLICA_GROUP``).
        lighthouse: the lighthouse's URL.

    Attributes:
        manager: torchft's ``Manager``.
        group: this group's index, 0..replica_groups-1.
        live: the state at the start of the update in progress (what a healing group gets).
        healed: the state a quorum put in place of ``live`` (this group healed), or None.
        heals: how many times this group healed.
    """

    def __init__(self, spec: TolerateFaults, hardware: Hardware, *, group: int, lighthouse: str):
        torchft = _torchft()
        Manager, ProcessGroupGloo = torchft.Manager, torchft.ProcessGroupGloo  # noqa: N806 (torchft's classes)

        from accelfn.distributed._state_transport import StateTransport

        self.spec = spec
        self.group = group
        self.live: TrainState | None = None
        self.healed: TrainState | None = None
        self.heals = 0
        self._open = True
        self._hardware = hardware
        host = socket.gethostname()
        self._store = _group_store(host, hardware)
        timeout = timedelta(seconds=spec.timeout_s)
        self._pg = ProcessGroupGloo(timeout=timeout)
        self._transport = StateTransport(host, spec.timeout_s)
        self.manager = Manager(
            pg=self._pg, load_state_dict=self._load, state_dict=self._pack, min_replica_size=spec.min_replicas,
            use_async_quorum=False, timeout=timeout, quorum_timeout=timedelta(seconds=spec.quorum_timeout_s),
            connect_timeout=timeout, rank=hardware.rank, world_size=hardware.world_size, store_addr=host,
            store_port=self._store.port, lighthouse_addr=lighthouse, replica_id=f"replica_group_{group}",
            hostname=host, checkpoint_transport=self._transport, init_sync=True, quorum_retries=QUORUM_RETRIES)
        self._lighthouse = lighthouse
        atexit.register(self.close)
        logging.getLogger("torchft.manager").addFilter(_quiet)

    # -- the state a healing group gets -------------------------------------------------------

    def _pack(self) -> torch.Tensor:
        assert self.live is not None, "a quorum runs only from begin(), which sets the live state"
        return _transfer[0].pack(self.live)

    def _load(self, data: torch.Tensor) -> None:
        assert self.live is not None, "a quorum runs only from begin(), which sets the live state"
        self.healed = _transfer[0].unpack(self.live, data, source="the state of a live replica group")
        self.heals += 1

    # -- an update ----------------------------------------------------------------------------

    def quorum(self, state: TrainState) -> TrainState | None:
        """The quorum of this update: ``state`` is what a healing group would get; returns the
        state this group healed to, or None (it is up to date).

        Raises:
            RuntimeError: no quorum within ``quorum_timeout_s`` (the lighthouse gone, or fewer
                than ``min_replicas`` groups).
        """
        self.live, self.healed = state, None
        self.manager.load_state_dict({"step": state.micro_step,
                                      "batches_committed": self.manager.batches_committed()})
        try:
            self.manager.start_quorum()
        except Exception as e:  # noqa: BLE001 (torchft raises its Rust client's errors: TimeoutError, RuntimeError)
            raise RuntimeError(
                f"replica group {self.group}: no quorum at the lighthouse {self._lighthouse} ({type(e).__name__}: "
                f"{e}); is it running, and are at least min_replicas={self.spec.min_replicas} groups alive? (each "
                f"quorum waits up to quorum_timeout_s={self.spec.quorum_timeout_s:g} s, and a lighthouse that is gone "
                f"is asked again {QUORUM_RETRIES} times, backing off)") from e
        return self.healed

    @property
    def failed(self) -> bool:
        """Whether something of this update failed already (the quorum's process group, a heal,
        an exchange): this group then neither computes nor sends, and the update is replayed."""
        return self.manager.errored() is not None

    @property
    def participants(self) -> int:
        """The replica groups in this update's quorum."""
        return self.manager.num_participants()

    @property
    def index(self) -> int | None:
        """This group's place among them (None: it takes no part in this update)."""
        return self.manager.participating_rank()

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every group's ``tensor`` (the same shape on each), in quorum order, over the groups'
        process group (on the CPU: gloo).

        Raises:
            ReplicaError: the exchange failed (reported to the Manager first).
        """
        if self.manager.errored() is not None:
            raise ReplicaError("an exchange of this update failed already")
        local = tensor.detach().to("cpu").contiguous()
        out = [[torch.empty_like(local) for _ in range(self.participants)]]
        try:
            self._pg.allgather(out, [local], AllgatherOptions()).wait()
        except RuntimeError as e:  # gloo's errors (DistBackendError, ...): a peer gone, a timeout
            self.manager.report_error(e)
            raise ReplicaError(f"the exchange between replica groups failed: {e}") from e
        return [t.to(tensor.device) for t in out[0]]

    def allreduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of ``tensor`` over the groups in the quorum (torchft's all-reduce).

        Raises:
            ReplicaError: the exchange failed (reported to the Manager first).
        """
        local = tensor.detach().to("cpu").contiguous()
        self.manager.allreduce(local, reduce_op=dist.ReduceOp.SUM).wait()
        if self.manager.errored() is not None:
            raise ReplicaError(f"the exchange between replica groups failed: {self.manager.errored()}")
        return local.to(tensor.device)

    def commit(self) -> bool:
        """Whether this group applies the update: every exchange succeeded in every rank of the
        group and the quorum has ``min_replicas`` groups (torchft's ``should_commit``)."""
        return bool(self.manager.should_commit())

    def close(self) -> None:
        """Shuts the Manager, its server and the transport down (once; at exit at the latest)."""
        if self._open:
            self._open = False
            atexit.unregister(self.close)
            self.manager.shutdown(wait=False)


def _torchft() -> Any:
    """The ``torchft`` module, its Rust half's log at warnings unless ``RUST_LOG`` says otherwise
    (at INFO it writes four lines per quorum and commit).

    Raises:
        ImportError: torchft is not installed (the message says how to install it).
    """
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
    except ImportError:
        raise ImportError("tolerate_faults() runs on torchft, which is not installed: pip install torchft "
                          "(or accelfn[torchft])") from None
    return torchft


def _quiet(record: logging.LogRecord) -> bool:
    """Drops torchft's warning, at every quorum, that a CPU job has no NCCL flight recorder."""
    return "flight recorder" not in record.getMessage()


def _group_store(host: str, hardware: Hardware) -> Any:
    """This group's store, which the quorums' process groups meet at: served by the group's
    rank 0 on every interface (other groups' ranks reach it), its port told to the group."""
    port = torch.tensor([0], dtype=torch.int64, device=hardware.collective_device)
    store = None
    if hardware.rank == 0:
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, use_libuv=True)
        port[0] = store.port
    if hardware.world_size > 1:
        dist.broadcast(port, src=0)
    if store is None:
        store = dist.TCPStore(host, int(port[0]), is_master=False, wait_for_workers=False)
    return store


class Replicas(ModelPhase):
    """``tolerate_faults``' model phase, after ``invariant``'s row and in place of DDP: the
    program and the launch checked, then this group's ``Link`` built (the Manager joins the
    lighthouse). The step function (``backends._tolerant_step``) runs every update through it.
    """

    name: ClassVar[str] = "tolerate_faults"

    def __init__(self, spec: TolerateFaults):
        self.spec = spec

    @classmethod
    def of(cls, prep: Preparation) -> Replicas | None:
        spec = prep.step.find(TolerateFaults)
        return None if spec is None else cls(spec)

    def check(self, prep: Preparation) -> None:
        """Raises, before anything changes, where the program or the launch cannot run.

        Raises:
            ImportError: torchft is not installed.
            TransformError: the program has no ``replicate()``; without ``invariant()``, fewer
                micro-batches per process and update than replica groups.
            LaunchError: no replica group (``--replica-group``), one outside ``replica_groups``,
                or no lighthouse (``--lighthouse``).
        """
        _torchft()
        if prep.step.find(Replicate) is None:
            raise TransformError("tolerate_faults() replicates the model over replica groups (and over the "
                                 "processes of each); compose it with replicate()")
        env = prep.hardware.env
        if env.replica_group is None:
            raise LaunchError("tolerate_faults(): this process belongs to no replica group: start each group "
                              "with `accelfn launch --replica-group I --lighthouse HOST:PORT ...` (or set "
                              "ACCELFN_REPLICA_GROUP=I)")
        if env.replica_group >= self.spec.replica_groups:
            raise LaunchError(f"tolerate_faults(replica_groups={self.spec.replica_groups}): this is replica group "
                              f"{env.replica_group} (ACCELFN_REPLICA_GROUP), and the groups are numbered 0.."
                              f"{self.spec.replica_groups - 1}")
        accumulate = prep.step.find(Accumulate)
        window = accumulate.num_micro_batches if accumulate is not None else 1
        if prep.step.find(Invariant) is None and window < self.spec.replica_groups:
            raise TransformError(
                f"tolerate_faults(replica_groups={self.spec.replica_groups}) without invariant(): each group computes "
                f"its own part of every update's {window} micro-batch(es) per process, so it needs at least one per "
                f"group: accumulate({self.spec.replica_groups}) or more (or invariant(), under which the groups in "
                "each quorum share them)")
        if self.spec.lighthouse is None and env.lighthouse is None:
            raise LaunchError("tolerate_faults(): no lighthouse to meet the other replica groups at: give "
                              "`accelfn launch --lighthouse HOST:PORT` (--serve-lighthouse on one launch runs it), "
                              "set TORCHFT_LIGHTHOUSE=http://HOST:PORT, or tolerate_faults(lighthouse=...)")

    def apply(self, prep: Preparation) -> None:
        env = prep.hardware.env
        assert env.replica_group is not None, "checked"
        lighthouse = self.spec.lighthouse or env.lighthouse
        assert lighthouse is not None, "checked"
        prep.link = Link(self.spec, prep.hardware, group=env.replica_group, lighthouse=lighthouse)
        if prep.hardware.rank == 0:
            print(f"accelfn: replica group {env.replica_group} joins the lighthouse at {lighthouse}", file=sys.stderr,
                  flush=True)
