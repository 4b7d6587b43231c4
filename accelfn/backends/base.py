"""The backend protocol: a process context plus the primitives the interpreter needs.

A backend interprets Steps for one kind of hardware. This base class holds everything
generic — preparing a program, the epoch's batches, the collectives — and each backend
(``cpu.py``, ``cuda.py``, ``xla.py``) overrides only its primitives: the device, autocast,
how the model is replicated and gradients reduced, and XLA's graph cut.
"""

from __future__ import annotations

import abc
import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar

import torch
from torch.utils.data import DataLoader

from accelfn import distributed
from accelfn.backends._interpreter import StepFn
from accelfn.backends._phases import acting, interpreter, unsupported
from accelfn.backends._placement import check_placement, place_on, unchanged
from accelfn.data import blocks
from accelfn.data.batches import EpochBatches, check_eval_loader, epoch_batches, even_out
from accelfn.data.tree import map_tensors
from accelfn.distributed import ProcessContext, fsdp, process_group
from accelfn.distributed.env import LaunchEnv, with_launch_defaults
from accelfn.distributed.mesh import Mesh
from accelfn.distributed.mesh import agreed as agreed_mesh
from accelfn.distributed.phases import Preparation, remember
from accelfn.state import TrainState, require_state
from accelfn.step import Step, check_loss_form
from accelfn.transforms import Invariant, Replicate, ShardData, WithPrecision
from accelfn.transforms.precision import Policy, parse_policy


