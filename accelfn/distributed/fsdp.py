"""What the CPU (gloo) and CUDA (NCCL) backends share for ``shard_params``: FSDP2, and the
checks of its layout across ranks and across runs of one state.

``shard_model`` applies ``torch.distributed.fsdp.fully_shard`` to the units the transform
selects, then to the root module, in place: the root module stays the same object (its
class becomes ``FSDP<Name>``), and every parameter is replaced by a new ``nn.Parameter``
holding a ``DTensor`` sharded along dim 0 over the ranks (``Shard(0)``). The optimizer the
user built over the original parameters is then pointed at the sharded ones (FSDP2 does
not do this: torchtitan builds its optimizer after sharding), and any optimizer state it
already holds (a state restored before ``prepare``) is sharded the same way.

Under ``"bf16"``/``"fp16"`` the units gather their parameters in the compute dtype for the
forwards of training only (``training_forward``: the step's forward, ``backend.autocast``);
every other forward (``af.evaluate``, a loop over ``backend.eval_batches``, generation, a
hook's own forward) gathers them in their own dtype (fp32), as an unsharded model runs
(``ShardedPrecision``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
from collections import defaultdict
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from accelfn.distributed import is_dtensor
from accelfn.distributed.ops import mark_replicas
from accelfn.distributed.phases import ModelPhase
from accelfn.distributed.process_group import leave_at_exit
from accelfn.transforms import ShardParams
from accelfn.transforms.precision import Policy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from accelfn.distributed.phases import Preparation


def fsdp2() -> ModuleType:
    """``torch.distributed.fsdp``, imported on first use (with DTensor it takes about 0.7 s,
    which a process that never shards should not pay).

    Raises:
        NotImplementedError: this torch has no FSDP2 (``fully_shard``, public from torch 2.6).
    """
    try:
        import torch.distributed.fsdp as fsdp
    except ImportError:  # pragma: no cover - a torch built without distributed
        fsdp = ModuleType("torch.distributed.fsdp")  # without fully_shard
    if not hasattr(fsdp, "fully_shard"):
        raise NotImplementedError(
            f"shard_params() needs FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6); this is "
            f"torch {torch.__version__}: upgrade torch, or use replicate()"
        )
    return fsdp


def check_available() -> None:
    """Raises NotImplementedError if this torch has no FSDP2."""
    fsdp2()


def is_sharded(model: torch.nn.Module) -> bool:
    """True when ``fully_shard`` was applied to ``model`` (a state prepared with ``shard_params``).
    Nothing is sharded before ``torch.distributed.fsdp`` is imported, so it is not imported here."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def original_class(module: torch.nn.Module) -> type:
    """The class ``module`` had before ``fully_shard`` made it an instance of FSDP's subclass of
    it (``FSDPLlamaForCausalLM`` for a ``LlamaForCausalLM``); its own class otherwise."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None or not isinstance(module, fsdp.FSDPModule):
        return type(module)
    return next(c for c in type(module).__mro__ if not issubclass(c, fsdp.FSDPModule))


def reshard(model: torch.nn.Module) -> None:
    """Frees the parameters every FSDP2 unit of ``model`` gathered and registers its shards
    again (``FSDPModule.reshard``): after forwards without a backward, as in evaluation, a
    unit with ``reshard_after_forward=False`` would otherwise keep the whole unsharded model."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return
    for module in model.modules():
        if isinstance(module, fsdp.FSDPModule):
            module.reshard()


