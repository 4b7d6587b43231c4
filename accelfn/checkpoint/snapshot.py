"""The Snapshot: the immutable value of a TrainState, captured, checked against a state, restored.

``snapshot(state)`` copies everything a run is at a moment to the CPU: model and optimizer
tensors, scheduler and ``extra`` states, the counters (the data position among them), each
transform's state, the gradients accumulated so far in an open accumulation window, and
the global RNG states. ``invalid_values`` and ``check`` say what in a snapshot no state
could take, or this state cannot (``verify`` raises with both); ``put`` puts a verified
snapshot back in place, and ``restore`` is the two together. A checkpoint (``af.save``) is
a snapshot serialized.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import attrs
import torch

from accelfn.checkpoint import _rng
from accelfn.checkpoint._codec import (
    COUNTERS,
    copy_tree,
    describe,
    invalid_values,
    mismatches,
    view_key,
)
from accelfn.checkpoint._rng import RngState
from accelfn.checkpoint._tensorfiles import WORKERS, in_parallel
from accelfn.distributed import is_dtensor, plain
from accelfn.errors import CheckpointError
from accelfn.state import OPTIMIZER_VIEW, Stopped, TrainState, require_state

#: transform state that belongs to the micro-batches consumed (the open accumulation
#: window): restored from the snapshot or dropped, never kept from the target state
TRANSIENT = frozenset({"window", "tree_window"})
_COMPILED = "_orig_mod"
#: below this many bytes, copies into a state's tensors run in the calling thread
_PARALLEL_COPY_BYTES = 8 << 20


def _frozen(value: Mapping[str, Any]) -> Mapping[str, Any]:
    return value if isinstance(value, MappingProxyType) else MappingProxyType(dict(value))


@attrs.frozen(eq=False)
class Snapshot:
    """The value of a TrainState at one moment: detached CPU copies, restorable anywhere.

    Attributes:
        model: the unwrapped model's ``state_dict`` (keys without ``module.`` or
            ``_orig_mod.``); tied weights are one tensor under each of their names.
        optimizer: the optimizer's ``state_dict``.
        optimizer_type: the optimizer's class name (``"AdamW"``).
        optimizer_params: per parameter group, the model name of each parameter.
        scheduler: the lr scheduler's ``state_dict``, or None without a scheduler.
        scheduler_type: its class name, or None.
        extra: each ``extra`` object's ``state_dict``, by name.
        counters: ``step``, ``micro_step``, ``epoch``, ``epoch_micro_step`` (every
            TrainState field that is not one of the parts above).
        transforms_state: the transforms' records (loss scale, skip count, open window).
        grads: the accumulated ``.grad`` of each parameter that has one (an open
            accumulation window), by name; empty after an optimizer update.
        rng: the global generators of this process (torch CPU/CUDA, ``random``, NumPy).
        stopped: ``{"step": int, "reason": str}`` when a hook's ``af.Stop`` ended the run
            (``TrainState.stopped``), else None (and in snapshots of accelfn before it).
        data_state: this process's data readers' saved state (``TrainState.data_state``:
            plain data and tensors, a stream's position), or None.
    """

    model: Mapping[str, Any] = attrs.field(converter=_frozen)
    optimizer: Mapping[str, Any]
    optimizer_type: str
    optimizer_params: tuple[tuple[str, ...], ...]
    scheduler: Mapping[str, Any] | None
    scheduler_type: str | None
    extra: Mapping[str, Any] = attrs.field(converter=_frozen)
    counters: Mapping[str, Any] = attrs.field(converter=_frozen)
    transforms_state: Mapping[str, Any] = attrs.field(converter=_frozen)
    grads: Mapping[str, torch.Tensor] = attrs.field(converter=_frozen)
    rng: RngState
    stopped: Mapping[str, Any] | None = None
    data_state: Mapping[str, Any] | None = None


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP/DataParallel and ``torch.compile`` wrappers."""
    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, _COMPILED, None), torch.nn.Module):
            model = getattr(model, _COMPILED)
        else:
            return model


