"""The XLA backend: torch_xla on a PJRT device (TPU, GPU plugin, or the host CPU).

torch_xla traces operations lazily and compiles each distinct graph once; the backend
cuts the graph after every micro-batch (``torch_xla.sync()``) so that each micro-batch is
one execution of a cached program, feeds batches through torch_xla's ``ParallelLoader``
(host-to-device copies on a background thread), reduces gradients with ``xm.all_reduce``
inside the graph, and never reads a tensor on the host in the hot loop: metrics stay on
the device until ``run`` logs them.

References:
    PyTorch/XLA, "PJRT runtime" and "Multi-process training" (pytorch.org/xla).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from accelfn.backends._placement import check_placement
from accelfn.backends.base import Backend
from accelfn.data.batches import EpochBatches, epoch_batches
from accelfn.data.tree import map_tensors
from accelfn.distributed.env import LaunchEnv
from accelfn.errors import LaunchError
from accelfn.step import Step
from accelfn.transforms import Replicate, ShardData
from accelfn.transforms.precision import Policy

# torch_xla's autocast casts to bfloat16 only on these (torch_xla.amp.autocast)
_BF16_ONLY_HARDWARE = ("TPU", "NEURON")


def _torch_xla() -> tuple[Any, Any]:
    """``(torch_xla, torch_xla.core.xla_model)``, or an ImportError saying how to install them."""
    try:
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.distributed.xla_backend  # noqa: F401 - registers the "xla" process group
    except ImportError as error:
        version = torch.__version__.split("+")[0]
        raise ImportError(
            f"af.backends.XLA() needs torch_xla, which could not be imported ({error}). Install "
            f"the release matching torch {version}: pip install 'torch_xla=={version}' (then set "
            "PJRT_DEVICE=TPU, or PJRT_DEVICE=CPU to run on the host CPU); or use "
            "af.backends.CPU() / af.backends.auto()"
        ) from error
    return torch_xla, xm


class XLA(Backend):
    """Runs on this process's XLA device (``torch_xla.device()``), on PJRT.

    One process drives one XLA device. With ``WORLD_SIZE > 1`` (``accelfn launch --backend
    xla``) the process joins torch_xla's ``"xla"`` process group, whose world is PJRT's;
    ``replicate()`` then all-reduces gradients with ``xm.all_reduce`` before unscaling and
    clipping. ``shard_data()`` feeds batches through ``torch_xla``'s ``ParallelLoader``.
    ``with_precision("bf16")`` runs the forward under ``torch.autocast("xla", bfloat16)``,
    which is what ``torch_xla.amp.autocast`` does on TPU.

    Other collectives go through ``torch.distributed`` on the ``"xla"`` group, with tensors on
    the XLA device.

    Args:
        env: the launch environment; by default read from the process environment.
        place_model: move the model to this backend's device in ``prepare`` (False: leave
            it where it is, e.g. split over devices by hand).
        place_batches: move each batch to the device as it is read (False: leave batches
            as the DataLoader made them).

    Attributes:
        hardware: the PJRT device kind, ``"CPU"``, ``"TPU"``, ``"CUDA"``, ...

    Raises:
        TypeError: a placement option that is not a bool.
        ImportError: torch_xla is not installed (the message gives the pip command).
        LaunchError: an inconsistent launch environment, or a multi-process launch that the
            PJRT runtime does not see as one world (PJRT's CPU client has no collectives
            across processes: every process is a world of one).
        RuntimeError: this process ran a backward pass before the XLA runtime started, so
            autograd cannot use the XLA device (create the backend first).

    Example:
        >>> import accelfn as af  # doctest: +SKIP
        >>> backend = af.backends.XLA()  # doctest: +SKIP
        >>> backend.device.type  # doctest: +SKIP
        'xla'
    """

    name: ClassVar[str] = "xla"
    supported_precisions: ClassVar[tuple[str, ...]] = ("fp32", "bf16", "fp16", "bf16-true")

    def __init__(self, env: LaunchEnv | None = None, *, place_model: bool = True, place_batches: bool = True):
        check_placement("XLA", place_model=place_model, place_batches=place_batches)  # before any state changes
        env = LaunchEnv.from_env() if env is None else env
        torch_xla, xm = _torch_xla()
        if env.world_size > 1:
            _join_process_group(env)
        device = torch_xla.device()
        _check_autograd(device)
        super().__init__(env, device, place_model=place_model, place_batches=place_batches)
        self._xm = xm
        self.hardware: str = xm.xla_device_hw(device)
        self.graph_cut = torch_xla.sync

    # -- primitives ------------------------------------------------------------------------

    def check_precision(self, policy: Policy) -> None:
        """Raises NotImplementedError for a policy this XLA device cannot run.

        ``fp16`` needs float16 autocast and dynamic loss scaling, which torch_xla supports
        on its CPU and GPU devices but not on TPU or Neuron, whose autocast is bfloat16 only.
        """
        super().check_precision(policy)
        if policy.compute_dtype == torch.float16 and self.hardware in _BF16_ONLY_HARDWARE:
            raise NotImplementedError(
                f"with_precision({policy.name!r}) is not supported on XLA:{self.hardware}, "
                "whose autocast casts to bfloat16 only; use with_precision('bf16')"
            )

    #: the model phases XLA does not run, and why
    refusals: ClassVar[Mapping[str, str]] = {
        # XLA's compiler sees the recomputed forward as a copy of the first and folds it away
        "checkpoint_activations": "the xla backend does not support checkpoint_activations(): XLA's compiler folds "
                                  "a recomputed forward into the first one (common subexpressions), keeping the "
                                  "activations after all; checkpoint with torch_xla.utils.checkpoint.checkpoint "
                                  "(optimization barriers) in the model's forward instead",
        # torch_xla traces every step into an XLA graph and compiles it already
        "compile": "the xla backend does not support compile(): torch_xla already compiles each step into an XLA "
                   "graph; remove af.compile() (or accelfn launch --compile) for XLA",
        # the canonical sum's point-to-point exchanges and the per-micro-batch generator keys are
        # written for gloo/NCCL and torch's CPU/CUDA RNG
        "invariant": "the xla backend does not support invariant() (its tree of point-to-point exchanges runs over "
                     "gloo and NCCL, its per-micro-batch RNG keys on torch's CPU and CUDA generators); use the cpu "
                     "or cuda backend, or drop af.invariant() on XLA",
        "shard_params": "the xla backend does not support shard_params() (FSDP2 runs on CPU and CUDA only); use "
                        "replicate() for data parallelism on XLA, or shard with torch_xla's own SPMD FSDPv2 "
                        "(torch_xla.experimental.spmd_fully_sharded_data_parallel) outside accelfn",
    }

    def check_replicate(self, replicate: Replicate) -> None:
        """Raises NotImplementedError for ``replicate(comm_hook=...)``: DDP's hooks need DDP (CPU, CUDA)."""
        if replicate.comm_hook is not None:
            raise NotImplementedError(
                "replicate(comm_hook=...) registers a DDP communication hook, and the XLA backend reduces "
                "gradients with torch_xla's all-reduce, not DDP; leave comm_hook out on XLA (CPU and CUDA take it)")

    def wrap_model(self, model: torch.nn.Module, replicate: Replicate) -> torch.nn.Module:
        """The model itself: XLA replicates without a wrapper.

        With more than one rank, rank 0's parameters and buffers are broadcast first
        (``xm.broadcast_master_param``) so that replicas start equal, as under DDP.
        """
        if self.world_size > 1:
            self._xm.broadcast_master_param(model)
        return model

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Averages gradients over ranks in place: one ``xm.all_reduce`` in the graph."""
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            self._xm.all_reduce(self._xm.REDUCE_SUM, grads, scale=1.0 / self.world_size)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of ``tensor`` over ranks, computed in the graph (no host synchronization)."""
        return self._xm.all_reduce(self._xm.REDUCE_SUM, tensor)

    # -- data ------------------------------------------------------------------------------

    def batches(self, data: Iterable[Any], step: Step, epoch: int, *, start: int = 0,
                data_state: Any = None) -> EpochBatches:
        """This rank's micro-batches of ``epoch`` on the XLA device, as ``(batch, is_last)``.

        Under ``shard_data()`` the host batches go through ``torch_xla``'s ``ParallelLoader``,
        which copies them to the device on a background thread ahead of the step. Data of
        unknown length over several ranks is placed on the main thread instead, because
        keeping ranks in step costs a collective per batch.

        Args:
            data: a DataLoader or any iterable of batches.
            step: the program (its ``shard_data``, if any, shards the data).
            epoch: the epoch, which seeds the shuffle.
            start: micro-batches of this epoch already consumed (skipped).
            data_state: a stream's readers' saved state at ``start`` (as ``Backend.batches``);
                such a stream is placed on the main thread, so that its readers' state is
                taken after exactly the batches the step consumed.

        Raises:
            ValueError: data that ``shard_data`` cannot shard (the message says why).
        """
        shard = step.find(ShardData)
        if shard is None or not self.place_batches:
            return super().batches(data, step, epoch, start=start, data_state=data_state)
        host = epoch_batches(data, shard, rank=self.rank, world_size=self.world_size, epoch=epoch, start=start,
                             sync=self._sync_ranks, data_state=data_state)
        if host.num_batches is None and self.world_size > 1 or host.readers is not None:
            return super().batches(data, step, epoch, start=start, data_state=data_state)
        self._active = EpochBatches(_ParallelLoad(host, self.device), num_batches=host.num_batches,
                                    start=host.start, place=_unchanged, padding_ranks=host.padding_ranks)
        return self._active

    # -- the collective the "xla" process group lacks -------------------------------------

    def peak_memory_bytes(self) -> int | None:
        """The XLA runtime's peak memory use on this device (``xm.get_memory_info``:
        ``peak_bytes_used``, or ``bytes_used`` where the runtime reports no peak), or None."""
        _, xm = _torch_xla()
        try:
            info = xm.get_memory_info(self.device)
        except (RuntimeError, NotImplementedError):  # a runtime without memory statistics (PJRT CPU)
            return None
        peak = info.get("peak_bytes_used", info.get("bytes_used"))
        return None if peak is None else int(peak)

    def barrier(self) -> None:
        """Waits until every rank reaches this call (``xm.rendezvous``; the ``"xla"`` process
        group's own barrier returns at once)."""
        if self.world_size > 1:
            self._xm.rendezvous("accelfn.barrier")


