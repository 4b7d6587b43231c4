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
import pickle
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar, TypeVar

import torch
from torch.utils.data import DataLoader

from accelfn import collectives
from accelfn.backends import (
    _comm_hooks,
    _deepspeed,
    _distributed,
    _fsdp,
    _materialize,
    _pipeline,
    _pipeline_step,
    _tensor_parallel,
)
from accelfn.backends._interpreter import StepFn, step_function
from accelfn.backends._invariant import InvariantStepFn, broadcast_model, check_conditions
from accelfn.backends._placement import (
    check_placement,
    move_module,
    place_on,
    rebind_optimizer,
    unchanged,
)
from accelfn.backends.env import LaunchEnv, with_launch_defaults
from accelfn.collectives import ProcessContext
from accelfn.data import blocks
from accelfn.data.batches import EpochBatches, check_eval_loader, epoch_batches, even_out
from accelfn.data.tree import map_tensors
from accelfn.state import TrainState, require_state
from accelfn.step import Step
from accelfn.transforms import (
    Accumulate,
    Compile,
    Invariant,
    Pipeline,
    Replicate,
    ShardData,
    ShardParams,
    TensorParallel,
    WithPrecision,
)
from accelfn.transforms.deepspeed import DeepSpeed
from accelfn.transforms.precision import Policy, parse_policy

F = TypeVar("F", bound=Callable[..., Any])


