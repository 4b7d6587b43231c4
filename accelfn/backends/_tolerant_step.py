"""The step function of a program under ``tolerate_faults``: every update a quorum of the live
replica groups (torchft), the update's micro-batches shared among them, one exchange of
their partial sums, and the update applied only where every group's exchange succeeded;
otherwise the same update again with the next quorum.

Every replica group reads every micro-batch of every update (its processes as under
``invariant()``, or as ``shard_data`` deals them without it) and computes its share::

    quorum    Link.quorum: the live groups; a group behind them copies a live group's state
              (a heal) and, if that moves its data position, the loop reads on from there
    share     under invariant(): the update's micro-batches split among the groups in the
              quorum (tolerate_faults.share), so the survivors take over a missing group's;
              without it: group g's fixed g-th part, so a missing group's part is not computed
    leaf      as under invariant(): each micro-batch's gradient flattened into a leaf of the
              binary counter (its random draws keyed by its global index under invariant())
    -- the update's last micro-batch --
    exchange  every rank's subtrees, within the group (its process group) and across the
              groups (torchft's process group), all-gathered: every rank holds every leaf's
              subtree of the update
    sum       under invariant(): pushed in order of their first leaf and folded, the canonical
              tree of the whole update (the same bits as any world size without faults);
              without it: folded in that order over the micro-batches that were computed
    commit    Link.commit (torchft's should_commit): apply (unscale, clip, step: the update
              tail), or replay: a new quorum and the held micro-batches computed again
              (at most this update's), until it is applied

No window is kept in the TrainState: a state saved in the middle of an update resumes at
the update's first micro-batch (the loop reads on from the position the step function
returns).
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import orjson
import torch
import torch.distributed as dist

from accelfn import distributed
from accelfn.backends._interpreter import foreign_state
from accelfn.backends._invariant import InvariantStepFn
from accelfn.data.tree import map_tensors, num_samples
from accelfn.distributed.fault_tolerance import Link, ReplicaError
from accelfn.state import TrainState
from accelfn.step import NO_METRICS, Step, detach
from accelfn.transforms import Invariant, TolerateFaults
from accelfn.transforms.invariant import Node, fold, global_index, push
from accelfn.transforms.tolerate_faults import share

if TYPE_CHECKING:
    from accelfn.backends.base import Backend

#: an update not applied after this many replays stops the run (something other than a lost group fails)
MAX_REPLAYS = 100
#: seconds between replays while fewer than ``min_replicas`` groups are in the quorum
_WAIT_FOR_REPLICAS_S = 1.0


@attrs.define(eq=False)
class _Update:
    """The update in progress: where it starts, the quorum's view, and what was computed."""

    start: tuple[int, int]  # (epoch, epoch_micro_step of its first micro-batch)
    live: TrainState  # the state at its start (what a healing group gets, and what a replay starts from)
    participants: int
    positions: range  # the positions of this process's window it computes
    healed: bool
    rng: tuple[Any, ...]  # the global generators at its start (put back before a replay)
    batches: list[tuple[int, Any]] = attrs.Factory(list)  # (position, micro-batch), held for replays
    nodes: tuple[Node, ...] = ()
    names: tuple[str, ...] | None = None  # the user's metric names, once a leaf is computed
    item_counts: bool | None = None  # whether loss_fn returned an af.Loss
    samples: int = 0  # this rank's samples in the update
    items: float = 0.0
    replays: int = 0
    computed: int = 0  # the micro-batches (of every rank of every group) the update's sum holds