def refresh_precision(model: torch.nn.Module) -> None:
    """Derives each FSDP2 unit's original and reduce dtypes again from its parameters that
    require gradients now (torch's private ``FSDPParamGroup._init_mp_dtypes``).

    FSDP2 derives them once, at its lazy init in the first forward, from the unit's trainable
    parameters: a unit frozen then (a frozen trunk of progressive unfreezing) keeps none, and
    after ``requires_grad_(True)`` its backward fails (torch issue pytorch/pytorch#186998; a
    plain ``fully_shard`` loop fails the same way). ``prepare`` calls this for a model that
    is sharded already (a second ``run``), so changing ``requires_grad`` between runs works.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return
    for module in model.modules():
        if isinstance(module, fsdp.FSDPModule):
            group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)  # noqa: SLF001  # torch's own
            if group is not None and hasattr(group, "_init_mp_dtypes"):
                group._init_mp_dtypes()  # noqa: SLF001  # idempotent: lazy init calls it too


def _reduce_uniform_dtype(module: torch.nn.Module) -> None:
    """Makes the reduce-scatter of ``module``'s FSDP2 unit after an accumulation window see
    one gradient dtype (torch issue pytorch/pytorch#196996).

    Under a mixed precision policy, a gradient kept across micro-batches without a reduce
    is upcast to the reduce dtype (fp32), while a parameter whose first gradient of the
    window comes in its last micro-batch (an auxiliary head, an MoE expert that the earlier
    micro-batches skipped) still has it in the compute dtype (bf16), and torch asserts
    "FSDP reduce-scatter expects uniform gradient dtype". Before the unit's post-backward
    reduces, such fresh gradients are upcast as the kept ones were (torch's own
    ``FSDPParam.to_accumulated_grad_if_needed``): the reduce-scatter runs in the reduce
    dtype either way, so the values are those of a window where every parameter was used
    from the start. (The unit's post-backward is wrapped on its instance; torch's private
    ``FSDPParamGroup``, checked to have what is used.)
    """
    group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)  # type: ignore[operator]  # noqa: SLF001
    if group is None or not all(hasattr(group, name) for name in ("post_backward", "fsdp_params", "reduce_grads")):
        return
    original = group.post_backward

    def post_backward(*unused: Any) -> Any:
        if group.reduce_grads:
            params = [p for p in group.fsdp_params if hasattr(p, "_unsharded_param")]
            if any(p.unsharded_accumulated_grad is not None for p in params):
                for param in params:
                    if param.unsharded_accumulated_grad is None:  # a fresh gradient only
                        param.to_accumulated_grad_if_needed()
        return original(*unused)

    group.post_backward = post_backward


def single_process_group(device: torch.device) -> None:
    """Makes a single-process default group where there is none (FSDP2 and DTensor need one)."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1, device_id=device if device.type == "cuda" else None)
        leave_at_exit()


def mixed_precision(policy: Policy) -> MixedPrecisionPolicy:
    """bf16/fp16 autocast policies gather parameters in the compute dtype and reduce gradients
    in fp32 (the sharded master parameters stay fp32); others use FSDP2's defaults."""
    fsdp = fsdp2()
    if policy.autocast:
        return fsdp.MixedPrecisionPolicy(param_dtype=policy.compute_dtype, reduce_dtype=torch.float32)
    return fsdp.MixedPrecisionPolicy()


#: True inside ``training_forward``: sharded models gather parameters in their training dtype
_TRAINING_FORWARD: contextvars.ContextVar[bool] = contextvars.ContextVar("accelfn_training_forward", default=False)


class training_forward:  # noqa: N801 - a context manager used like a function
    """``inner`` (``torch.autocast``) entered, and the forwards of sharded models in it run
    in their training precision (parameters gathered in the compute dtype); outside it they
    run in their parameters' own dtype. ``backend.autocast`` returns one."""

    __slots__ = ("_inner", "_token")

    def __init__(self, inner: contextlib.AbstractContextManager[Any]):
        self._inner = inner
        self._token: contextvars.Token[bool] | None = None

    def __enter__(self) -> Any:
        self._token = _TRAINING_FORWARD.set(True)
        return self._inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self._inner.__exit__(*exc)
        finally:
            assert self._token is not None
            _TRAINING_FORWARD.reset(self._token)


class ShardedPrecision:
    """The two precisions of a model sharded with a bf16/fp16 ``MixedPrecisionPolicy``: its
    training policy (parameters all-gathered in the compute dtype) and the plain one
    (gathered in their own dtype, gradients still reduced in ``reduce_dtype``).

    A forward pre-hook on the root module, ahead of FSDP2's own, picks one before each
    forward: the training policy inside ``training_forward``, else the plain one. A switch
    reshards every unit (``FSDPModule.reshard``), sets the policy on each unit's FSDP state
    and parameter group, and swaps each parameter's all-gather buffers and unsharded
    parameter for those of the other dtype (kept, with their storage freed, so that
    switching back reuses them and an open accumulation window's gradients survive).
    FSDP2 (torch 2.6 to 2.13) has no public setter for a unit's policy: this uses its
    private fields ``_get_fsdp_state()._mp_policy``, ``._fsdp_param_groups``, each group's
    ``mp_policy``/``_init_mp_dtypes()`` and each ``FSDPParam``'s ``all_gather_outputs``/
    ``_unsharded_param``; a torch without them keeps the training policy everywhere.
    No switch happens inside a backward (activation checkpointing's recomputed forwards).
    """

    def __init__(self, model: torch.nn.Module, training: MixedPrecisionPolicy):
        fsdp = fsdp2()
        self.training = training
        self.plain = dataclasses.replace(training, param_dtype=None)
        self.current = training
        self._units = [m for m in model.modules() if isinstance(m, fsdp.FSDPModule)]
        self._buffers: dict[int, dict[int, tuple[Any, Any]]] = {}  # id(policy) -> id(FSDPParam) -> buffers
        # not traced by torch.compile: it changes FSDP2's state in Python, between forwards
        model.register_forward_pre_hook(torch.compiler.disable(self._before_forward), prepend=True)

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        want = self.training if _TRAINING_FORWARD.get() else self.plain
        if want is not self.current and torch._C._current_graph_task_id() == -1:
            self.switch(want)

    def switch(self, policy: MixedPrecisionPolicy) -> None:
        """Reshards every unit and makes ``policy`` (``training`` or ``plain``) theirs."""
        for unit in self._units:
            unit.reshard()
        kept = self._buffers.setdefault(id(self.current), {})
        wanted = self._buffers.setdefault(id(policy), {})
        for unit in self._units:
            state = unit._get_fsdp_state()
            state._mp_policy = policy
            for group in state._fsdp_param_groups:
                group.mp_policy = policy
                for param in group.fsdp_params:
                    kept[id(param)] = (param.all_gather_outputs, param.__dict__.pop("_unsharded_param", None))
                    outputs, unsharded = wanted.pop(id(param), ([], None))
                    param.all_gather_outputs = outputs
                    if unsharded is not None:
                        param._unsharded_param = unsharded
                group._init_mp_dtypes()
        self.current = policy


def _switchable(model: torch.nn.Module) -> bool:
    """Whether this torch's FSDP2 has the private fields ``ShardedPrecision`` sets."""
    state = getattr(model, "_get_fsdp_state", lambda: None)()
    groups = getattr(state, "_fsdp_param_groups", None)
    return (state is not None and hasattr(state, "_mp_policy") and isinstance(groups, list)
            and all(hasattr(g, "mp_policy") and hasattr(g, "_init_mp_dtypes") for g in groups))


def shard_model(model: torch.nn.Module, optimizer: torch.optim.Optimizer, shard: ShardParams, policy: Policy,
                device_mesh: DeviceMesh, *, broadcast: bool = True) -> None:
    """Shards ``model`` in place over ``device_mesh`` and points ``optimizer`` at its sharded
    parameters.

    Rank 0's parameters and buffers are broadcast first, so every rank starts from the same
    model whatever its seed (as DDP does). The optimizer's parameters are the model's
    (``TrainState.create`` checks it), so each maps to a sharded one by its name. A model split by
    ``tensor_parallel`` first is equal on every rank already (``broadcast=False``).
    """
    names = {id(p): name for name, p in model.named_parameters()}
    on_meta = any(t.is_meta for t in model.parameters())  # materialized after sharding (_materialize)
    if broadcast and device_mesh.size() > 1 and not on_meta:
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)
    fsdp = fsdp2()
    offload = fsdp.CPUOffloadPolicy() if shard.offload else fsdp.OffloadPolicy()
    options: dict[str, Any] = dict(mesh=device_mesh, mp_policy=mixed_precision(policy), offload_policy=offload)
    for _, unit in shard.select(model):
        fsdp.fully_shard(unit, reshard_after_forward=shard.reshard_after_forward, **options)
    # The root as FSDP2 shards it by default (None): its parameters are gathered for the whole
    # forward and kept for the backward, which needs them first (no second all-gather of the
    # root per micro-batch; FSDP2 reshards it after the backward). False keeps every unit.
    fsdp.fully_shard(model, reshard_after_forward=None if shard.reshard_after_forward else False, **options)
    if policy.autocast:
        for module in model.modules():
            if isinstance(module, fsdp.FSDPModule):
                _reduce_uniform_dtype(module)
    if options["mp_policy"].param_dtype is not None and _switchable(model):
        ShardedPrecision(model, options["mp_policy"])  # plain forwards outside training
    sharded = dict(model.named_parameters())
    rebind(optimizer, {id_: sharded[name] for id_, name in names.items()})
    for param in (p for group in optimizer.param_groups for p in group["params"]):
        assert is_dtensor(param), "every optimizer parameter is sharded"


