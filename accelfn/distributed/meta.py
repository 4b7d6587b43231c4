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
   CPU (floating-point ones filled with NaN), the module's initializer fills them from the
   global CPU random generator, each rank copies its shard out of them
   (``distribute_tensor(..., src_data_rank=None)``: local slicing, no communication), and
   they are freed. At most one module's full tensors exist at a time; no rank ever holds the
   whole model. A module's initializer is its ``reset_parameters()``; inside a transformers
   model (``PreTrainedModel``) it is that model's own ``_init_weights(module)``, what its
   ``post_init`` applies to every module: norms filled with ones, linear and embedding weights
   drawn from ``normal(0, initializer_range)``, and non-persistent buffers such as a rotary
   embedding's ``inv_freq`` computed again from the config. A value left NaN (an initializer
   that does not fill a tensor its module holds) is refused by name.

The generator's state is rank 0's (broadcast first), so every rank draws the same stream.

What is exact: the full parameters equal those of ``Net()`` built normally on the CPU after
the same ``torch.manual_seed(s)`` when (a) nothing draws from the global generator between
the seed and ``prepare`` (building on meta draws nothing), and (b) ``Net``'s initialization
is its modules' ``reset_parameters`` in registration order (``nn.Linear``, ``nn.Embedding``,
``nn.LayerNorm``, ``nn.Conv*``, ...). Extra initialization in a constructor (an
``init.normal_`` after building a layer) is not replayed; a module that holds parameters
of its own without an initializer is refused by name before anything changes. A
transformers model gets its own init's distribution (not the bits of a CPU build, whose
constructor draws ``reset_parameters`` values that ``post_init`` then draws again): load
its weights with ``af.load_model`` after ``prepare``. Tied
parameters take the value of their first owner, as ``b.weight = a.weight`` after building
both leaves them (the later owner still draws its values, so the stream stays aligned).
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist

from accelfn.distributed.ops import is_dtensor
from accelfn.distributed.phases import ModelPhase
from accelfn.transforms import ShardParams, TensorParallel

if TYPE_CHECKING:
    from accelfn.distributed.phases import Preparation
    from accelfn.step import Step


def is_meta(model: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def fills(step: Step) -> bool:
    """Whether ``prepare`` materializes a model built on the meta device under ``step``: the
    step shards (``shard_params``) or splits (``tensor_parallel``) it, so each rank fills only its
    own part. ``af.plan`` reads the same rule."""
    return step.find(ShardParams) is not None or step.find(TensorParallel) is not None


def check(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, splits: bool) -> None:
    """Raises before anything changes unless ``prepare`` can materialize ``model``, built on the
    meta device: the step must shard or split it (``splits``), its optimizer hold no state yet,
    and every module with tensors of its own have an initializer (its ``reset_parameters()``,
    or its transformers model's ``_init_weights``).

    Raises:
        ValueError: the step neither shards nor splits the model; the optimizer holds state;
            naming each module (and its class) that holds parameters or buffers of its own
            and has no initializer.
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
    initializers = _initializers(model)
    missing = [f"{name or '<root>'} ({type(m).__name__})" for name, m in model.named_modules()
               if _own(m) and initializers.get(name) is None]
    if missing:
        raise ValueError(
            f"a model built on the meta device is initialized module by module with each module's "
            f"reset_parameters() (a transformers model: with its own _init_weights), but {', '.join(missing)} "
            "hold parameters or buffers of their own and have none; give those modules a reset_parameters() that "
            "initializes them (as nn.Linear has), or build the model on the CPU"
        )


def _hf_model(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a transformers ``PreTrainedModel`` (transformers is not imported for it)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)


def _initializers(model: torch.nn.Module) -> dict[str, Callable[[], None] | None]:
    """How each module (by name) initializes the tensors it holds itself: inside a transformers
    model, that model's ``_init_weights(module)`` (the nearest one: a sub-model's own), as its
    ``post_init`` does; elsewhere the module's ``reset_parameters()``; None when it has neither."""
    owners: dict[str, torch.nn.Module] = {}
    found: dict[str, Callable[[], None] | None] = {}
    for name, module in model.named_modules():
        parent = owners.get(name.rpartition(".")[0]) if name else None
        owner = module if _hf_model(module) else parent
        owners[name] = owner  # type: ignore[assignment]
        if owner is not None:
            found[name] = functools.partial(getattr(owner, "_init_weights"), module)
        else:
            reset = getattr(module, "reset_parameters", None)
            found[name] = reset if callable(reset) else None
    return found


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
    its shard of the values its initialization gives (see the module docstring).
    Tensors not on meta are left as they are.

    Raises:
        ValueError: a module's initialization left floating-point values of its own unset
            (named): it does not initialize every tensor the module holds.
    """
    _agree_on_generator()
    initializers = _initializers(model)
    model.to_empty(device=device)
    done: set[int] = set()
    with torch.no_grad():
        for name, module in model.named_modules():
            own = _own(module)
            if not own:
                continue
            for attr, t, is_param in own:  # full-size stand-ins on the CPU, for the initializer to fill
                full = torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu")
                if full.is_floating_point():
                    full.fill_(float("nan"))  # what the initializer leaves unset stays NaN
                if is_param:
                    module._parameters[attr] = torch.nn.Parameter(full, requires_grad=t.requires_grad)
                else:
                    module._buffers[attr] = full
            try:
                initialize = initializers[name]
                assert initialize is not None  # checked by check()
                initialize()
                values = [(module._parameters[n] if p else module._buffers[n]) for n, _, p in own]
            finally:
                for attr, t, is_param in own:
                    if is_param:
                        module._parameters[attr] = t  # the model's own Parameter
                    else:
                        module._buffers[attr] = t
            for (attr, t, _), value in zip(own, values):
                if id(t) in done:  # a tied tensor keeps its first owner's values
                    continue
                if value.is_floating_point() and bool(value.isnan().any()):
                    raise ValueError(
                        f"materializing a model built on the meta device: the initialization of {name or '<root>'} "
                        f"({type(module).__name__}) left {attr} unset; give the module a reset_parameters() that "
                        "initializes every tensor it holds (a transformers model: its _init_weights), or build "
                        "the model on the CPU")
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
        splits = fills(prep.step)
        return cls(splits) if splits or prep.hardware.place_model else None

    def check(self, prep: Preparation) -> None:
        check(prep.state.model, prep.state.optimizer, splits=self.splits)

    def apply(self, prep: Preparation) -> None:
        materialize(prep.state.model, prep.hardware.device)
