"""``evaluate``: a function of the model over the whole dataset, split over ranks, in order."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from accelfn import distributed
from accelfn.backends.base import Backend
from accelfn.data.batches import keyed_batches
from accelfn.data.tree import map_tensors
from accelfn.distributed import pipeline
from accelfn.distributed.phases import layout
from accelfn.state import TrainState, require_state
from accelfn.step import Step

Outputs = Any  # a tensor, or a tuple/list/dict of tensors, each of shape (batch, ...)


def evaluate(
    fn: Callable[[torch.nn.Module, Any], Outputs],
    state: TrainState,
    data: Iterable[Any],
    *,
    backend: Backend,
    precision: Step | None = None,
) -> Outputs:
    """``fn(model, batch)`` over all of ``data``, each sample once, in dataset order, on every rank.

    Each rank runs ``fn`` on its own part of ``data`` under ``torch.no_grad()`` with the model
    in eval mode; afterwards every submodule is back in the mode it had (a frozen backbone
    the user put in eval mode stays there). The outputs are then gathered and put back in
    the order of ``data``. Nothing is padded, so no sample is counted twice.

    ``torch.no_grad()``, not ``torch.inference_mode()``: a module that builds a cache on
    its first forward (a rotary table, ``nn.LazyLinear``'s weights) may do so inside
    ``evaluate``, and inference tensors left there would break the next ``af.run``
    ("Inference tensors cannot be saved for backward"). And ``fn`` may compute gradients
    itself, e.g. a saliency map under ``torch.enable_grad()``; the parameters' ``.grad``
    are put back as they were afterwards, so such gradients never reach the next update.

    A collective: call it on every rank, not inside ``if backend.is_main_process:``; the
    ranks first check that all of them arrived (``distributed.arrive``). Under ``replicate``
    and ``shard_params`` every rank then takes rank 0's buffers (BatchNorm's running
    statistics, which each rank's last training forward updated from its own batch), as
    DDP's next forward would and as ``af.save`` writes: every sample goes through one model.
    A model sharded with ``shard_params`` runs its sharded forward on every rank; a rank
    with fewer batches repeats its first one (outputs dropped) so the ranks' parameter
    all-gathers pair up, and a rank without any (fewer batches than ranks) runs a copy of
    another rank's first batch.

    A model cut into stages by ``pipeline`` (each rank holds its stages only): ``fn``'s
    ``model`` is then a stand-in whose ``model(*inputs)`` runs the stages forward only
    (the schedule's ``eval``) and gives the last stage's output to every rank of the
    pipeline; the ranks of a pipeline read the same batches, so ``fn`` must call it alike
    on each (any other use of ``model`` fails).

    The model runs in its parameters' precision: a model trained with ``"bf16-true"`` gets
    its floating inputs cast to bf16 as in training; under ``"bf16"``/``"fp16"`` (fp32
    master weights) ``fn`` runs in fp32 unless ``precision`` gives the training program,
    whose policy it then runs under (``backend.autocast(precision)``, as training's forward).
    The same under ``shard_params``: the units gather fp32 parameters for ``fn``, and the
    compute dtype's only under ``precision``.

    Args:
        fn: ``fn(model, batch)`` returning a tensor of shape ``(batch, ...)``, or a
            tuple/list/dict of such tensors; ``batch`` is on ``backend.device``.
        state: the state whose (unwrapped) model is evaluated.
        data: a DataLoader built with ``batch_size=...`` (map-style: samples in index order;
            an IterableDataset: in stream order), or any iterable of batches (in batch order).
        backend: the backend, e.g. ``af.backends.auto()``.
        precision: the training Step, to run ``fn`` under its precision policy (autocast to
            bf16/fp16 as in training); None: the parameters' precision.

    Returns:
        The outputs for every sample of ``data``, same structure as ``fn``'s, each tensor of
        shape ``(num_samples, ...)``, identical on every rank, on the backend's collective
        device (CPU for gloo, the rank's GPU for NCCL).

    Raises:
        TypeError: ``fn`` is not callable, ``state`` is not a TrainState, ``precision`` is
            neither a Step nor None, or ``fn`` returned something other than tensors.
        RuntimeError: (``distributed.ArrivalError``) some rank did not call ``evaluate``
            within a tenth of the collective timeout: it is a collective, call it on every rank.
        ValueError: an output whose leading dimension is not the batch size, or ``data``
            without any sample; a DataLoader without ``batch_size``; outputs of another
            structure on some rank (on every rank, naming each rank's).

    Example:
        >>> import torch, accelfn as af
        >>> model = torch.nn.Linear(3, 2)
        >>> state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> data = torch.utils.data.DataLoader(torch.randn(9, 3), batch_size=5)
        >>> af.evaluate(lambda m, x: m(x), state, data, backend=af.backends.CPU()).shape
        torch.Size([9, 2])
    """
    if not callable(fn):
        raise TypeError(f"evaluate(fn, ...) needs a callable fn(model, batch), got {type(fn).__name__}")
    require_state("af.evaluate(fn, state, ...)", state)
    if not isinstance(backend, Backend):
        raise TypeError(f"evaluate(backend=...) must be a backend such as af.backends.auto(), got {backend!r}")
    if precision is not None and not isinstance(precision, Step):
        raise TypeError(f"evaluate(precision=...) takes the training Step (whose precision policy fn runs under), "
                        f"or None, got {type(precision).__name__}")
    with backend.user_code("af.evaluate"):
        return _evaluate(fn, state, data, backend, precision)


def _evaluate(fn: Callable[[torch.nn.Module, Any], Outputs], state: TrainState, data: Iterable[Any],
              backend: Backend, precision: Step | None) -> Outputs:
    policy = backend.precision(precision) if precision is not None else None
    if backend.world_size > 1:
        distributed.arrive("af.evaluate")
    model = state.model
    distributed.sync_buffers(model, backend.collective_device)  # one model: rank 0's buffers on every rank
    cast = _input_cast(model)
    keys, outputs = [], []
    # the mesh it was prepared with: a tensor-parallel group, a pipeline reads one shard
    data_rank, data_world, leads, collective = layout(model, backend.rank, backend.world_size)
    batches = keyed_batches(data, rank=data_rank, world_size=data_world)
    if collective:
        batches = _in_step(backend, batches)
    pipelined = pipeline.forward_of(model)  # a model cut into stages: fn calls their forward
    runs: Any = model if pipelined is None else pipelined
    modes = [(module, module.training) for module in model.modules()]
    grads = [(p, p.grad) for p in model.parameters()]  # fn may take gradients (enable_grad)
    model.eval()
    try:
        with torch.no_grad():
            for batch_keys, batch in batches:
                with backend.autocast(policy) if policy is not None else contextlib.nullcontext():
                    out = fn(runs, cast(backend.place(batch)))
                if batch_keys is None:  # a replay that keeps a sharded model's ranks in step
                    continue
                _check_leading(out, len(batch_keys))
                keys.append(batch_keys)
                outputs.append(map_tensors(lambda t: t.detach(), out))
                if backend.graph_cut is not None:
                    backend.graph_cut()
    finally:  # each module's own flag: model.train(flag) would set every submodule to it
        backend.reshard(model)  # a sharded model's parameters gathered and kept by the forwards
        for module, training in modes:
            module.training = training
        for param, grad in grads:  # gradients fn took do not leak into the next update
            param.grad = grad
    if not leads:  # another rank of this tensor-parallel group reports the same samples
        keys, outputs = [k[:0] for k in keys], [map_tensors(lambda t: t[:0], o) for o in outputs]
    return _gather_in_order(backend, keys, outputs)


def _in_step(backend: Backend, batches: Iterable[tuple[torch.Tensor, Any]]) -> Iterator[tuple[Any, Any]]:
    """A sharded model's forward is collective (it all-gathers parameters), so every rank must
    run as many as the others: a rank that ran out runs its first batch again (a rank without
    any batch, a copy of another rank's), with ``None`` for keys (its outputs are dropped),
    until every rank is done."""
    for (keys, batch), replayed in backend.lockstep(iter(batches), replays=True):
        yield (None if replayed else keys), batch


def _input_cast(model: torch.nn.Module) -> Callable[[Any], Any]:
    """For a model whose parameters are in bf16 or fp16 (``with_precision("bf16-true")``),
    the cast of a batch's floating tensors to that dtype, as training does; else identity."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    if dtype not in (torch.bfloat16, torch.float16):
        return lambda batch: batch
    return lambda batch: map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, batch)


def _check_leading(out: Any, batch: int, where: str = "output") -> None:
    if isinstance(out, torch.Tensor):
        if out.ndim == 0 or out.shape[0] != batch:
            raise ValueError(
                f"evaluate(): fn's {where} has shape {tuple(out.shape)}, but its leading dimension "
                f"must be the batch size {batch} (one row per sample); return per-sample values, "
                "not a reduced metric"
            )
    elif isinstance(out, (tuple, list)):
        for i, x in enumerate(out):
            _check_leading(x, batch, f"{where}[{i}]")
    elif isinstance(out, Mapping):
        for k, x in out.items():
            _check_leading(x, batch, f"{where}[{k!r}]")
    else:
        raise TypeError(
            f"evaluate(): fn's {where} is a {type(out).__name__}; fn must return a tensor or a "
            "tuple/list/dict of tensors"
        )


def _concat(parts: list[Any]) -> Any:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, Mapping):
        return type(first)({k: _concat([p[k] for p in parts]) for k in first})  # type: ignore[call-arg]  # a Mapping subclass built from a dict, as dict and OrderedDict are
    items = [_concat([p[i] for p in parts]) for i in range(len(first))]
    return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)


def _gather_in_order(backend: Backend, keys: list[torch.Tensor], outputs: list[Any]) -> Any:
    local = _concat(outputs) if outputs else None
    # One collective first: every rank's outputs without their rows. Ranks whose outputs
    # differ in structure (other dict keys, tuple lengths) would pair up unrelated gathers,
    # or wait forever for one another rank never starts: they fail on every rank instead.
    # A rank without samples (fewer samples than ranks) takes empty outputs shaped like
    # another rank's. Every rank takes part in the same distributed.
    templates = backend.gather_object(None if local is None else map_tensors(lambda t: t[:0].cpu(), local))
    present = [(r, t) for r, t in enumerate(templates) if t is not None]
    if not present:
        raise ValueError("evaluate(): data holds no samples on any rank")
    structures = {r: _structure(t) for r, t in present}
    if len(set(structures.values())) > 1:
        each = "; ".join(f"rank {r}: {s}" for r, s in structures.items())
        raise ValueError(f"evaluate(): fn returned outputs of another structure on some ranks ({each}); fn "
                         "must return the same structure (the same tensors, keys and trailing shapes) on "
                         "every rank")
    if local is None:
        local = map_tensors(lambda t: t.to(backend.device), present[0][1])
    local_keys = torch.cat(keys) if keys else torch.zeros(0, dtype=torch.int64)
    order = torch.argsort(backend.gather(local_keys))
    return map_tensors(lambda t: backend.gather(t)[order], local)


def _structure(tree: Any) -> str:
    """The structure of an output without its rows: containers, keys, trailing shapes, dtypes."""
    if isinstance(tree, torch.Tensor):
        return f"{str(tree.dtype).removeprefix('torch.')}{[-1, *tree.shape[1:]]}".replace("-1", "*")
    if isinstance(tree, Mapping):
        return "{" + ", ".join(f"{k!r}: {_structure(v)}" for k, v in tree.items()) + "}"
    return f"{type(tree).__name__}(" + ", ".join(_structure(v) for v in tree) + ")"