def rebind(optimizer: torch.optim.Optimizer, new: dict[int, torch.nn.Parameter]) -> None:
    """Points the param groups at the new (sharded or split) parameters and shards existing
    state tensors of a parameter's shape (Adam's moments) like their parameter; scalars
    (``step``) stay."""
    old_state = optimizer.state
    state: defaultdict[torch.Tensor, Any] = defaultdict(dict)
    for group in optimizer.param_groups:
        params = [new[id(p)] for p in group["params"]]
        for old, param in zip(group["params"], params):
            if old in old_state:
                state[param] = {k: _like(v, param) for k, v in old_state[old].items()}
        group["params"] = params
    optimizer.state = state


def _like(value: Any, param: torch.Tensor) -> Any:
    if (not isinstance(value, torch.Tensor) or is_dtensor(value) or not is_dtensor(param)
            or value.shape != param.shape):
        return value
    from torch.distributed.tensor import DTensor, distribute_tensor  # imported: param is a DTensor

    local = distribute_tensor(value.to(param.device_mesh.device_type), param.device_mesh, param.placements,
                              src_data_rank=None).to_local()
    return DTensor.from_local(local.to(param.to_local().device), param.device_mesh, param.placements,
                              shape=param.shape, stride=param.stride())


@contextlib.contextmanager
def no_gradient_sync(model: torch.nn.Module) -> Iterator[None]:
    """No reduce-scatter in this block: gradients accumulate unsharded on each rank."""
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