class Backend(ProcessContext, abc.ABC):
    """An interpreter of Steps on one kind of hardware, and this process's place in the world.

    Attributes:
        name: ``"cpu"``, ``"cuda"`` or ``"xla"``.
        supported_precisions: the precision policies this backend runs.
        rank, local_rank, world_size, local_world_size: from the launch environment (under
            ``accelfn plan``: rank 0 of the planned world, ``LaunchEnv.planned_world_size``).
        device: the ``torch.device`` this process computes on.
    """

    name: ClassVar[str]
    supported_precisions: ClassVar[tuple[str, ...]]
    #: called after every micro-batch (XLA's graph cut), or None
    graph_cut: Callable[[], None] | None = None

    def __init__(self, env: LaunchEnv, device: torch.device, *, place_model: bool = True,
                 place_batches: bool = True):
        check_placement(type(self).__name__, place_model=place_model, place_batches=place_batches)
        #: whether ``prepare`` moves the model to ``device`` (False: left where it is)
        self.place_model = place_model
        #: whether batches are moved to ``device`` as they are read (False: left as they are)
        self.place_batches = place_batches
        super().__init__(rank=env.rank, local_rank=env.local_rank, world_size=env.planned_world_size,
                         local_world_size=env.planned_local_world_size)
        self.env = env
        self.device = device
        self._active: EpochBatches | None = None
        self._placer = place_on(device) if place_batches else unchanged

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, device={self.device})"

    # -- primitives a backend may override ---------------------------------------------

    def autocast(self, program: Step | Policy) -> contextlib.AbstractContextManager[Any]:
        """The context a program's forward runs in, for code of your own (and for the step's).

        ``torch.autocast`` to the compute dtype under ``"bf16"``/``"fp16"``; a no-op under
        ``"fp32"``/``"bf16-true"``, as in training. A Step's policy is ``precision(step)``.
        A model sharded with ``shard_params`` gathers its parameters in the compute dtype
        for the forwards in this context, as in training; outside it (``af.evaluate``
        without ``precision=``, your own evaluation or generation loop) in their own dtype,
        so such forwards run in fp32 as an unsharded model's do.

        Args:
            program: the Step (or its precision Policy) whose policy to run under.

        Raises:
            TypeError: ``program`` is neither a Step nor a Policy.

        Example:
            >>> import torch, accelfn as af
            >>> step = af.with_precision("bf16")(af.train_step(lambda m, b: m(b).sum()))
            >>> with af.backends.CPU().autocast(step):
            ...     torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype
            torch.bfloat16
        """
        if isinstance(program, Policy):  # the step function's call, once per micro-batch
            policy = program
        elif isinstance(program, Step):
            policy = self.precision(program)
        else:
            raise TypeError(f"autocast() takes the Step whose precision policy to run under (or its "
                            f"Policy), got {type(program).__name__}")
        if not policy.autocast:
            return contextlib.nullcontext()
        return fsdp.training_forward(torch.autocast(device_type=self.device.type, dtype=policy.compute_dtype))

    def precision(self, step: Step) -> Policy:
        """The precision policy this backend runs ``step`` under: the program's
        ``with_precision``, else the launch's (``accelfn launch --precision``), else fp32.

        Returns:
            Policy: its ``name``, ``param_dtype``, ``compute_dtype`` and loss ``scaling``
            (None but for ``"fp16"``).

        Raises:
            TypeError: ``step`` is not a Step.
        """
        if not isinstance(step, Step):
            raise TypeError(f"precision() takes a Step (af.train_step(loss_fn) with its transforms), "
                            f"got {type(step).__name__}")
        present = step.find(WithPrecision)
        if present is not None:
            return present.policy
        return parse_policy(self.env.precision or "fp32")

    def check_precision(self, policy: Policy) -> None:
        """Raises NotImplementedError if this backend cannot run ``policy``."""
        if policy.name not in self.supported_precisions:
            raise NotImplementedError(
                f"the {self.name} backend does not support with_precision({policy.name!r}); "
                f"supported: {', '.join(map(repr, self.supported_precisions))}"
            )

    @abc.abstractmethod
    def wrap_model(self, model: torch.nn.Module, replicate: Replicate) -> torch.nn.Module:
        """The model the forward calls under ``replicate()`` (DDP on CPU/CUDA)."""

    def no_sync(self, wrapped: torch.nn.Module) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        """A context factory that suppresses the gradient all-reduce (DDP) or reduce-scatter
        (FSDP2) of non-final micro-batches."""
        if fsdp.is_sharded(wrapped):
            return functools.partial(fsdp.no_gradient_sync, wrapped)
        return getattr(wrapped, "no_sync", contextlib.nullcontext)

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Averages gradients across ranks if the wrapper did not (XLA); a no-op for DDP."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of ``tensor`` over all ranks (used for the item counts of ``af.Loss``)."""
        return distributed.reduce(tensor, "sum")

    def peak_memory_bytes(self) -> int | None:
        """The most device memory this process has held so far, in bytes, or None where the
        device has no allocator statistics (CPU: the process's RSS is reported instead)."""
        return None

    def check_replicate(self, replicate: Replicate) -> None:
        """Raises NotImplementedError if this backend cannot replicate as ``replicate`` asks
        (before anything is placed); every option is taken on CPU and CUDA."""

    #: model phases this backend cannot run: phase name -> why, raised as NotImplementedError
    refusals: ClassVar[Mapping[str, str]] = {}

    def unsupported(self, step: Step, state: TrainState, *, world_size: int | None = None) -> list[tuple[str, str]]:
        """``(phase, why)`` for each model phase of ``step`` this backend cannot run on ``state``
        (``prepare`` raises the first as NotImplementedError; ``af.plan`` lists them all).

        Args:
            step: the program.
            state: the state it would prepare (read only).
            world_size: the world to ask for (None: this process's).
        """
        world = self.world_size if world_size is None else world_size
        mesh = Mesh.of(step, world, min(world, self.local_world_size))
        prep = Preparation(self, step, state, self.precision(step), mesh, state.model)
        return unsupported(prep, acting(prep))

    def mesh(self, step: Step) -> Mesh:
        """The mesh ``step``'s transforms make of this process's world (``distributed.mesh``):
        the size of each named dimension; ``mesh(step).data_coordinates(rank)`` is the data
        shard this rank reads under ``step``.

        Raises:
            ValueError: the world size does not divide as the transforms ask (named).
        """
        return Mesh.of(step, self.world_size, self.local_world_size)

    def prepare(self, step: Step, state: TrainState) -> tuple[TrainState, StepFn]:
        """Places the state on this backend's device and specializes ``step`` for it.

        Adds the transforms ``accelfn launch`` asked for (``--precision``, ``--accumulate``,
        ``--compile``) where the program has none of their kind, builds the program's mesh,
        then runs the model phases of ``backends._phases.PHASES`` (docs/04 lists them):
        every acting phase is checked before any changes anything, each transform's entry is
        added to ``transforms_state``, and the phases apply in the table's order. The step
        function is chosen once (``backends._phases.INTERPRETERS``); its ``step`` attribute is
        the program it runs.

        Args:
            step: the program.
            state: the state to train; its model and optimizer are modified in place.

        Returns:
            (state, step_fn): the placed state and ``step_fn(state, batch, *, flush=False)
            -> (state, metrics)``.

        Raises:
            TypeError: ``step`` is not a Step or ``state`` not a TrainState.
            SystemExit: status 2 under ``accelfn plan``, which plans ``af.run`` and would
                otherwise let a loop of the script's own train.
            NotImplementedError: this backend cannot run the program's precision policy, or
                a phase (``refusals``: XLA's ``shard_params``, ``compile``, ...), or a phase
                not with these options (offloading on the CPU backend).
            ValueError: a world size the transforms cannot divide; a model prepared before
                with other transforms (sharded, split, cut) than ``step``'s; a phase's check.
            TransformError: under ``invariant()``, a batch-coupled layer (BatchNorm, ...),
                named, before anything is placed; ``af.output_loss`` without ``pipeline()``.
        """
        if not isinstance(step, Step):
            raise TypeError(f"prepare() takes a Step (af.train_step(loss_fn)), got {type(step).__name__}")
        require_state("backend.prepare(step, state)", state)
        if self.env.plan_world_size is not None:  # `accelfn plan`: a loop of the script's own would train
            print("accelfn plan: this script calls backend.prepare(step, state) and trains in a loop of its own, "
                  "which the plan cannot follow; nothing was planned or trained. Plan each program with "
                  f"af.plan(step, state, data, world_size={self.env.plan_world_size}) instead, or train with "
                  "af.run", flush=True)
            raise SystemExit(2)
        step = with_launch_defaults(step, self.env, warn=self.is_main_process)
        check_loss_form(step)
        policy = self.precision(step)
        self.check_precision(policy)
        prep = Preparation(self, step, state, policy, agreed_mesh(step, self), state.model)
        phases = acting(prep)
        for _, reason in unsupported(prep, phases):  # every check before anything changes
            raise NotImplementedError(reason)
        for phase in phases:
            phase.check(prep)
        for transform in step.transforms:
            prep.state = transform.init(prep.state)
        for phase in phases:
            phase.apply(prep)
        remember(prep)
        return prep.state, interpreter(prep)(self, prep)

    def batches(self, data: Iterable[Any], step: Step, epoch: int, *, start: int = 0,
                data_state: Any = None) -> EpochBatches:
        """This rank's device-placed micro-batches of ``epoch``, as ``(batch, is_last)`` pairs.

        Args:
            data: a DataLoader or any iterable of batches.
            step: the program (its ``shard_data``, if any, shards the data).
            epoch: the epoch, which seeds the shuffle.
            start: micro-batches of this epoch already consumed (skipped).
            data_state: a stream's readers' saved state at ``start`` (``TrainState.data_state``),
                continued from instead of reading those micro-batches again (``data.streams``).

        The backend remembers the iterable it returns last (the one piece of state it keeps
        between calls): ``gather_for_metrics`` reads its position to drop the padding of an
        epoch's last batch. Read one ``batches()`` iterable at a time, as ``run`` and
        ``evaluate`` do.

        Raises:
            ValueError: data that ``shard_data`` cannot shard (the message says why), or,
                under ``replicate()`` or ``shard_params()`` without ``shard_data()``, ranks
                whose data have different numbers of batches (their gradient collectives
                could never pair up).
                Data of unknown length (an IterableDataset, a generator) is kept in step
                instead: ranks that run out replay their first batch until all are done.
        """
        shard = step.find(ShardData)
        if step.find(Invariant) is not None:
            self._active = blocks.epoch_blocks(data, step, rank=self.rank, world_size=self.world_size, epoch=epoch,
                                               start=start, place=self.place)
            return self._active
        # a transform whose step pairs the ranks' collectives up at every update
        coupling = next((t for t in step.transforms if t.couples_ranks), None) if self.world_size > 1 else None
        data_rank, data_world = self.mesh(step).data_coordinates(self.rank)
        self._active = epoch_batches(
            data, shard, rank=data_rank, world_size=data_world, epoch=epoch, start=start,
            place=self.place, sync=self._sync_ranks if shard is not None or coupling is not None else None,
            data_state=data_state)
        if shard is None and coupling is not None:
            distributed.same_length(self._active.num_batches, coupling.verb, device=self.collective_device)
        return self._active

    def eval_batches(self, data: DataLoader) -> Iterator[Any]:
        """This rank's device-placed batches of ``data``, for an evaluation loop of your own.

        ``af.shard_data()``'s shard of epoch 0, without a training Step: every world-size-th
        sample, padded by wrapping so every rank runs as many batches; ``gather_for_metrics``
        on a batch's outputs drops the padding, so every sample counts once.

        Args:
            data: a DataLoader over a map-style dataset, built with ``batch_size=...`` (its
                collate function, workers and pinning are kept).

        Returns:
            An iterator of batches (the DataLoader's, tensors on ``device``).

        Raises:
            TypeError: ``data`` is not a DataLoader, or one over an IterableDataset, or with
                a sampler other than ``shuffle=False``/``shuffle=True``'s.
            ValueError: a DataLoader without ``batch_size``.

        Example:
            >>> import torch, accelfn as af
            >>> loader = torch.utils.data.DataLoader(torch.arange(5), batch_size=2)
            >>> [b.tolist() for b in af.backends.CPU().eval_batches(loader)]
            [[0, 1], [2, 3], [4]]
        """
        check_eval_loader(data)
        batches = epoch_batches(data, ShardData(), rank=self.rank, world_size=self.world_size, epoch=0,
                                place=self.place)
        return self._evaluating(batches)

    def _evaluating(self, batches: EpochBatches) -> Iterator[Any]:
        previous, self._active = self._active, batches  # gather_for_metrics reads its padding
        try:
            for batch, _ in batches:
                yield batch
        finally:
            self._active = previous

    def reshard(self, model: torch.nn.Module) -> None:
        """Shards again the parameters a sharded model gathered in forwards without a backward
        (``shard_params(reshard_after_forward=False)`` keeps them gathered until a backward);
        nothing for a model that is not sharded. ``af.evaluate`` calls it when it ends; call
        it after running such a model's forward yourself outside training."""
        fsdp.reshard(model)

    def user_code(self, what: str) -> contextlib.AbstractContextManager[None]:
        """The context ``af.run`` and ``af.evaluate`` run the user's code in (loss, hooks,
        ``fn``), named ``what``: when it ends on this rank by an exception or an exit
        (``sys.exit``, ``SystemExit``, ``KeyboardInterrupt``), this rank leaves the process
        group at exit without waiting for ranks that went on (they would wait in their next
        collective until the timeout), unless all of them leave at once; it prints which
        rank left and how."""
        return process_group.user_code(what)

    def lockstep(self, items: Iterator[Any], *, replays: bool = False) -> Iterator[Any]:
        """``items`` kept in step over ranks (one tiny all-reduce per item): while any rank still
        has items, a rank that has run out yields its first item again, and a rank that has no
        item at all yields a copy of the first item of the lowest rank that has one (sent
        once, pickled, with its tensors on the CPU; ``backend.place`` moves them).

        Args:
            items: this rank's items (tensors, or tuples/lists/dicts of them and plain data).
            replays: yield ``(item, replayed)`` pairs, ``replayed`` True for a repeated or
                copied item (whose results to drop).

        Raises:
            RuntimeError: on every rank, when some rank has no item and the first item of the
                rank that would send it cannot be pickled (the error named).
        """
        return self._sync_ranks(items, replays=replays)

    def gather_for_metrics(self, tree: Any) -> Any:
        """``gather`` for evaluation: drops the samples ``shard_data`` added to even out the
        epoch's last batch, so metrics count every sample exactly once.

        The result is in rank order (rank 0's batch, then rank 1's, ...), as Accelerate's is:
        with ``shard_data`` each rank reads every world-size-th sample, so that is not the
        dataset's order. ``af.evaluate`` returns outputs in dataset order.

        Args:
            tree: a tensor (leading dimension: samples) or a tuple/list/dict of them,
                computed from the batch most recently read from the iterable the last
                ``backend.batches(...)`` or ``backend.eval_batches(...)`` call returned (the
                contract: that iterable's position says whether this is the epoch's last batch
                and which ranks padded it).
        """
        active = self._active
        drop = active.padding_ranks if active is not None and active.is_last else frozenset()

        def one(t: torch.Tensor) -> torch.Tensor:
            gathered = self.gather(t)
            if not drop or t.ndim == 0:
                return gathered
            per_rank = t.shape[0]
            keep = [gathered[r * per_rank:(r + 1) * per_rank - (1 if r in drop else 0)]
                    for r in range(self.world_size)]
            return torch.cat(keep)

        return map_tensors(one, tree)

    def place(self, batch: Any) -> Any:
        """``batch`` with every tensor moved to this backend's device (``batch`` itself when
        the backend was built with ``place_batches=False``)."""
        return self._placer(batch)

    def _sync_ranks(self, it: Iterator[Any], *, replays: bool = False) -> Iterator[Any]:
        device = self.collective_device
        return even_out(it, functools.partial(distributed.any_rank, device=device),
                        functools.partial(distributed.first_item, rank=self.rank, device=device), replays=replays)

    @property
    def collective_device(self) -> torch.device:
        """The device tensors must be on for this backend's collectives (gloo: CPU)."""
        return self.device

