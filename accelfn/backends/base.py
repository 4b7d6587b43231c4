"""The backend protocol: a process context plus the primitives the interpreter needs.

A backend interprets Steps for one kind of hardware. This base class holds everything
generic — preparing a program, the epoch's batches, the collectives — and each backend
(``cpu.py``, ``cuda.py``, ``xla.py``) overrides only its primitives: the device, autocast,
how the model is replicated and gradients reduced, and XLA's graph cut.
"""

from __future__ import annotations

import abc
import builtins
import contextlib
import functools
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar, TypeVar

import torch

from accelfn import collectives
from accelfn.backends._env import LaunchEnv
from accelfn.backends._interpreter import StepFn, step_function
from accelfn.backends._placement import place_on
from accelfn.data._tree import map_tensors
from accelfn.data.batches import EpochBatches, epoch_batches, even_out
from accelfn.state import TrainState
from accelfn.step import Step
from accelfn.transforms import Replicate, ShardData, WithPrecision, with_precision
from accelfn.transforms.precision import Policy, parse_policy

F = TypeVar("F", bound=Callable[..., Any])


class Backend(abc.ABC):
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

    def __init__(self, env: LaunchEnv, device: torch.device):
        self.env = env
        self.rank = env.rank
        self.local_rank = env.local_rank
        self.world_size = env.world_size
        self.local_world_size = env.local_world_size
        self.device = device
        self._active: EpochBatches | None = None
        self._placer = place_on(device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, device={self.device})"

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        """True on local rank 0 (one process per node)."""
        return self.local_rank == 0

    # -- primitives a backend may override ---------------------------------------------

    def autocast(self, policy: Policy) -> contextlib.AbstractContextManager[Any]:
        """The context the forward runs in under a mixed-precision policy."""
        return torch.autocast(device_type=self.device.type, dtype=policy.compute_dtype)

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
        """A context factory that suppresses the gradient all-reduce of non-final micro-batches."""
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

    def inference_mode(self) -> contextlib.AbstractContextManager[Any]:
        """The context ``evaluate`` runs the model in (``torch.inference_mode``)."""
        return torch.inference_mode()

    # -- the generic part ----------------------------------------------------------------

    def prepare(self, step: Step, state: TrainState) -> tuple[TrainState, StepFn]:
        """Places the state on this backend's device and specializes ``step`` for it.

        Moves the model (and any optimizer state) to ``self.device``, casts parameters for
        a true low-precision policy, adds each transform's entry to ``transforms_state``,
        wraps the model as ``replicate`` asks, and returns the step function.

        Args:
            step: the program.
            state: the state to train; its model and optimizer are modified in place.

        Returns:
            (state, step_fn): the placed state and ``step_fn(state, batch, *, flush=False)
            -> (state, metrics)``.

        Raises:
            TypeError: ``step`` is not a Step or ``state`` not a TrainState.
            NotImplementedError: this backend cannot run the program's precision policy.
        """
        if not isinstance(step, Step):
            raise TypeError(f"prepare() takes a Step (af.train_step(loss_fn)), got {type(step).__name__}")
        if not isinstance(state, TrainState):
            raise TypeError(f"prepare() takes a TrainState (af.TrainState.create), got {type(state).__name__}")
        step = self._with_launch_precision(step)
        precision = step.find(WithPrecision)
        policy = precision.policy if precision is not None else parse_policy("fp32")
        self.check_precision(policy)
        self._place_state(state, policy)
        for transform in step.transforms:
            state = transform.init(state)
        replicate = step.find(Replicate)
        model = self.wrap_model(state.model, replicate) if replicate is not None else state.model
        return state, step_function(self, step, state, model)

    def _with_launch_precision(self, step: Step) -> Step:
        requested = self.env.precision
        if requested is None:
            return step
        present = step.find(WithPrecision)
        if present is None:
            return with_precision(requested)(step)
        if present.policy.name != requested:
            warnings.warn(
                f"accelfn launch --precision {requested} is overridden by the script's "
                f"with_precision({present.policy.name!r})",
                stacklevel=3,
            )
        return step

    def _place_state(self, state: TrainState, policy: Policy) -> None:
        model, optimizer = state.model, state.optimizer
        dtype = policy.param_dtype if policy.param_dtype != torch.float32 else None
        _rebind_optimizer(optimizer, _move_module(model, self.device, dtype))
        if optimizer.state:  # re-cast existing moments to the parameters' device and dtype
            optimizer.load_state_dict(optimizer.state_dict())

    def batches(self, data: Iterable[Any], step: Step, epoch: int, *, start: int = 0) -> EpochBatches:
        """This rank's device-placed micro-batches of ``epoch``, as ``(batch, is_last)`` pairs.

        Args:
            data: a DataLoader or any iterable of batches.
            step: the program (its ``shard_data``, if any, shards the data).
            epoch: the epoch, which seeds the shuffle.
            start: micro-batches of this epoch already consumed (skipped).

        Raises:
            ValueError: data that ``shard_data`` cannot shard (the message says why), or,
                under ``replicate()`` without ``shard_data()``, ranks whose data have
                different numbers of batches (their gradient all-reduces could never pair up).
                Data of unknown length (an IterableDataset, a generator) is kept in step
                instead: ranks that run out replay their first batch until all are done.
        """
        shard = step.find(ShardData)
        replicated = self.world_size > 1 and step.find(Replicate) is not None
        self._active = epoch_batches(
            data, shard, rank=self.rank, world_size=self.world_size, epoch=epoch, start=start,
            place=self.place, sync=self._sync_ranks if shard is not None or replicated else None,
        )
        if shard is None and replicated:
            self._check_same_length(self._active.num_batches)
        return self._active

    def _check_same_length(self, num_batches: int | None) -> None:
        """One collective: every rank must have the same number of batches (or all unknown)."""
        n = -1 if num_batches is None else num_batches
        t = torch.tensor([n, -n], dtype=torch.int64, device=self.collective_device)
        longest, shortest = (int(v) for v in collectives.reduce(t, "max").tolist())
        shortest = -shortest
        if longest != shortest:
            raise ValueError(
                f"under replicate() every rank must run the same number of micro-batches, but the "
                f"ranks' data have between {shortest} and {longest} batches per epoch (-1: unknown); "
                "add af.shard_data() to split one dataset evenly over the ranks"
            )

    def place(self, batch: Any) -> Any:
        """``batch`` with every tensor moved to this backend's device."""
        return self._placer(batch)

    def _sync_ranks(self, it: Iterator[Any]) -> Iterator[Any]:
        def all_reduce_max(values: list[int]) -> list[int]:
            t = torch.tensor(values, dtype=torch.int64, device=self.collective_device)
            return [int(v) for v in collectives.reduce(t, "max").tolist()]

        return even_out(it, all_reduce_max)

    @property
    def collective_device(self) -> torch.device:
        """The device tensors must be on for this backend's collectives (gloo: CPU)."""
        return self.device

    # -- collectives -----------------------------------------------------------------------

    def barrier(self) -> None:
        """Waits until every rank reaches this call."""
        collectives.barrier()

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0 in rank order (sizes may differ)."""
        return collectives.gather(tensor.to(self.collective_device))

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order."""
        return collectives.gather_object(obj)

    def gather_for_metrics(self, tree: Any) -> Any:
        """``gather`` for evaluation: drops the samples ``shard_data`` added to even out the
        epoch's last batch, so metrics count every sample exactly once.

        The result is in rank order (rank 0's batch, then rank 1's, ...), as Accelerate's is:
        with ``shard_data`` each rank reads every world-size-th sample, so that is not the
        dataset's order. ``af.evaluate`` returns outputs in dataset order.

        Args:
            tree: a tensor (leading dimension: samples) or a tuple/list/dict of them,
                computed from the batch most recently read from ``backend.batches``.
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

    def reduce(self, tensor: torch.Tensor, op: collectives.ReduceOp = "mean") -> torch.Tensor:
        """``tensor`` reduced over ranks with ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``."""
        return collectives.reduce(tensor.to(self.collective_device), op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``tensor`` on every rank."""
        return collectives.broadcast(tensor.to(self.collective_device), src)

    def pad_across_processes(self, tensor: torch.Tensor, *, dim: int = 0, pad_index: float = 0,
                             pad_first: bool = False) -> torch.Tensor:
        """``tensor`` padded along ``dim`` to the largest size over ranks."""
        return collectives.pad_across_processes(tensor.to(self.collective_device), dim=dim,
                                                pad_index=pad_index, pad_first=pad_first)

    def split_between_processes(self, inputs: Any) -> Any:
        """This rank's contiguous part of a sequence, tensor or dict of them."""
        return collectives.split_between_processes(inputs, rank_=self.rank, world_size_=self.world_size)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            builtins.print(*args, **kwargs)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Runs the block on the main process first, then on the others (downloads, caches)."""
        if not self.is_main_process:
            self.barrier()
        yield
        if self.is_main_process:
            self.barrier()

    def on_main_process(self, fn: F) -> F:
        """Decorator: ``fn`` runs on the main process only (returns None elsewhere)."""
        return self._only_if(fn, self.is_main_process)

    def on_local_main_process(self, fn: F) -> F:
        """Decorator: ``fn`` runs on each node's local main process only."""
        return self._only_if(fn, self.is_local_main_process)

    @staticmethod
    def _only_if(fn: F, condition: bool) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs) if condition else None

        return wrapper  # type: ignore[return-value]  # functools.wraps keeps fn's signature


