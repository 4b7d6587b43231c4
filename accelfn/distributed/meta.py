"""Models built on the meta device: each rank materializes only its own shards.

``with torch.device("meta"): model = Net()`` builds a model whose tensors have shapes but no
storage. ``prepare`` shards or splits it as the program asks (``shard_params``,
``tensor_parallel``: FSDP2 and ``parallelize_module`` both take meta tensors), then fills
each rank's shards here, module by module:

1. ``model.to_empty(device)``: every parameter and buffer gets storage for its local shard
   only (uninitialized).
2. For each module that holds parameters or buffers of its own, in ``named_modules`` order
   (the order a constructor registers them, and so the order a normally built model drew
   their initial values in): full-size plain tensors of those parameters are made on the
   CPU, the module's ``reset_parameters()`` fills them from the global CPU random generator,
   each rank copies its shard out of them (``distribute_tensor(..., src_data_rank=None)``:
   local slicing, no communication), and they are freed. At most one module's full tensors
   exist at a time; no rank ever holds the whole model.

The generator's state is rank 0's (broadcast first), so every rank draws the same stream.

What is exact: the full parameters equal those of ``Net()`` built normally on the CPU after
the same ``torch.manual_seed(s)`` when (a) nothing draws from the global generator between
the seed and ``prepare`` (building on meta draws nothing), and (b) ``Net``'s initialization
is its modules' ``reset_parameters`` in registration order (``nn.Linear``, ``nn.Embedding``,
``nn.LayerNorm``, ``nn.Conv*``, ...). Extra initialization in a constructor (an
``init.normal_`` after building a layer) is not replayed; a module that holds parameters
of its own without a ``reset_parameters`` is refused by name before anything changes. Tied
parameters take the value of their first owner, as ``b.weight = a.weight`` after building
both leaves them (the later owner still draws its values, so the stream stays aligned).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist

from accelfn.distributed.ops import is_dtensor
from accelfn.distributed.phases import ModelPhase
from accelfn.transforms import ShardParams, TensorParallel

if TYPE_CHECKING:
    from accelfn.distributed.phases import Preparation


def is_meta(model: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def check(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, splits: bool) -> None:
    """Raises before anything changes unless ``prepare`` can materialize ``model``, built on the
    meta device: the step must shard or split it (``splits``), its optimizer hold no state yet,
    and every module with tensors of its own be able to reset them.

    Raises:
        ValueError: the step neither shards nor splits the model; the optimizer holds state;
            naming each module (and its class) that holds parameters or buffers of its own
            and has no ``reset_parameters()``.
    """
    if not splits:
        raise ValueError(
            "this state's model is on the meta device (built under `with torch.device('meta')`); prepare "
            "materializes such a model shard by shard for shard_params() or tensor_parallel(), and this step "
            "has neither: add one, or build the model on a real device"
        )
    if optimizer.state:
        raise ValueError("a model on the meta device has no values yet, so its optimizer cannot hold state; "
                         "build the optimizer's state after prepare (af.load restores a checkpoint into it)")
    missing = [f"{name or '<root>'} ({type(m).__name__})" for name, m in model.named_modules()
               if _own(m) and not callable(getattr(m, "reset_parameters", None))]
    if missing:
        raise ValueError(
            f"a model built on the meta device is initialized module by module with each module's "
            f"reset_parameters(), but {', '.join(missing)} hold parameters or buffers of their own and have none; "
            "give those modules a reset_parameters() that initializes them (as nn.Linear has), or build the model "
            "on the CPU"
        )


def _own(module: torch.nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """``(name, tensor, is_parameter)`` for each parameter and buffer ``module`` registers itself."""
    return ([(n, p, True) for n, p in module.named_parameters(recurse=False)]
            + [(n, b, False) for n, b in module.named_buffers(recurse=False) if b is not None])


def _agree_on_generator() -> None:
    """Every rank takes rank 0's CPU generator state (one broadcast), so all draw one stream."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        state = torch.get_rng_state()
        dist.broadcast(state, src=0)
        torch.set_rng_state(state)


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Gives every meta tensor of ``model`` (sharded, split or whole) storage on ``device`` and
    its shard of the values a normally built model would have (see the module docstring).
    Tensors not on meta are left as they are."""
    _agree_on_generator()
    model.to_empty(device=device)
    done: set[int] = set()
    with torch.no_grad():
        for _, module in model.named_modules():
            own = _own(module)
            if not own:
                continue
            for name, t, is_param in own:  # full-size stand-ins on the CPU, for reset_parameters to fill
                full = torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu")
                if is_param:
                    module._parameters[name] = torch.nn.Parameter(full, requires_grad=t.requires_grad)
                else:
                    module._buffers[name] = full
            try:
                module.reset_parameters()  # checked by check()
                values = [(module._parameters[n] if p else module._buffers[n]) for n, _, p in own]
            finally:
                for name, t, is_param in own:
                    if is_param:
                        module._parameters[name] = t  # the model's own Parameter
                    else:
                        module._buffers[name] = t
            for (_, t, _), value in zip(own, values):
                if id(t) in done:  # a tied tensor keeps its first owner's values
                    continue
                done.add(id(t))
                _copy_shard(t, value)


def _copy_shard(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copies this rank's part of ``full`` into ``target`` (a DTensor's local shard, or all of it)."""
    if is_dtensor(target):
        from torch.distributed.tensor import distribute_tensor  # imported: a DTensor exists

        placed = full.to(target.to_local().device)  # a CUDA mesh cuts CUDA tensors (one parameter at a time)
        local = distribute_tensor(placed, target.device_mesh, target.placements, src_data_rank=None).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full)


class Materialize(ModelPhase):
    """The model phase that fills a model built on the meta device, after tensor parallelism and
    sharding split it (each rank fills only its own shards), before it is replicated.

    Refused (before anything changes, :func:`check`) for a program that neither shards nor
    splits the model; a meta model the backend does not place (``place_model=False``) and no
    transform splits is the user's, left as it is.
    """

    name: ClassVar[str] = "materialize"

    def __init__(self, splits: bool):
        self.splits = splits

    @classmethod
    def of(cls, prep: Preparation) -> Materialize | None:
        if not is_meta(prep.state.model):
            return None
        splits = prep.step.find(ShardParams) is not None or prep.step.find(TensorParallel) is not None
        return cls(splits) if splits or prep.hardware.place_model else None

    def check(self, prep: Preparation) -> None:
        check(prep.state.model, prep.state.optimizer, splits=self.splits)

    def apply(self, prep: Preparation) -> None:
        materialize(prep.state.model, prep.hardware.device)