#: the attribute of a model sharded by ``prepare`` that holds the ShardParams it was sharded with
_SHARDED_WITH = "_accelfn_sharded_with"


def check_same_layout(model: torch.nn.Module, now: ShardParams) -> None:
    """Raises if ``now`` asks for another layout than the one ``model`` was sharded with
    (nothing for a model sharded by hand): units, resharding, offload and group size are
    fixed when a model is sharded. ``reduce_every_micro_batch`` may change.

    Raises:
        ValueError: naming the options that differ.
    """
    before = getattr(model, _SHARDED_WITH, None)
    if before is None or before is now:
        return
    names = ("units", "reshard_after_forward", "offload", "shard_size")
    differ = [name for name in names if getattr(before, name) != getattr(now, name)]
    if differ:
        shown = ", ".join(f"{name}={getattr(before, name)!r} before, {getattr(now, name)!r} now" for name in differ)
        raise ValueError(
            f"this state's model is sharded already, and shard_params() asks for another layout ({shown}); "
            "a model is sharded once: give the step the shard_params(...) it was prepared with, or build the "
            "state again (a new model and optimizer) to shard it otherwise"
        )


def remember_layout(model: torch.nn.Module, shard: ShardParams) -> None:
    """Records on ``model`` the ShardParams ``prepare`` sharded it with (see :func:`check_same_layout`)."""
    setattr(model, _SHARDED_WITH, shard)