def _join_process_group(env: LaunchEnv) -> None:
    """Joins torch_xla's ``"xla"`` process group and checks that PJRT sees the same world.

    Raises:
        LaunchError: the PJRT runtime's world differs from the launch environment's.
    """
    if not dist.is_initialized():
        dist.init_process_group("xla", init_method="xla://", timeout=datetime.timedelta(seconds=env.timeout_s))
    size, rank = dist.get_world_size(), dist.get_rank()
    if (size, rank) != (env.world_size, env.rank):
        dist.destroy_process_group()
        raise LaunchError(
            f"accelfn launched {env.world_size} XLA processes (this is rank {env.rank}), but the "
            f"PJRT runtime sees a world of {size} with this process as rank {rank}. PJRT's CPU "
            "client (PJRT_DEVICE=CPU) has no collectives across processes, so every process "
            "is a world of one. Run one process (python train.py), or train on several CPU "
            "processes with the CPU backend (accelfn launch --backend cpu)"
        )


def _check_autograd(device: torch.device) -> None:
    """Raises RuntimeError if autograd cannot run on ``device`` in this process.

    The autograd engine sizes its per-device queues at the process's first backward pass;
    an XLA runtime started after that is invisible to it, and every backward on the XLA
    device fails with an internal assertion. A backward of one element finds out now.
    """
    try:
        with torch.inference_mode(False), torch.enable_grad():
            probe = torch.zeros((), device=device, requires_grad=True)
            (probe * 1.0).backward()
    except RuntimeError as error:
        if "device_ready_queues_" not in str(error):
            raise
        raise RuntimeError(
            "autograd cannot run on the XLA device: this process ran a backward pass before "
            "torch_xla's runtime started, and PyTorch's autograd engine then only knows the "
            "devices it saw. Create af.backends.XLA() (or af.backends.auto()) before the first "
            "backward pass of the process, e.g. at the top of the script"
        ) from error