def is_sharded(state: TrainState) -> bool:
    """True if any parameter of the state's model is a DTensor (FSDP2 ``fully_shard``)."""
    return any(is_dtensor(p) for p in unwrap(state.model).parameters())


def optimizer_of(state: TrainState) -> Any:
    """The optimizer as checkpoints see it: ``state.optimizer``, or, for a model an engine
    drives (``af.deepspeed``), the engine's view of it in torch's format with whole tensors."""
    return getattr(state.model, OPTIMIZER_VIEW, None) or state.optimizer


def clean_name(name: str) -> str:
    """``name`` without the ``_orig_mod`` components compiled submodules add."""
    if _COMPILED not in name:
        return name
    return ".".join(part for part in name.split(".") if part != _COMPILED)


def _type_name(obj: Any) -> str:
    return type(obj).__qualname__


def _param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[tuple[str, ...], ...]:
    names = {id(p): clean_name(n) for n, p in model.named_parameters()}
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        missing = [tuple(p.shape) for p in group["params"] if id(p) not in names]
        if missing:
            raise ValueError(f"optimizer param_groups[{i}] holds tensors of shapes {missing} that are not "
                             "parameters of the model; build the optimizer from model.parameters()")
        groups.append(tuple(names[id(p)] for p in group["params"]))
    return tuple(groups)


def _to_cpu(t: torch.Tensor) -> torch.Tensor:
    return t.to("cpu", copy=True)


class _Copier:
    """Detaches tensors (``copy=False``) or copies them to the CPU with ``to_host`` once per
    view (``copy=True``)."""

    def __init__(self, copy: bool, to_host: Callable[[torch.Tensor], torch.Tensor]):
        self._copy = copy
        self._to_host = to_host
        self._done: dict[tuple[Any, ...], torch.Tensor] = {}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        t = plain(t.detach())  # torchao's float8 weight wrappers: their fp32 data
        if not self._copy:
            return t
        key = view_key(t)
        if key is None:
            return self._to_host(t)
        if key not in self._done:
            self._done[key] = self._to_host(t)
        return self._done[key]


def capture(state: TrainState, *, copy: bool,
            to_host: Callable[[torch.Tensor], torch.Tensor] = _to_cpu) -> Snapshot:
    """The snapshot of ``state``; with ``copy=False`` its tensors alias the live ones (for
    writing them out at once), with ``copy=True`` they are independent CPU copies made by
    ``to_host`` (a fresh copy by default; reused host buffers for background saves),
    called once per tensor in the same order for states of the same structure.

    Raises:
        ValueError: the optimizer updates a tensor that is not a parameter of the model.
        TypeError: ``state`` is not a TrainState.
    """
    require_state("af.snapshot(state)", state)
    to_cpu = _Copier(copy, to_host)
    model = unwrap(state.model)
    return Snapshot(
        model={clean_name(k): copy_tree(v, to_cpu) for k, v in model.state_dict().items()},
        optimizer=copy_tree(optimizer_of(state).state_dict(), to_cpu),
        optimizer_type=_type_name(state.optimizer),
        optimizer_params=_param_names(model, optimizer_of(state)),
        scheduler=None if state.scheduler is None else copy_tree(state.scheduler.state_dict(), to_cpu),
        scheduler_type=None if state.scheduler is None else _type_name(state.scheduler),
        extra={name: copy_tree(obj.state_dict(), to_cpu) for name, obj in state.extra.items()},
        counters={name: getattr(state, name) for name in COUNTERS},
        transforms_state={k: copy_tree(v, to_cpu) for k, v in state.transforms_state.items()},
        grads={clean_name(n): to_cpu(p.grad) for n, p in model.named_parameters() if p.grad is not None},
        rng=_rng.capture(),
        stopped=None if state.stopped is None else {"step": state.stopped.step, "reason": state.stopped.reason},
        data_state=copy_tree(saved_data_state(state.data_state), to_cpu),
    )


def saved_data_state(value: Any) -> Mapping[str, Any] | None:
    """``TrainState.data_state`` as a snapshot holds it: a mapping as it is, the live readers'
    ``state_dict()`` (their state after the micro-batches consumed), or None."""
    if value is None or isinstance(value, Mapping):
        return value
    return value.state_dict()