class Shard(ModelPhase):
    """``shard_params()``'s model phase: FSDP2 over the mesh's data dimensions, after tensor
    parallelism (torchtitan's order).

    Over ``("replicate", "shard")`` when both have several ranks (hybrid sharding), else over
    ``"shard"``, with the ``context`` ranks folded into ``shard`` (``Mesh.fsdp_mesh``, as
    torchtitan's ``dp_shard_cp``: the context ranks' gradients are reduce-scattered with the
    rest); nothing is sharded on a data dimension of one rank (but with ``offload``,
    which needs FSDP even on one process). A model sharded by an earlier ``prepare`` keeps its
    layout (checked) and gets its precision refreshed.
    """

    name: ClassVar[str] = "shard_params"

    def __init__(self, spec: ShardParams | None, sharded: bool):
        self.spec = spec
        self.sharded = sharded

    @classmethod
    def of(cls, prep: Preparation) -> Shard | None:
        spec, sharded = prep.step.find(ShardParams), is_sharded(prep.state.model)
        return cls(spec, sharded) if spec is not None or sharded else None

    def unsupported(self, prep: Preparation) -> str | None:
        """The backend's refusal, or ``offload`` on the CPU (where the shards are in CPU memory already)."""
        if self.spec is not None and self.spec.offload and prep.hardware.device.type == "cpu" and not self.sharded:
            return ("shard_params(offload=True) moves sharded parameters and optimizer state from the GPU to CPU "
                    "memory; on the cpu backend they are in CPU memory already. Remove offload=True (or run on the "
                    "cuda backend)")
        return super().unsupported(prep)

    def check(self, prep: Preparation) -> None:
        """Raises ValueError for a sharded model whose step has no (or another) ``shard_params``,
        NotImplementedError for a torch without FSDP2."""
        if self.spec is None:
            raise ValueError("this state's model is sharded (it was prepared with shard_params()), so its step "
                             "must include af.shard_params() too")
        if self.sharded:
            check_same_layout(prep.state.model, self.spec)
            return
        check_available()

    def apply(self, prep: Preparation) -> None:
        model, spec = prep.state.model, self.spec
        assert spec is not None
        if prep.hardware.world_size > 1:
            mark_replicas(model)  # one model: its buffers are rank 0's where it is read
        if self.sharded:
            refresh_precision(model)  # requires_grad may have changed since (pytorch#186998)
            prep.forward_is_collective = prep.mesh.fsdp_size > 1
            return
        device_mesh = prep.mesh.fsdp_mesh(prep.hardware.device)
        if device_mesh is None and spec.offload:  # FSDP on one process, for its offloading
            single_process_group(prep.hardware.device)
            from torch.distributed.device_mesh import init_device_mesh

            device_mesh = init_device_mesh(prep.hardware.device.type, (1,), mesh_dim_names=("shard",))
        if device_mesh is not None and (prep.mesh.fsdp_size > 1 or spec.offload):
            split = prep.mesh.tensor > 1  # equal on every rank already: tensor parallelism broadcast it
            shard_model(model, prep.state.optimizer, spec, prep.policy, device_mesh, broadcast=not split)
            prep.forward_is_collective = prep.mesh.fsdp_size > 1
        remember_layout(model, spec)