class Backend(ProcessContext, abc.ABC):
    """An interpreter of Steps on one kind of hardware, and this process's place in the world.

    Attributes:
        name: ``"cpu"``, ``"cuda"`` or ``"xla"``.
        supported_precisions: the precision policies this backend runs.
        rank, local_rank, world_size, local_world_size: from the launch environment.
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
        super().__init__(rank=env.rank, local_rank=env.local_rank, world_size=env.world_size,
                         local_world_size=env.local_world_size)
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
        return _fsdp.training_forward(torch.autocast(device_type=self.device.type, dtype=policy.compute_dtype))

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

    def check_sharding(self, shard: ShardParams, state: TrainState) -> None:
        """Raises before anything changes if this backend cannot run ``shard`` on ``state``.

        Raises:
            NotImplementedError: this backend has no sharded data parallelism (XLA, or a
                torch without FSDP2), or not with ``shard``'s options (offloading on the CPU
                backend).
        """
        raise NotImplementedError(
            f"the {self.name} backend does not support shard_params(); use replicate() (data "
            "parallel, a full copy of the model per process)"
        )

    def shard_model(self, state: TrainState, shard: ShardParams, policy: Policy) -> None:
        """Shards ``state.model`` in place as ``shard`` asks and points the optimizer at the
        shards (FSDP2 on CPU and CUDA); called after ``check_sharding``."""
        raise NotImplementedError(f"the {self.name} backend does not support shard_params()")

    def check_tensor_parallel(self, tp: TensorParallel, shard: ShardParams | None, model: torch.nn.Module) -> None:
        """Raises before anything changes if this backend cannot run ``tp`` (with ``shard``) on ``model``.

        Raises:
            NotImplementedError: this backend has no tensor parallelism (XLA), or not with
                ``shard``'s options, or ``"auto"`` finds a style it does not map.
            ValueError: the world size is not a multiple of ``tp.size``; ``"auto"`` for a model
                without a plan of its own; a plan pattern that matches no module.
        """
        if self.device.type not in ("cpu", "cuda"):
            raise NotImplementedError(f"the {self.name} backend does not support tensor_parallel(); use the cpu "
                                      "or cuda backend")
        _fsdp.check_available()
        _tensor_parallel.check(tp, shard, self.world_size)
        _tensor_parallel.resolve(tp, model)

    def split_model(self, state: TrainState, tp: TensorParallel, shard: ShardParams | None, policy: Policy) -> None:
        """Splits ``state.model`` in place over the ``"tensor"`` dimension of the world's mesh as
        ``tp`` asks (``parallelize_module``), then, with ``shard``, shards it over the ``"data"``
        dimension (FSDP2; nothing to shard when that dimension has one rank); the optimizer is
        pointed at the new parameters. Called after ``check_tensor_parallel``."""
        mesh = _tensor_parallel.world_mesh(self.device, self.world_size, tp)
        _tensor_parallel.split_model(state.model, state.optimizer, tp, mesh)
        if shard is not None and mesh["data"].size() > 1:
            _fsdp.shard_model(state.model, state.optimizer, shard, policy, mesh["data"], broadcast=False)

    def data_coordinates(self, step: Step) -> tuple[int, int]:
        """``(data rank, data world size)`` of this process under ``step``: its rank and the world
        size, or, under ``tensor_parallel(size=t)``, its place on the mesh's data dimension
        (``rank // t``) and that dimension's size (``world_size // t``): the ranks of one
        tensor-parallel group read the same data.

        Raises:
            ValueError: the world size is not a multiple of the tensor-parallel size.
        """
        split = step.find(TensorParallel) or step.find(Pipeline)
        return (self.rank, self.world_size) if split is None else split.data_coordinates(self.rank, self.world_size)

    def no_sync(self, wrapped: torch.nn.Module) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        """A context factory that suppresses the gradient all-reduce (DDP) or reduce-scatter
        (FSDP2) of non-final micro-batches."""
        if _fsdp.is_sharded(wrapped):
            return functools.partial(_fsdp.no_gradient_sync, wrapped)
        return getattr(wrapped, "no_sync", contextlib.nullcontext)

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Averages gradients across ranks if the wrapper did not (XLA); a no-op for DDP."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of ``tensor`` over all ranks (used for the item counts of ``af.Loss``)."""
        return collectives.reduce(tensor, "sum")

    def peak_memory_bytes(self) -> int | None:
        """The most device memory this process has held so far, in bytes, or None where the
        device has no allocator statistics (CPU: the process's RSS is reported instead)."""
        return None

    # -- the generic part ----------------------------------------------------------------

    def prepare(self, step: Step, state: TrainState) -> tuple[TrainState, StepFn]:
        """Places the state on this backend's device and specializes ``step`` for it.

        Adds the transforms ``accelfn launch`` asked for (``--precision``, ``--accumulate``,
        ``--compile``) where the program has none of their kind, moves the model (and any
        optimizer state) to ``self.device``, casts parameters for a true low-precision
        policy, adds each transform's entry to ``transforms_state``, wraps the model as
        ``replicate`` asks (DDP) or shards it in place as ``shard_params`` asks (FSDP2: the
        same module object, its parameters replaced by DTensor shards and the optimizer
        pointed at them), compiles it as ``compile`` asks, and returns the step function,
        whose ``step`` attribute is the program it runs.

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
                its ``compile``, or its ``shard_params`` (XLA; offloading on the CPU backend),
                or its ``invariant`` (XLA).
            ValueError: a sharded model (prepared with ``shard_params``) with a step without it.
            TransformError: under ``invariant()``, a batch-coupled layer (BatchNorm, ...),
                named, before anything is placed.

        Under ``invariant()`` the model is not wrapped in DDP: rank 0's parameters and
        buffers are broadcast once, and a RuntimeWarning says when a condition of the
        guarantee is not met (ranks with different thread counts; CUDA without
        deterministic algorithms).
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
        policy = self.precision(step)
        self.check_precision(policy)
        ds = step.find(DeepSpeed)
        if ds is not None:  # the engine places, wraps and partitions the model itself
            return _deepspeed.prepare(self, step, state, policy, ds)
        pp = step.find(Pipeline)
        if pp is not None:  # the model is cut into stages, each rank keeping its own
            return _pipeline_step.prepare(self, step, state, policy, pp)
        compiled = step.find(Compile)
        if compiled is not None:
            self.check_compile(compiled)
        shard = step.find(ShardParams)
        invariant = step.find(Invariant)
        if invariant is not None:  # refused before anything is placed
            self.check_invariant(invariant)
            invariant.init(state)
        already_sharded = _fsdp.is_sharded(state.model)
        if already_sharded and shard is None:
            raise ValueError(
                "this state's model is sharded (it was prepared with shard_params()), so its step "
                "must include af.shard_params() too"
            )
        if already_sharded and shard is not None:
            _fsdp.check_same_layout(state.model, shard)
            _fsdp.refresh_precision(state.model)  # requires_grad may have changed since (pytorch#186998)
        tp = step.find(TensorParallel)
        # a meta model is materialized for shard_params/tensor_parallel; without them and without
        # placement (place_model=False) it is the user's, left where it is
        on_meta = _materialize.is_meta(state.model) and (shard is not None or tp is not None or self.place_model)
        if on_meta:
            _materialize.check(state.model, state.optimizer, splits=shard is not None or tp is not None)
        already_split = _tensor_parallel.split_with(state.model) is not None
        _tensor_parallel.check_same_split(state.model, tp)
        if tp is not None and not already_split:
            self.check_tensor_parallel(tp, shard, state.model)
        if shard is not None and not already_sharded:
            self.check_sharding(shard, state)
            if tp is None:
                _fsdp.check_group_size(self, shard)
        if not already_sharded and not already_split and not on_meta:  # placed when sharded (offloaded shards stay)
            self._place_state(state, policy)
        for transform in step.transforms:
            state = transform.init(state)
        if tp is not None and not already_split:
            self.split_model(state, tp, shard, policy)
            if shard is not None:
                _fsdp.remember_layout(state.model, shard)
        elif shard is not None and not already_sharded and (self.world_size > 1 or shard.offload):
            self.shard_model(state, shard, policy)
            _fsdp.remember_layout(state.model, shard)
        if on_meta:  # each rank fills its own shards, module by module
            _materialize.materialize(state.model, self.device)
        replicate = step.find(Replicate)
        if self.world_size > 1 and (replicate is not None or shard is not None):
            collectives.mark_replicas(state.model)  # one model: its buffers are rank 0's where it is read
        if invariant is not None:  # no DDP: the canonical sum replaces its all-reduce
            check_conditions(self)
            if self.world_size > 1:
                if not _fsdp.is_sharded(state.model):  # shard_model broadcast before sharding
                    broadcast_model(state.model)
                collectives.mark_replicas(state.model)
            model = state.model
        else:
            model = self.wrap_model(state.model, replicate) if replicate is not None else state.model
        state = _comm_hooks.attach(state, model, self.device)  # a PowerSGD hook's state: in the TrainState
        if compiled is not None:  # after DDP's wrapper, as PyTorch's DDP guidance asks
            model = self.compile_model(model, compiled)
        if invariant is not None:
            return state, InvariantStepFn(self, step, state, model)
        return state, step_function(self, step, state, model)

    def check_invariant(self, spec: Invariant) -> None:
        """Raises NotImplementedError if this backend cannot run ``invariant()`` (before
        anything is placed)."""

    def check_compile(self, spec: Compile) -> None:
        """Raises NotImplementedError if this backend cannot run ``compile`` (before anything
        is placed)."""

    def compile_model(self, model: torch.nn.Module, spec: Compile) -> torch.nn.Module:
        """``model`` (already wrapped for ``replicate``) through ``torch.compile`` with
        ``spec``'s options; the module itself is left as it is."""
        return torch.compile(model, **spec.torch_compile_kwargs())  # type: ignore[return-value]

    def _place_state(self, state: TrainState, policy: Policy) -> None:
        model, optimizer = state.model, state.optimizer
        dtype = policy.param_dtype if policy.param_dtype != torch.float32 else None
        device = self.device if self.place_model else None  # None: cast where it is
        rebind_optimizer(optimizer, move_module(model, device, dtype))
        if optimizer.state:  # re-cast existing moments to the parameters' device and dtype
            optimizer.load_state_dict(optimizer.state_dict())

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
            self._active = self._blocks(data, step, epoch, start)
            return self._active
        parallel = ((step.find(Replicate) or step.find(ShardParams) or step.find(TensorParallel)
                     or step.find(Pipeline) or step.find(DeepSpeed))
                    if self.world_size > 1 else None)
        replicated = parallel is not None
        data_rank, data_world = self.data_coordinates(step)
        self._active = epoch_batches(
            data, shard, rank=data_rank, world_size=data_world, epoch=epoch, start=start,
            place=self.place, sync=self._sync_ranks if shard is not None or replicated else None, data_state=data_state)
        if shard is None and parallel is not None:
            self._check_same_length(self._active.num_batches, parallel.verb)
        return self._active

    def _blocks(self, data: Iterable[Any], step: Step, epoch: int, start: int) -> EpochBatches:
        """This rank's blocks of micro-batches under ``invariant()`` (``data.blocks``)."""
        shard, accumulate = step.find(ShardData), step.find(Accumulate)
        n = accumulate.num_micro_batches if accumulate is not None else 1
        total = blocks.num_batches(data, world_size=self.world_size, num_micro_batches=n)  # type: ignore[arg-type]  # checked there
        loader = blocks.block_loader(data, seed=shard.seed if shard is not None else 0, rank=self.rank,  # type: ignore[arg-type]  # as above
                                     world_size=self.world_size, num_micro_batches=n, epoch=epoch, start=start)
        return EpochBatches(loader, num_batches=total, start=start, place=self.place)

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

    def _check_same_length(self, num_batches: int | None, verb: str) -> None:
        """One collective: every rank must have the same number of batches (or all unknown)."""
        (shortest,), (longest,) = collectives.extremes([-1 if num_batches is None else num_batches],
                                                       device=self.collective_device)
        if longest != shortest:
            raise ValueError(
                f"under {verb}() every rank must run the same number of micro-batches, but the "
                f"ranks' data have between {shortest} and {longest} batches per epoch (-1: unknown); "
                "add af.shard_data() to split one dataset evenly over the ranks"
            )

    def reshard(self, model: torch.nn.Module) -> None:
        """Shards again the parameters a sharded model gathered in forwards without a backward
        (``shard_params(reshard_after_forward=False)`` keeps them gathered until a backward);
        nothing for a model that is not sharded. ``af.evaluate`` calls it when it ends; call
        it after running such a model's forward yourself outside training."""
        if _fsdp.is_sharded(model):
            _fsdp.reshard(model)

    def forward_is_collective(self, model: torch.nn.Module) -> bool:
        """True when every rank must run each forward of ``model`` together (a model sharded
        over several ranks all-gathers its parameters in the forward; a tensor-parallel one
        all-reduces its row-wise layers' outputs)."""
        return self.world_size > 1 and (_fsdp.is_sharded(model) or _tensor_parallel.split_with(model) is not None
                                       or _pipeline.cut_with(model) is not None
                                       or _deepspeed.partitions_parameters(model))

    def model_data_coordinates(self, model: torch.nn.Module) -> tuple[int, int, bool]:
        """``(data rank, data world size, leads)`` for running ``model`` outside a Step (``af.evaluate``):
        under a ``tensor_parallel`` split, the ranks of one group read the same data and only
        the first of them (``leads``) reports the outputs; else ``(rank, world_size, True)``.

        Under a ``pipeline`` cut, the ranks of one pipeline read the same data, its first reports.
        """
        pp = _pipeline.cut_with(model)
        if pp is not None:
            return (*pp.data_coordinates(self.rank, self.world_size), pp.stage_of(self.rank, self.world_size) == 0)
        tp = _tensor_parallel.split_with(model)
        if tp is None:
            return self.rank, self.world_size, True
        data_rank, data_world = tp.data_coordinates(self.rank, self.world_size)
        return data_rank, data_world, self.rank % tp.size == 0

    def user_code(self, what: str) -> contextlib.AbstractContextManager[None]:
        """The context ``af.run`` and ``af.evaluate`` run the user's code in (loss, hooks,
        ``fn``), named ``what``: when it ends on this rank by an exception or an exit
        (``sys.exit``, ``SystemExit``, ``KeyboardInterrupt``), this rank leaves the process
        group at exit without waiting for ranks that went on (they would wait in their next
        collective until the timeout), unless all of them leave at once; it prints which
        rank left and how."""
        return _distributed.user_code(what)

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
        return even_out(it, functools.partial(collectives.any_rank, device=self.collective_device),
                        self._first_item, replays=replays)

    def _first_item(self, item: Any, present: bool) -> tuple[bool, Any]:
        """The first round of ``lockstep``: whether any rank has an item, and the item this
        rank starts from: its own, or, when it has none, the lowest such rank's (a copy)."""
        (lowest,), (highest,) = collectives.extremes([int(present)], device=self.collective_device)
        if not highest or lowest:  # nobody has one, or everybody does: one all-reduce
            return bool(highest), item
        src = collectives.exchange(present, device=self.collective_device).index(True)
        payload, message = None, None
        if self.rank == src:
            try:
                payload = map_tensors(lambda t: t.detach().cpu(), item)
                pickle.dumps(payload)
            except Exception as e:  # noqa: BLE001  # told to every rank below
                message = (f"rank {src}'s first item must be sent to the ranks that have none, but it cannot be "
                           f"pickled ({type(e).__name__}: {e}); give every rank at least one item")
        failed = collectives.failures(message, device=self.collective_device)
        if failed:
            raise RuntimeError(failed[0])
        sent = collectives.broadcast_object(payload, src)
        return True, item if present else sent

    @property
    def collective_device(self) -> torch.device:
        """The device tensors must be on for this backend's collectives (gloo: CPU)."""
        return self.device