def snapshot(state: TrainState) -> Snapshot:
    """A detached CPU copy of everything ``state`` is: the immutable value of a TrainState.

    Args:
        state: the state; nothing in it changes and no generator is drawn from.

    Returns:
        Snapshot: CPU copies of the model, optimizer, scheduler and ``extra`` states, the
        counters, the transforms' states, open-window gradients and the global RNG states.

    Raises:
        TypeError: ``state`` is not a TrainState.
        ValueError: the optimizer updates a tensor that is not a parameter of the model.

    Example:
        >>> import torch, accelfn as af
        >>> model = torch.nn.Linear(2, 1)
        >>> state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> snap = af.snapshot(state)
        >>> sorted(snap.model)
        ['bias', 'weight']
    """
    return capture(state, copy=True)


def _names(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" (and {len(items) - limit} more)" if len(items) > limit else "")


def _check_tensors(what: str, ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> list[str]:
    """Problems of ``theirs`` (the snapshot's) against ``ours`` (the state's): keys, shapes, dtypes."""
    problems = []
    missing = [k for k in ours if k not in theirs]
    unexpected = [k for k in theirs if k not in ours]
    if missing:
        problems.append(f"{what}: missing from the checkpoint ({len(missing)}): {_names(missing)}")
    if unexpected:
        problems.append(f"{what}: unexpected in the checkpoint ({len(unexpected)}): {_names(unexpected)}")
    for key, saved in theirs.items():
        here = ours.get(key)
        if not isinstance(here, torch.Tensor):
            continue
        if not isinstance(saved, torch.Tensor):
            problems.append(f"{what} {key!r}: {describe(saved)} in the checkpoint, a tensor here")
        elif saved.shape != here.shape:
            problems.append(f"{what} {key!r}: shape {tuple(saved.shape)} in the checkpoint, {tuple(here.shape)} here")
        elif saved.dtype != here.dtype:
            problems.append(f"{what} {key!r}: dtype {saved.dtype} in the checkpoint, {here.dtype} here")
    return problems


def _check_optimizer(state: TrainState, snap: Snapshot, model: torch.nn.Module) -> list[str]:
    if snap.optimizer_type != _type_name(state.optimizer):
        return [f"optimizer: {snap.optimizer_type} in the checkpoint, {_type_name(state.optimizer)} here"]
    ours = _param_names(model, optimizer_of(state))
    theirs = snap.optimizer_params
    if [len(g) for g in ours] != [len(g) for g in theirs]:
        return [f"optimizer: parameter groups of sizes {[len(g) for g in theirs]} in the checkpoint, "
                f"{[len(g) for g in ours]} here"]
    differ = [f"param_groups[{g}][{i}] is {a!r} in the checkpoint, {b!r} here"
              for g, (group_a, group_b) in enumerate(zip(theirs, ours))
              for i, (a, b) in enumerate(zip(group_a, group_b)) if a != b]
    return [f"optimizer: {_names(differ, 4)}"] if differ else []


def _check_optimizer_values(state: TrainState, snap: Snapshot, source: str) -> list[str]:
    """The saved param groups' hyperparameters against the live ones, and each parameter's
    state against the one it would hold under them (``_probed_state``), else its live one."""
    live = optimizer_of(state).state_dict()
    saved_groups, live_groups = snap.optimizer["param_groups"], live["param_groups"]
    if len(saved_groups) != len(live_groups):
        return [f"optimizer.param_groups: {len(saved_groups)} in {source}, {len(live_groups)} here"]
    problems = []
    for i, (saved, here) in enumerate(zip(saved_groups, live_groups)):
        if list(saved["params"]) != list(here["params"]):
            problems.append(f"optimizer.param_groups[{i}].params: {describe(saved['params'])} in {source}, "
                            f"{describe(here['params'])} here")
        hyper = {k: v for k, v in saved.items() if k != "params"}
        problems += mismatches(hyper, here, f"optimizer.param_groups[{i}]", source)
        problems += _refused_hyperparameters(state.optimizer, hyper, here, f"optimizer.param_groups[{i}]", source)
    indices = {i for group in live_groups for i in group["params"]}
    # torch keys a parameter's state by its index, and keeps any other key as it is
    if unknown := [key for key in snap.optimizer["state"] if isinstance(key, int) and key not in indices]:
        problems.append(f"optimizer.state: entries for parameters {_names([repr(k) for k in unknown])} in "
                        f"{source}; the optimizer has parameters 0..{len(indices) - 1}")
    probed = _probed_state(state, saved_groups) if not problems else {}
    for index, entry in snap.optimizer["state"].items():
        where, expected = f"optimizer.state[{index}]", probed.get(index)
        if entry and expected is not None:  # an empty entry is a parameter's state before its first update
            problems += mismatches(entry, expected, where, source, complete=True, none_fits=False)
        elif index in live["state"]:
            problems += mismatches(entry, live["state"][index], where, source)
    return problems


def _options(cls: type, hyper: Mapping[str, Any]) -> dict[str, Any] | None:
    """A param group's hyperparameters ``hyper`` as keyword arguments of the optimizer class
    ``cls``, or None where its constructor needs others."""
    accepted = inspect.signature(cls).parameters
    options = {k: v for k, v in hyper.items() if k in accepted and k != "params"}
    free = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    required = [name for name, p in accepted.items()
                if name != "params" and p.default is inspect.Parameter.empty and p.kind not in free]
    return None if any(name not in options for name in required) else options


def _refused_hyperparameters(optimizer: torch.optim.Optimizer, hyper: Mapping[str, Any], live: Mapping[str, Any],
                             path: str, source: str) -> list[str]:
    """A new optimizer of ``optimizer``'s class given the saved ``hyper``: its ValueError
    (``lr`` < 0, ``betas`` outside [0, 1)), or the keys of the ``live`` group its
    ``__setstate__`` (which fills in options added since) leaves out, as problems."""
    cls, options = type(optimizer), _options(type(optimizer), hyper)
    if options is None:
        return []
    device = next((p.device for group in optimizer.param_groups for p in group["params"]), torch.device("cpu"))
    try:
        new = cls([torch.zeros(1, device=device, requires_grad=True)], **options)
        new.__setstate__({**new.__getstate__(), "param_groups": [{**hyper, "params": new.param_groups[0]["params"]}]})
    except ValueError as e:
        return [f"{path}: {cls.__name__} refuses the hyperparameters in {source}: {e}"]
    except Exception:  # a probe: values of other kinds (betas='') are reported by mismatches
        return []
    return [f"{path}.{key}: missing from {source} ({describe(live[key])} here)"
            for key in live if key != "params" and key not in new.param_groups[0]]


#: a stand-in parameter's sizes (primes: a state tensor's sizes name the dimensions they follow)
_SIZES = (2, 3, 5, 7, 11, 13)


def _probed_state(state: TrainState, groups: list[Mapping[str, Any]]) -> dict[int, dict[str, Any]]:
    """The state ``state``'s optimizer would hold per parameter index after an update under the
    hyperparameters of ``groups`` (tensors as "meta" ones): a step on zero gradients, as DCP
    initializes a state, of a new optimizer over CPU stand-ins of each kind of parameter, their
    state's sizes mapped back. Empty where it cannot step so (LBFGS); no guess is refused."""
    optimizer, cls = optimizer_of(state), type(state.optimizer)
    held = getattr(optimizer, "held_as", None) or (lambda p: p)  # an engine's view: whole fp32 masters
    stepped = [[held(p) for p in group["params"]] for group in optimizer.param_groups]
    probes, kinds = [], []
    for params, saved in zip(stepped, groups):
        options = _options(cls, {k: v for k, v in saved.items() if k != "params"})
        if options is None:
            return {}
        kinds.append({(p.dtype, p.dim()): torch.zeros(_SIZES[:p.dim()], dtype=p.dtype, requires_grad=True)
                      for p in params if p.dim() <= len(_SIZES) and p.is_floating_point()})
        if kinds[-1]:
            on_cpu = {k: v for k, v in {"fused": None, "capturable": False, "foreach": None}.items() if k in options}
            probes.append({"params": list(kinds[-1].values()), **options, **on_cpu})  # CPU stand-ins
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            probe = cls(probes, **{k: v for k, v in probes[0].items() if k != "params"})
            for t in (t for group in probes for t in group["params"]):
                t.grad = torch.zeros_like(t)
            getattr(cls.step, "__wrapped__", cls.step)(probe)  # the step itself, without the step hooks
    except Exception:  # a probe: a class that cannot be stepped so is not checked against one
        return {}
    found: dict[int, dict[str, Any]] = {}
    metas: dict[tuple[Any, ...], torch.Tensor] = {}  # one "meta" tensor per shape and dtype
    params = [(p, kinds[g].get((p.dtype, p.dim()))) for g, group in enumerate(stepped) for p in group]
    for index, (p, stand_in) in enumerate(params):
        entry = {} if stand_in is None else {key: _like(v, p.shape, metas) for key, v in probe.state[stand_in].items()}
        if entry and all(value is not None for value in entry.values()):
            found[index] = entry
    return found


def _like(value: Any, shape: torch.Size, metas: dict[tuple[Any, ...], torch.Tensor]) -> Any:
    """A stand-in's state ``value`` for a parameter of ``shape`` ("meta"; None if a dimension does not map)."""
    if not isinstance(value, torch.Tensor):
        return value
    sizes = _SIZES[:len(shape)]
    if any(n != 1 and n not in sizes for n in value.shape):
        return None
    key = (tuple(1 if n == 1 else shape[sizes.index(n)] for n in value.shape), value.dtype)
    if key not in metas:
        metas[key] = torch.empty(key[0], dtype=key[1], device="meta")
    return metas[key]


def check(state: TrainState, snap: Snapshot, *, source: str = "the snapshot",
          names: Mapping[str, str] = MappingProxyType({})) -> list[str]:
    """Every way ``snap`` does not fit ``state`` (empty if it fits): keys, shapes and dtypes of
    tensors, values of other kinds than the live ones they would replace (its own values are
    ``invalid_values``'). ``source`` says where the values come from (``"manifest.json"``),
    ``names`` how a Snapshot field is named there (``"ranks[1].rng"``; itself by default)."""
    model = unwrap(state.model)
    problems = _check_tensors("model", {clean_name(k): v for k, v in model.state_dict().items()}, snap.model)
    optimizer = _check_optimizer(state, snap, model)
    problems += optimizer or _check_optimizer_values(state, snap, source)
    scheduler_type = None if state.scheduler is None else _type_name(state.scheduler)
    if snap.scheduler_type != scheduler_type:
        problems.append(f"scheduler: {snap.scheduler_type} in the checkpoint, {scheduler_type} here")
    elif state.scheduler is not None:  # torch's load keeps a live value the saved state lacks: an option added
        live = state.scheduler.state_dict()  # since (private) may be missing, a public one may not
        problems += [f"scheduler.{k}: missing from {source} ({describe(v)} here)" for k, v in live.items()
                     if not str(k).startswith("_") and k not in (snap.scheduler or {})]
        problems += mismatches(snap.scheduler, live, "scheduler", source)
    if set(snap.extra) != set(state.extra):
        problems.append(f"extra: {sorted(snap.extra)} in the checkpoint, {sorted(state.extra)} here")
    for name in sorted(set(snap.extra) & set(state.extra)):  # what its own load_state_dict reads
        saved, live_state = snap.extra[name], state.extra[name].state_dict()
        if isinstance(live_state, Mapping) and not isinstance(saved, Mapping):
            problems.append(f"extra.{name}: {describe(saved)} in {source}, a mapping here")
        problems += mismatches(saved, live_state, f"extra.{name}", source, complete=True, lengths=False)
    for key, saved in snap.transforms_state.items():
        if key in state.transforms_state:
            where = f"{names.get('transforms_state', 'transforms_state')}.{key}"
            problems += mismatches(saved, state.transforms_state[key], where, source)
    params = {clean_name(n): p for n, p in model.named_parameters()}  # FSDP2 keeps grads in its reduce dtype
    if unknown := [n for n in snap.grads if n not in params]:
        problems.append(f"gradients of unknown parameters: {_names(unknown)}")
    for name, grad in snap.grads.items():
        param = params.get(name)
        if param is not None and grad.shape != param.shape:
            problems.append(f"gradient {name!r}: shape {tuple(grad.shape)} in the checkpoint, "
                            f"{tuple(param.shape)} here")
        elif param is not None and grad.dtype != param.dtype and not (is_dtensor(param) and grad.is_floating_point()):
            problems.append(f"gradient {name!r}: dtype {grad.dtype} in the checkpoint, {param.dtype} here")
    return problems


def verify(state: TrainState, snap: Snapshot, *, source: str = "the snapshot",
           names: Mapping[str, str] = MappingProxyType({})) -> None:
    """Checks ``snap``'s values, then its fit to ``state``; ``source`` and ``names`` name
    the values in messages (``check``). Changes nothing.

    Raises:
        TypeError: arguments of the wrong types.
        CheckpointError: a value no state could take, or the snapshot does not fit the state.
    """
    require_state("af.restore(state, snapshot)", state)
    if not isinstance(snap, Snapshot):
        raise TypeError(f"restore() takes a Snapshot second (af.snapshot(state)), got {type(snap).__name__}")
    invalid = invalid_values(snap, names=names)
    if invalid:
        raise CheckpointError(f"invalid values in {source}:\n  " + "\n  ".join(invalid))
    differ = check(state, snap, source=source, names=names)
    if differ:
        raise CheckpointError("the checkpoint does not match the state it is loaded into:\n  " + "\n  ".join(differ))


def put(state: TrainState, snap: Snapshot, *, copy: bool) -> TrainState:
    """Puts a verified ``snap`` in place; ``copy=False`` lets the state take ownership of
    the snapshot's tensors (the snapshot must not be used again). Cannot fail but in a
    user's ``extra`` object, whose ``load_state_dict`` therefore runs first (its error a
    CheckpointError naming it).

    Parameters and buffers are copied into the model's own tensors; so are optimizer
    states where the optimizer already holds a tensor of the same shape, dtype and key
    (no fresh memory); any other tensor is copied (``copy``) or taken over."""
    model = unwrap(state.model)
    device = next((t.device for t in (*model.parameters(), *model.buffers())), torch.device("cpu"))

    def own(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if copy else t

    for name, obj in state.extra.items():
        try:
            obj.load_state_dict(copy_tree(snap.extra[name], own))
        except Exception as e:  # its own checks, past the structure ``check`` compared
            raise CheckpointError(f"extra[{name!r}].load_state_dict refused the saved state: {type(e).__name__}: {e} "
                                  "(nothing else was loaded; the entries of extra before it were)") from e
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    live = {clean_name(k): (k, v) for k, v in model.state_dict().items()}
    values = {}
    for name, saved in snap.model.items():
        key, target = live[name]
        values[key] = _into(target, saved, copies)
    optimizer = _into_live(optimizer_of(state), snap.optimizer, own, copies)
    copy_all(copies)
    # the live tensors now hold the saved values: loading them copies nothing more, and runs
    # the modules' own load hooks and torch's checks as a load of the saved tensors would
    model.load_state_dict(values)
    optimizer_of(state).load_state_dict(optimizer)
    if state.scheduler is not None:
        state.scheduler.load_state_dict(copy_tree(snap.scheduler, own))
    _restore_grads(model, snap.grads, copy)
    restored = {k: copy_tree(v, lambda t: t.to(device, copy=copy)) for k, v in snap.transforms_state.items()}
    for key, value in state.transforms_state.items():
        if key not in restored and key not in TRANSIENT:  # a transform added since the snapshot
            restored[key] = value
    _rng.restore(snap.rng)
    stopped = None if snap.stopped is None else Stopped(snap.stopped["step"], snap.stopped["reason"])
    data_state = None if snap.data_state is None else copy_tree(snap.data_state, own)
    return state.replace(transforms_state=restored, stopped=stopped, data_state=data_state, **snap.counters)


def _into(target: Any, value: Any, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """``target`` (a live tensor) if ``value`` can be copied into it (a plain tensor of the
    same shape and dtype; the copy is added to ``copies``), else ``value``."""
    if (isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor) and target is not value
            and target.shape == value.shape and target.dtype == value.dtype
            and not is_dtensor(target) and not is_dtensor(value) and target.layout == torch.strided):
        copies.append((target, value))
        return target
    return value


def copy_all(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``target.copy_(value)`` for each pair, without autograd; copies into CPU tensors are
    spread over the calling thread and the file threads (``_tensorfiles.in_parallel``; torch's copy releases the GIL),
    each view of a storage copied once."""
    seen: set[Any] = set()
    unique = []
    for target, value in copies:
        key = view_key(target)
        if key is None or key not in seen:
            seen.add(key)
            unique.append((target, value))
    parallel = [(t, v) for t, v in unique if t.device.type == "cpu"]
    with torch.no_grad():
        for target, value in unique:
            if target.device.type != "cpu":
                target.copy_(value)
    if sum(t.numel() * t.element_size() for t, _ in parallel) < _PARALLEL_COPY_BYTES:
        _copy_part(parallel)
        return
    parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(WORKERS)]
    sizes = [0] * len(parts)
    for target, value in sorted(parallel, key=lambda pair: -pair[0].numel() * pair[0].element_size()):
        i = sizes.index(min(sizes))  # the largest first, each to the least loaded thread
        parts[i].append((target, value))
        sizes[i] += target.numel() * target.element_size()
    in_parallel(_copy_part, [part for part in parts if part])


def _copy_part(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():  # grad mode is per thread
        for target, value in pairs:
            target.copy_(value)


def _into_live(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any],
               own: Callable[[torch.Tensor], torch.Tensor],
               copies: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """``saved`` (an optimizer's state dict) with each state tensor to be copied into the
    optimizer's own tensor of the same parameter and key when that has the same shape and
    dtype (added to ``copies``; ``load_state_dict`` then keeps it), and the others passed
    through ``own``."""
    live = optimizer.state_dict()["state"]

    def into(index: Any, key: Any, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return copy_tree(value, own)
        target = live.get(index, {}).get(key)
        kept = _into(target, value, copies)
        if kept is not value:
            return kept
        if (isinstance(target, torch.Tensor) and target is not value and target.shape == value.shape
                and target.dtype == value.dtype):  # a DTensor of a sharded state's optimizer
            with torch.no_grad():
                target.copy_(value)
            return target
        return own(value)

    state = {index: {key: into(index, key, value) for key, value in entry.items()}
             for index, entry in saved["state"].items()}
    return {**copy_tree({k: v for k, v in saved.items() if k != "state"}, own), "state": state}


def _restore_grads(model: torch.nn.Module, grads: Mapping[str, torch.Tensor], copy: bool) -> None:
    for name, p in model.named_parameters():
        saved = grads.get(clean_name(name))
        if saved is None:
            p.grad = None
            continue
        g = saved.to(device=p.device, dtype=p.dtype, copy=copy)
        if p.grad is not None:
            p.grad.copy_(g)
        else:
            p.grad = g


def restore(state: TrainState, snap: Snapshot) -> TrainState:
    """Puts ``snap`` back into ``state`` in place and returns the restored record.

    Copies parameters, buffers and optimizer state into the state's tensors (on its
    device), loads the scheduler and ``extra`` states, sets open-window gradients, the
    transforms' states, the counters and the global RNG states. The snapshot stays intact
    and can be restored again. Transform state the snapshot lacks (a transform added since)
    keeps the state's own entry.

    Args:
        state: a state with the same model architecture, optimizer type and parameter
            groups, scheduler type and ``extra`` names as the one snapshotted.
        snap: from ``af.snapshot``.

    Returns:
        TrainState: ``state`` with the snapshot's counters and transform states.

    Raises:
        TypeError: arguments of the wrong types.
        CheckpointError: the snapshot holds values no state could take (a negative
            counter, an RNG state of the wrong size), or does not fit the state (the message
            lists every missing, unexpected or mismatched key, shape, dtype and value of
            another kind than the state's); nothing was changed.
    """
    verify(state, snap)
    return put(state, snap, copy=True)