def _unchanged(batch: Any) -> Any:
    return batch


class _ParallelLoad:
    """Iterating yields ``host``'s batches on ``device``, copied ahead by torch_xla's
    ``ParallelLoader`` (whose threads stop when the iteration ends or is abandoned).

    The loader copies each batch's tensors as a flat list next to an opaque skeleton of the
    batch, which is refilled here: torch_xla's own traversal would turn tuples and named
    tuples into lists.
    """

    def __init__(self, host: EpochBatches, device: torch.device):
        self._host, self._device = host, device

    def __iter__(self) -> Iterator[Any]:
        from torch_xla.distributed.parallel_loader import ParallelLoader

        loader = ParallelLoader(_Flattened(self._host), [self._device])
        try:
            for tensors, skeleton in loader.per_device_loader(self._device):
                yield skeleton.refill(tensors, self._device)
        finally:
            loader.close()


class _Skeleton:
    """A host batch that torch_xla leaves alone (no ``__dict__``, not a container)."""

    __slots__ = ("batch",)

    def __init__(self, batch: Any):
        self.batch = batch

    def refill(self, tensors: list[torch.Tensor], device: torch.device) -> Any:
        """The batch with its tensors, in traversal order, replaced by ``tensors`` on ``device``."""
        moved = iter(tensors)
        return map_tensors(lambda _: next(moved).to(device), self.batch)


class _Flattened:
    """The batches of an ``EpochBatches`` as ``[tensors, skeleton]``, without ``is_last``."""

    def __init__(self, pairs: EpochBatches):
        self._pairs = pairs

    def __iter__(self) -> Iterator[list[Any]]:
        for batch, _ in self._pairs:
            tensors: list[torch.Tensor] = []
            map_tensors(tensors.append, batch)
            yield [tensors, _Skeleton(batch)]

    def __len__(self) -> int:
        return len(self._pairs)