# -- whole gradients of a sharded model, for invariant() under shard_params() ------------------
#
# Whole gradients of a model sharded by FSDP2, for ``invariant()`` under ``shard_params()``.
#
# FSDP2 reduce-scatters each unit's gradients inside its post-backward hook, with the
# process group's reduce-scatter (an order of additions neither fixed nor exposed, which
# also differs with the world size). Under ``invariant()`` that reduction is switched off
# (``set_requires_gradient_sync(False)``, FSDP2's own way to accumulate without
# communication): after a micro-batch's backward, every FSDP2 parameter keeps its whole
# (unsharded) gradient, which :func:`take_unsharded_grads` takes, as a replicated model's
# ``.grad``. The canonical tree sums them (``backends._invariant``); :func:`local_piece` then
# makes each parameter's gradient this rank's piece of the sum, a view of it, as a DTensor
# laid out as the parameter (``Shard(0)``: ``torch.chunk`` of dim 0, empty pieces for ranks
# past the rows, as FSDP2 and DTensor cut it).
#
# torch's private ``FSDPState._fsdp_param_groups`` / ``FSDPParam`` are read (checked to have
# what is used; a missing piece raises RuntimeError naming it).


def _fsdp_params(model: torch.nn.Module) -> dict[int, Any]:
    """Each FSDP2 parameter record of ``model``, by ``id`` of its sharded parameter."""
    fsdp = fsdp2()
    found: dict[int, Any] = {}
    for module in model.modules():
        if not isinstance(module, fsdp.FSDPModule):
            continue
        state = module._get_fsdp_state()  # noqa: SLF001  # torch's own
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            single = getattr(state, "_fsdp_param_group", None)
            groups = [single] if single is not None else []
        for group in groups:
            for record in group.fsdp_params:
                found[id(record.sharded_param)] = record
    return found


def take_unsharded_grads(model: torch.nn.Module, params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """The whole gradient of each of ``params`` (sharded parameters of ``model``) from the
    backward just run without gradient sync, in their order (None: no gradient); FSDP2's
    copy is dropped, so the next backward starts from none.

    Raises:
        RuntimeError: a parameter FSDP2 does not hold, or a torch whose FSDP2 lacks what is read.
    """
    records = _fsdp_params(model)
    out: list[torch.Tensor | None] = []
    for param in params:
        record = records.get(id(param))
        if record is None or not hasattr(record, "unsharded_accumulated_grad"):
            raise RuntimeError("invariant() with shard_params(): an optimizer parameter is not one FSDP2 shards "
                               "(or this torch's FSDP2 keeps no unsharded gradient); please report it")
        grad = record.unsharded_accumulated_grad  # set under a reduce dtype other than the parameter's
        unsharded = getattr(record, "_unsharded_param", None)
        if grad is None and unsharded is not None:
            grad = unsharded.grad
        record.unsharded_accumulated_grad = None
        if unsharded is not None:
            unsharded.grad = None
        out.append(grad)
    return out


def local_piece(whole: torch.Tensor, param: Any) -> torch.Tensor:
    """This rank's piece of ``whole`` (a whole gradient of ``param``'s global shape) as a
    DTensor laid out as ``param``, its local tensor a view of ``whole`` (in-place changes to
    ``whole`` change it).

    Raises:
        RuntimeError: ``param``'s layout is not ``Shard``/``Replicate`` pieces of this shape.
    """
    from torch.distributed.tensor import DTensor  # imported: param is a DTensor

    mesh, local = param.device_mesh, whole
    for dim, placement in enumerate(param.placements):
        if placement.is_replicate():
            continue
        if not placement.is_shard():
            raise RuntimeError(f"invariant() with shard_params(): a parameter laid out as {placement}")
        size, axis = mesh.size(dim), placement.dim
        pieces = list(torch.chunk(local, size, dim=axis))
        pieces += [local.narrow(axis, local.shape[axis], 0)] * (size - len(pieces))
        local = pieces[mesh.get_local_rank(dim)]
    with torch.no_grad():
        shard_shape = param.to_local().shape
    if local.shape != shard_shape:
        raise RuntimeError(f"invariant() with shard_params(): this rank's piece has shape {tuple(local.shape)}, "
                           f"its shard {tuple(shard_shape)}")
    return DTensor.from_local(local, mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())