class TolerantStepFn(InvariantStepFn):
    """``step_fn(state, batch, *, flush=False) -> (state, metrics)`` under ``tolerate_faults``.

    As :class:`InvariantStepFn` (the leaves, the tree, the update tail), with the update's
    micro-batches shared among the replica groups of each update's quorum (module docstring).
    Metrics add ``replicas`` (the groups in the update's quorum), ``replays`` (how many times
    it was computed again before it was applied), ``healed`` (1 where this group copied a live
    group's state before it) and ``micro_batches`` (the micro-batches, of every process of
    every group, whose gradients the update holds: always ``W * A`` under ``invariant()``;
    without it, fewer while a group is missing).

    A call may return a state at another data position than the one after ``batch`` (this
    group healed to a live group's position, or a state resumed mid-update goes back to the
    update's first micro-batch) with no metrics: ``af.run`` reads on from that position.

    Raises (of a call):
        RuntimeError: no quorum within ``quorum_timeout_s``; an update replayed
            ``MAX_REPLAYS`` times without being applied.
        CheckpointError: a live group's state does not fit this group's (another program).
        As :class:`InvariantStepFn`.
    """

    def __init__(self, backend: Backend, step: Step, state: TrainState, model: torch.nn.Module, link: Link):
        super().__init__(backend, step, state, model)
        spec = step.find(TolerateFaults)
        assert spec is not None and link is not None, "the tolerate_faults phase builds the link"
        self._spec = spec
        self._link = link
        self._keyed = step.find(Invariant) is not None  # invariant(): keyed draws, the canonical tree
        self._current: _Update | None = None
        self._names: tuple[str, ...] | None = None
        self._item_counts: bool | None = None
        self._device = self._params[0].device if self._params else backend.device
        self._numel = sum(p.numel() for p in self._params)

    # -- one micro-batch ---------------------------------------------------------------------

    def __call__(self, state: TrainState, batch: Any, *, flush: bool = False) -> tuple[TrainState, Mapping[str, Any]]:
        if state.model is not self._owner:
            raise foreign_state()
        n = self._n
        position = state.epoch_micro_step % n
        last = flush or position == n - 1
        update = self._current
        if update is None or update.start != (state.epoch, state.epoch_micro_step - position):
            if position:  # resumed in the middle of an update: it is computed again from its first micro-batch
                return self._rewound(state, position), NO_METRICS
            if self._keyed and self._layout is None:
                state = self._check_layout(state, num_samples(batch))
            state, moved = self._begin(state)
            if moved:
                return state, NO_METRICS
            update = self._current
            assert update is not None
        if self._cast_inputs:
            dtype = self._policy.param_dtype
            batch = map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, batch)
        update.batches.append((position, batch))
        update.samples += num_samples(batch)
        if position in update.positions and not self._link.failed:
            self._leaf(update, state.epoch, state.epoch_micro_step, batch)
        if not last:
            return state._advance(step=state.step, micro_step=state.micro_step + 1,
                                  epoch_micro_step=state.epoch_micro_step + 1,
                                  transforms_state=state.transforms_state), NO_METRICS
        return self._close(position)

    def _rewound(self, state: TrainState, position: int) -> TrainState:
        """``state`` at the first micro-batch of the update it is inside of."""
        return state._advance(step=state.step, micro_step=state.micro_step - position,
                              epoch_micro_step=state.epoch_micro_step - position,
                              transforms_state=state.transforms_state)

    def _begin(self, state: TrainState, *, replays: int = 0) -> tuple[TrainState, bool]:
        """The quorum of the update starting at ``state``; the state after it (healed, or
        ``state``) and whether that moved the data position."""
        rng = _rng_state(self._cuda)
        healed = self._link.quorum(state)
        moved = False
        if healed is not None:
            moved = (healed.epoch, healed.epoch_micro_step) != (state.epoch, state.epoch_micro_step)
            if self._rank == 0:
                print(f"accelfn: replica group {self._link.group} copied a live group's state: step {healed.step}, "
                      f"epoch {healed.epoch}, micro-batch {healed.epoch_micro_step} of it", file=sys.stderr,
                      flush=True)
            state, rng = healed, _rng_state(self._cuda)
        participants, index = self._link.participants, self._link.index
        if self._keyed:  # the groups in the quorum share every micro-batch of the update
            positions = range(0) if index is None else share(self._n, index, participants)
        else:  # each group its own part: a missing group's part is not computed
            positions = share(self._n, self._link.group, self._spec.replica_groups)
        if participants < self._spec.min_replicas:
            positions = range(0)
        self._current = _Update(start=(state.epoch, state.epoch_micro_step), live=state, participants=participants,
                                positions=positions, healed=healed is not None, rng=rng, replays=replays,
                                names=self._names, item_counts=self._item_counts)
        return state, moved

    def _leaf(self, update: _Update, epoch: int, epoch_micro_step: int, batch: Any) -> None:
        """One micro-batch's gradient, pushed on the update's stack of subtrees."""
        index = global_index(epoch_micro_step, rank=self._rank, world_size=self._world, num_micro_batches=self._n)
        scale = update.live.transforms_state["loss_scale"].scale if self._scaling is not None else 1.0
        if self._keyed:
            loss, count, user_metrics, is_sum = self._forward_backward(batch, epoch, index, scale)
        else:
            loss, count, user_metrics, is_sum = self._forward(batch)
            (loss * scale if scale != 1.0 else loss).backward()
        names = tuple(sorted(user_metrics)) if user_metrics else ()
        if update.names is not None and update.item_counts is not None and (
                names != update.names or is_sum != update.item_counts):
            raise ValueError(f"loss_fn returned {'an af.Loss' if is_sum else 'a plain loss'} with the metrics "
                             f"{list(names)} on a micro-batch and {'an af.Loss' if update.item_counts else 'a plain loss'}"
                             f" with {list(update.names)} on an earlier one; return the same kind and names every time")
        update.names, update.item_counts = names, is_sum
        self._names, self._item_counts = names, is_sum
        weight = count if is_sum else 1.0
        sums = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=loss.device).reshape(())
                            for v in (loss.detach(), weight, *(detach(user_metrics[k]) * weight for k in names))])
        update.nodes = push(update.nodes, Node(index, 0, self._take_grads(), sums), self._origin(index))
        update.items += float(count) if is_sum else 0.0

    # -- the update's last micro-batch: exchange, sum, commit or replay ----------------------

    def _close(self, last_position: int) -> tuple[TrainState, Mapping[str, Any]]:
        update = self._current
        assert update is not None
        while True:
            summed = None
            # the group's processes enter the exchange together or not at all (its collectives pair up)
            failed = self._link.failed or update.participants < self._spec.min_replicas
            if self._world > 1:
                failed = distributed.any_rank(failed, device=self._backend.collective_device)
            if not failed:
                try:
                    summed = self._sum(update)
                except ReplicaError:
                    summed = None
            if self._link.commit() and summed is not None:
                return self._apply(update, last_position, *summed)
            if update.replays + 1 >= MAX_REPLAYS:
                raise RuntimeError(
                    f"replica group {self._link.group}: the update after step {update.live.step} was computed "
                    f"{MAX_REPLAYS} times and never applied (the last quorum had {update.participants} of "
                    f"{self._spec.replica_groups} groups, min_replicas={self._spec.min_replicas}): {self._link.manager.errored()}")
            if update.participants < self._spec.min_replicas:
                time.sleep(_WAIT_FOR_REPLICAS_S)
            update = self._replay(update)
            if update is None:  # healed to another position: the loop reads on from there
                healed = self._current
                assert healed is not None
                return healed.live, NO_METRICS

    def _replay(self, failed: _Update) -> _Update | None:
        """The update again, with a new quorum, from its held micro-batches; None when the
        quorum moved this group's position (it healed)."""
        _set_rng_state(failed.rng, self._cuda)
        for p in self._params:
            p.grad = None
        state, moved = self._begin(failed.live, replays=failed.replays + 1)
        if moved:
            return None
        update = self._current
        assert update is not None
        update.batches, update.samples = failed.batches, failed.samples
        epoch, first = update.start
        for position, batch in update.batches:
            if position in update.positions and not self._link.failed:
                self._leaf(update, epoch, first + position, batch)
        return update

    def _sum(self, update: _Update) -> tuple[torch.Tensor, torch.Tensor]:
        """The update's gradient sum and its sums (loss, count, metrics), from every rank of
        every group in the quorum (module docstring).

        Raises:
            ReplicaError: an exchange failed, or the groups' leaves do not cover the update
                exactly once (their quorums disagreed).
        """
        nodes = self._exchange(update)
        nodes.sort(key=lambda node: node.start)
        update.computed = sum(2 ** node.height for node in nodes)
        if self._keyed:
            first = update.start[1] // self._n * self._world * self._n
            covered = [leaf for node in nodes for leaf in range(node.start, node.start + 2 ** node.height)]
            if covered != list(range(first, first + self._world * self._n)):
                error = ReplicaError(f"the replica groups' shares of the update do not cover its micro-batches once "
                                     f"each (leaves {covered})")
                self._link.manager.report_error(error)
                raise error
            stack: tuple[Node, ...] = ()
            for node in nodes:
                stack = push(stack, node, first)
            root = fold(stack)
        else:
            root = fold(nodes)
        return root.grads, root.sums

    def _exchange(self, update: _Update) -> list[Node]:
        """Every rank's subtrees of the update, of every group in the quorum (all-gathers within
        the group, then across the groups); also agrees on the metric names and loss kind."""
        names = update.names
        code = orjson.dumps(list(names)) if names is not None else b""
        heads = torch.tensor([[len(update.nodes), len(code) if names is not None else -1,
                               -1 if update.item_counts is None else int(update.item_counts)]], dtype=torch.int64)
        heads = self._everyone(heads)  # (ranks of every group, 3)
        most = int(heads[:, 0].max())
        known = [i for i in range(heads.shape[0]) if int(heads[i, 1]) >= 0]
        if not known:  # no rank computed a micro-batch: nothing to add
            error = ReplicaError("no replica group computed a micro-batch of this update")
            self._link.manager.report_error(error)
            raise error
        width = int(heads[known, 1].max())
        lengths = {int(heads[i, 1]) for i in range(heads.shape[0])}
        if len(lengths) > 1:  # some rank has not seen the metric names yet (or they differ): exchanged
            padded = torch.zeros((1, width), dtype=torch.uint8)
            if code:
                padded[0, :len(code)] = torch.frombuffer(bytearray(code), dtype=torch.uint8)
            codes = self._everyone(padded)
            found = {bytes(codes[i, :int(heads[i, 1])].tolist()) for i in known}
            if len(found) != 1:
                raise ValueError("loss_fn returned other metric names on some replica groups' micro-batches than "
                                 "on others' of the same update; return the same names every time")
            names = tuple(orjson.loads(found.pop()))
        assert names is not None, "one length on every rank, and some rank knows the names: so does this one"
        update.names = self._names = names
        kinds = {int(heads[i, 2]) for i in range(heads.shape[0]) if int(heads[i, 2]) >= 0}
        if len(kinds) > 1:
            raise ValueError("loss_fn returned an af.Loss on some replica groups and a plain loss on others; return "
                             "the same kind everywhere")
        update.item_counts = self._item_counts = bool(kinds.pop())
        metrics = len(names)
        meta = torch.zeros((1, most, 2), dtype=torch.int64)
        grads = torch.zeros((1, most, self._numel), dtype=self._flat_dtype)
        sums = torch.zeros((1, most, 2 + metrics), dtype=torch.float64)
        for i, node in enumerate(update.nodes):
            meta[0, i, 0], meta[0, i, 1] = node.start, node.height
            grads[0, i], sums[0, i] = node.grads.to("cpu"), node.sums.to("cpu")
        meta, grads, sums = (self._everyone(t) for t in (meta, grads, sums))
        return [Node(int(meta[r, i, 0]), int(meta[r, i, 1]), grads[r, i].to(self._device), sums[r, i].to(self._device))
                for r in range(meta.shape[0]) for i in range(int(heads[r, 0]))]

    def _everyone(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (a CPU tensor of shape ``(1, ...)``) of every rank of every group in the
        quorum, concatenated along dim 0: this group's ranks in rank order, the groups in
        quorum order."""
        if self._world > 1:
            device = self._backend.collective_device
            local = tensor.to(device)
            received = [torch.empty_like(local) for _ in range(self._world)]
            dist.all_gather(received, local)
            tensor = torch.cat(received).to("cpu")
        gathered, error = None, None
        try:
            gathered = self._link.allgather(tensor.reshape(1, *tensor.shape))
        except ReplicaError as e:
            error = e
        # every process of the group goes on to the next exchange, or none: one that failed stops all
        if self._world > 1 and distributed.any_rank(error is not None, device=self._backend.collective_device):
            raise error or ReplicaError("another process of this replica group failed its exchange")
        if error is not None:
            raise error
        assert gathered is not None
        return torch.cat(gathered).reshape(-1, *tensor.shape[1:])

    def _apply(self, update: _Update, last_position: int, grads: torch.Tensor,
               totals: torch.Tensor) -> tuple[TrainState, Mapping[str, Any]]:
        """The update tail on the summed gradients, from the update's state at its last micro-batch."""
        names = update.names or ()
        base = update.live
        state = base._advance(step=base.step, micro_step=base.micro_step + last_position,
                              epoch_micro_step=base.epoch_micro_step + last_position,
                              transforms_state=base.transforms_state)
        global_count = float(totals[1])
        correction = 1.0 / global_count if global_count > 0 else 0.0
        self._put_grads(grads.to(self._flat_dtype))
        means = (totals * correction).to(torch.float32)
        user_means = {k: means[2 + i] for i, k in enumerate(names)}
        self._current = None
        new_state, metrics = self._update(state, correction, update.samples, means[0], user_means,
                                          items=update.items if update.item_counts else None)
        return new_state, {**metrics, "replicas": update.participants, "replays": update.replays,
                           "healed": int(update.healed), "micro_batches": update.computed}


def _rng_state(cuda: bool) -> tuple[Any, ...]:
    """The global generators' states (torch's CPU and current CUDA device's, Python's, NumPy's)."""
    return (torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None, random.getstate(),
            np.random.get_state())


def _set_rng_state(saved: tuple[Any, ...], cuda: bool) -> None:
    cpu, gpu, python, numpy = saved
    torch.set_rng_state(cpu)
    if cuda and gpu is not None:
        torch.cuda.set_rng_state(gpu)
    random.setstate(python)
    np.random.set_state(numpy)