def _move_module(model: torch.nn.Module, device: torch.device,
                 dtype: torch.dtype | None) -> dict[int, torch.nn.Parameter]:
    """Moves ``model`` to ``device`` (and ``dtype``) in place; returns {id(old): new} for the
    parameters the move replaced.

    ``Module.to`` keeps each Parameter object when the new tensor can share its type (CPU to
    CUDA) but makes new ones otherwise (CPU to XLA); tied parameters are then tied again.
    """
    owners = [(m, name, p) for m in model.modules() for name, p in m._parameters.items() if p is not None]
    model.to(device)
    if dtype is not None:
        model.to(dtype)
    moved: dict[int, torch.nn.Parameter] = {}
    for module, name, old in owners:
        new = module._parameters[name]
        assert new is not None, "model.to() keeps every parameter"
        if new is not old:
            module._parameters[name] = moved.setdefault(id(old), new)
    return moved


def _rebind_optimizer(optimizer: torch.optim.Optimizer, moved: dict[int, torch.nn.Parameter]) -> None:
    """Points ``optimizer``'s param groups and state at the parameters that replaced theirs."""
    if not moved:
        return
    for group in optimizer.param_groups:
        group["params"] = [moved.get(id(p), p) for p in group["params"]]
    optimizer.state = defaultdict(dict, {moved.get(id(p), p): v for p, v in optimizer.state.items()})
