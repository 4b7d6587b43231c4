"""What ``deepspeed()`` does to a model: a DeepSpeed engine built from the TrainState (the
``Engine`` model phase), and the engine's state as accelfn's checkpoints hold it
(``CheckpointView``).

The phase hands the state's model, optimizer and scheduler to ``deepspeed.initialize`` with
the configuration ``engine_config`` fills in from the program (accumulation, clipping,
precision, micro-batch size). The TrainState keeps the same model object (DeepSpeed
partitions a stage-3 model's parameters in place) and the same optimizer (DeepSpeed points
its groups at its fp32 partitions); the engine is kept on the model (``engine_of``), where
the step function (``backends._deepspeed``) and the checkpoint code find it.

DeepSpeed is imported on first use: it is an optional dependency (``accelfn[deepspeed]``),
installed after torch with ``pip install --no-build-isolation deepspeed``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch

from accelfn.distributed.phases import ModelPhase
from accelfn.errors import CheckpointError
from accelfn.state import ENGINE_OWNED, OPTIMIZER_VIEW
from accelfn.step import Step
from accelfn.transforms import Clip
from accelfn.transforms.deepspeed import DeepSpeed, engine_config, micro_batches_per_update

if TYPE_CHECKING:
    from accelfn.distributed.phases import Preparation

#: the attribute of a model prepared with ``deepspeed()`` that holds its engine
ENGINE_ATTRIBUTE = "_accelfn_deepspeed_engine"


def import_deepspeed() -> Any:
    """The ``deepspeed`` module.

    Raises:
        NotImplementedError: DeepSpeed is not installed.
    """
    try:
        import deepspeed
    except ImportError as e:
        raise NotImplementedError(
            f"af.deepspeed(...) needs DeepSpeed, which is not installed here ({e}); install it after torch, "
            "against it: `pip install --no-build-isolation deepspeed` (docs/15), or use af.shard_params() "
            "(FSDP2) instead"
        ) from e
    return deepspeed


#: torch optimizers whose update of each element reads only that element's gradient and state
#: (and the step count): stepping them on ZeRO's flat partitions is the same update as on the
#: whole parameters, so accelfn lets DeepSpeed's ZeRO take them (``zero_allow_untested_optimizer``)
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.Adadelta, torch.optim.Rprop, torch.optim.ASGD,
)


def optimizer_options(optimizer: torch.optim.Optimizer, config: Mapping[str, Any]) -> dict[str, Any]:
    """The config entries ZeRO needs for ``optimizer``: ``{"zero_allow_untested_optimizer":
    True}`` for an elementwise torch optimizer DeepSpeed has not listed as tested (SGD,
    RMSprop, ...: its update on ZeRO's flat partitions is exactly the whole-parameter one);
    nothing for DeepSpeed's tested ones and its own optimizers (DeepSpeed checks those), at
    ZeRO stage 0, or where ``config`` sets the key.

    Raises:
        TypeError: at ZeRO stage 1-3, an optimizer that is neither tested by DeepSpeed nor
            elementwise (LBFGS, Adafactor, Muon, a subclass with its own ``step``...): ZeRO
            steps it on flat 1-D partitions of the parameters, which changes the update of an
            optimizer that reads a parameter's shape or whole tensor.
    """
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS  # (its checker logs through a process group)

    stage = config.get("zero_optimization", {}).get("stage", 0)
    if (stage == 0 or "zero_allow_untested_optimizer" in config or type(optimizer) in ZERO_SUPPORTED_OPTIMIZERS
            or type(optimizer).__module__.startswith("deepspeed.")):  # DeepSpeed's own: its checks speak for them
        return {}
    if type(optimizer) in ELEMENTWISE_OPTIMIZERS:
        return {"zero_allow_untested_optimizer": True}
    raise TypeError(
        f"deepspeed() with ZeRO stage {stage}: DeepSpeed has not tested {type(optimizer).__name__} with ZeRO, "
        "which steps the optimizer on flat 1-D partitions of the parameters, and accelfn does not know it to "
        "update each element on its own (as torch's Adam, AdamW, Adagrad, SGD, RMSprop, Adamax, NAdam, RAdam, "
        "Adadelta, Rprop and ASGD do). An optimizer that reads a parameter's shape or whole tensor (LBFGS, "
        "Adafactor, Muon, LAMB's per-parameter trust ratio) would compute another update. Use one of those, "
        "ZeRO stage 0, or af.shard_params(); if you know yours is elementwise, set "
        "\"zero_allow_untested_optimizer\": true in the DeepSpeed config")


def engine_of(model: torch.nn.Module) -> Any:
    """The DeepSpeed engine ``model`` was prepared with, or None."""
    return getattr(model, ENGINE_ATTRIBUTE, None)


def partitions_parameters(model: torch.nn.Module) -> bool:
    """True when ``model`` was prepared with ZeRO stage 3 (its forward all-gathers parameters)."""
    engine = engine_of(model)
    return engine is not None and engine.zero_optimization_stage() == 3


def window_size(step: Step, spec: DeepSpeed) -> int:
    """The micro-batches of an update: ``accumulate``'s, else the config's
    ``gradient_accumulation_steps``, else 1."""
    return micro_batches_per_update(step)


#: DeepSpeed's defaults of the ``zero_optimization`` entries the partition rule reads
#: (``deepspeed/runtime/zero/config.py``)
ZERO_DEFAULTS = {"stage3_param_persistence_threshold": 100_000, "stage3_model_persistence_threshold": sys.maxsize,
                 "sub_group_size": 1_000_000_000}
#: ZeRO-1/2 pad each flat group to a multiple of 2 x world size elements (``nccl_start_alignment_factor``)
ALIGNMENT_FACTOR = 2


@attrs.frozen
class ZeroPartition:
    """The elements one rank holds under a ZeRO stage (``zero_partition``), by kind.

    Attributes:
        params: elements of the model's parameters on this rank: every parameter whole (stage
            0-2), or each one's partition of ``ceil(numel / W)`` elements (``ds_tensor``) plus
            the whole of the persistent ones (stage 3: ``stage3_param_persistence_threshold``).
        grads: elements of the gradients the rank keeps: whole (stage 0-1) or its partition.
        masters: ``(optimizer group, elements)`` of each flat fp32 partition the optimizer
            steps, one per (sub-)group (empty at stage 0: it steps the parameters themselves).
        partitions: at stage 3, the elements of the rank's parameter partitions (``ds_tensor``;
            what ``offload_param`` moves off the device).
    """

    params: int
    grads: int
    masters: tuple[tuple[int, int], ...]
    partitions: int = 0


def zero_partition(params: list[int], groups: list[list[int]], *, config: Mapping[str, Any],
                   world_size: int) -> ZeroPartition:
    """What each rank holds under ``config``'s ZeRO stage on ``world_size`` ranks: DeepSpeed's
    rules, read from its ``stage_1_and_2.py`` and ``stage3.py`` (the same on every rank).

    Args:
        params: every parameter's number of elements, in ``model.named_parameters()`` order.
        groups: each optimizer group's trainable parameters' numbers of elements, in order.
        config: the engine's configuration (``engine_config``).
        world_size: the data-parallel ranks ZeRO partitions over.

    Stage 1/2: each group flattened and padded to a multiple of ``2 W`` elements, cut into
    ``W`` equal partitions; its fp32 copy steps. Stage 3: each parameter padded to a multiple
    of ``W`` and cut (``ceil(numel / W)`` per rank); a parameter of at most
    ``stage3_param_persistence_threshold`` elements is also kept whole on every rank; each
    group's partitions flattened into sub-groups of ``sub_group_size`` elements. The fp32
    master partitions are a copy at every stage, also of fp32 parameters (stage 3 means to
    share them then, but compares a ``torch.device`` with a device name, which never matches).
    """
    zero = {**ZERO_DEFAULTS, **config.get("zero_optimization", {})}
    stage, W = int(zero.get("stage", 0)), world_size
    total = sum(params)
    if stage == 0:
        return ZeroPartition(total, total, ())
    if stage in (1, 2):
        alignment = ALIGNMENT_FACTOR * W
        flat = tuple((i, -(-sum(g) // alignment) * alignment // W) for i, g in enumerate(groups) if sum(g))
        trainable = sum(sum(g) for g in groups)
        return ZeroPartition(total, trainable if stage == 1 else sum(n for _, n in flat), flat)
    persistent, whole = 0, 0
    for numel in params:  # DeepSpeedZeRoOffload.mark_persistent_parameters
        if numel + persistent > zero["stage3_model_persistence_threshold"]:
            continue
        if numel <= zero["stage3_param_persistence_threshold"]:
            persistent += numel
            whole += numel
    parts = [-(-n // W) for n in params]
    masters: list[tuple[int, int]] = []
    for i, group in enumerate(groups):
        held = 0
        for numel in group:  # DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups
            held += -(-numel // W)
            if held >= zero["sub_group_size"]:
                masters.append((i, held))
                held = 0
        if held:
            masters.append((i, held))
    return ZeroPartition(sum(parts) + whole, sum(n for _, n in masters), tuple(masters), partitions=sum(parts))


def offloaded(config: Mapping[str, Any]) -> tuple[bool, bool]:
    """``(optimizer state, parameter partitions)`` offloaded off the device by ``config``
    (``offload_optimizer``/``offload_param`` to ``"cpu"`` or ``"nvme"``)."""
    zero = config.get("zero_optimization", {})
    optimizer, param = (zero.get(f"offload_{what}", {}).get("device", "none") != "none"
                        for what in ("optimizer", "param"))
    return optimizer, param


class Engine(ModelPhase):
    """``deepspeed()``'s model phase: a DeepSpeed engine built from the TrainState (once per
    model), which places, partitions and wraps the model itself (``engine``: ``prepare``
    neither places nor wraps it). The engine is kept on the model (:func:`engine_of`), where
    the step function and the checkpoint code find it.
    """

    name: ClassVar[str] = "deepspeed"

    def __init__(self, spec: DeepSpeed):
        self.spec = spec
        self.config: dict[str, Any] = {}

    @classmethod
    def of(cls, prep: Preparation) -> Engine | None:
        spec = prep.step.find(DeepSpeed)
        return None if spec is None else cls(spec)

    def check(self, prep: Preparation) -> None:
        """Raises NotImplementedError where DeepSpeed is not installed; TypeError for an optimizer
        ZeRO would change the update of (:func:`optimizer_options`); ValueError when the model
        was prepared with another DeepSpeed configuration before, or a config ``engine_config``
        refuses."""
        import_deepspeed()
        self.config = engine_config(self.spec, num_micro_batches=window_size(prep.step, self.spec),
                                    clip=prep.step.find(Clip), precision=prep.policy.name, micro_batch_size=1,
                                    world_size=prep.hardware.world_size, scaling=prep.policy.scaling)
        self.config.update(optimizer_options(prep.state.optimizer, self.config))
        engine = engine_of(prep.state.model)
        if engine is not None and engine._accelfn_config != json.dumps(self.config, sort_keys=True):  # noqa: SLF001
            raise ValueError(
                "this state's model was prepared with another DeepSpeed configuration (or other accumulate/"
                "clip/precision transforms); an engine is built once per model: give the step the transforms "
                "it was prepared with, or build the state again (a new model and optimizer)"
            )

    def apply(self, prep: Preparation) -> None:
        state = prep.state
        engine = engine_of(state.model)
        if engine is None:
            deepspeed = import_deepspeed()
            groups = [list(group["params"]) for group in state.optimizer.param_groups]  # before DeepSpeed's flat ones
            deepspeed.init_distributed(dist_backend="gloo" if prep.hardware.device.type == "cpu" else "nccl",
                                       auto_mpi_discovery=False, verbose=False)
            engine, _, _, _ = deepspeed.initialize(model=state.model, optimizer=state.optimizer,
                                                   lr_scheduler=state.scheduler, config=self.config)
            object.__setattr__(state.model, ENGINE_ATTRIBUTE, engine)  # not a submodule: the engine holds the model
            setattr(state.model, ENGINE_OWNED, True)
            setattr(state.model, OPTIMIZER_VIEW, CheckpointView(engine, state.optimizer, state.model, groups,
                                                                 self.config))
            engine._accelfn_config = json.dumps(self.config, sort_keys=True)  # noqa: SLF001  # ours
        prep.engine = engine
        prep.forward_is_collective = prep.hardware.world_size > 1 and engine.zero_optimization_stage() == 3


class CheckpointView:
    """The state of a DeepSpeed engine as accelfn's checkpoints hold it: whole fp32 tensors in
    torch's formats, never DeepSpeed's own (pickled) checkpoint files.

    Set on the model (``OPTIMIZER_VIEW``), it is what snapshots read and restore as the
    optimizer: ``param_groups`` over the model's own parameters (in the user's order) and a
    ``state_dict`` of whole per-parameter states, gathered from DeepSpeed's partitions with
    ``deepspeed.utils.safe_get_full_optimizer_state`` (and put back with its setter), the
    step count from the optimizer's own state. The model's ``state_dict`` holds the fp32
    master weights (``safe_get_full_fp32_param``: whole, also at ZeRO stage 3), and loading
    one sets the masters and the model's own (low-precision or partitioned) copies. So a
    checkpoint of any stage is an unsharded accelfn checkpoint: it loads into one plain
    process, and a plain one loads here. Gathering is a collective: every rank saves, as
    ``af.save`` asks anyway.

    Refused (``CheckpointError`` naming the part): an open accumulation window (DeepSpeed
    keeps its gradients in partitioned buffers of its own) and fp16 (its loss scaler's state).
    """

    def __init__(self, engine: Any, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                 groups: list[list[torch.nn.Parameter]], config: Mapping[str, Any]):
        self._engine = engine
        self._optimizer = optimizer  # DeepSpeed's basic optimizer: its groups hold flat partitions
        self._groups = groups
        self._stage3 = engine.zero_optimization_stage() == 3
        self._fp16 = config.get("fp16", {}).get("enabled") is True
        self.open_window = False
        self._loaded: set[str] = set()
        # functions, not bound methods: torch marks its hooks with an attribute
        model.register_state_dict_post_hook(lambda *args: self._model_state_dict(*args))
        model.register_load_state_dict_pre_hook(lambda *args: self._load_model(*args))
        model.register_load_state_dict_post_hook(lambda *args: self._loaded_model(*args))

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's groups (hyperparameters as DeepSpeed's optimizer has them now) over
        the model's parameters."""
        return [{**{k: v for k, v in group.items() if k != "params"}, "params": params}
                for group, params in zip(self._optimizer.param_groups, self._groups)]

    def held_as(self, param: torch.nn.Parameter) -> torch.Tensor:
        """A meta tensor shaped as ``state_dict`` holds ``param``'s optimizer states: its whole
        fp32 master weight (at stage 3 the parameter itself is an empty partition, in bf16 runs
        a bf16 copy)."""
        shape = getattr(param, "ds_shape") if self._stage3 else param.shape
        return torch.empty(shape, dtype=torch.float32, device="meta")

    def _refuse(self) -> None:
        if self.open_window:
            raise CheckpointError(
                "deepspeed(): a checkpoint in the middle of an accumulation window cannot hold the window's "
                "gradients, which DeepSpeed keeps in partitioned buffers of its own; save after an optimizer "
                "update (af.Checkpoints saves there)")
        if self._fp16:
            raise CheckpointError(
                "deepspeed() with fp16: the state of DeepSpeed's fp16 loss scaler cannot be held in an accelfn "
                "checkpoint yet, and it is not written as a pickle; use bf16 (no loss scale) to checkpoint")

    # -- the model's state dict: whole fp32 master weights -------------------------------

    def _model_state_dict(self, module: torch.nn.Module, state_dict: dict[str, Any], prefix: str,
                          local_metadata: Any) -> None:
        from deepspeed.utils import safe_get_full_fp32_param

        self._refuse()
        for name, param in module.named_parameters():
            full = safe_get_full_fp32_param(param)
            if full is not None:
                state_dict[prefix + name] = full.detach().reshape(self.held_as(param).shape)

    def _load_model(self, module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param

        params = dict(module.named_parameters())
        values = {name: state_dict[prefix + name] for name in params if prefix + name in state_dict}
        for name, value in values.items():
            _set_full(params[name], value, None, safe_set_full_fp32_param)
        if not self._stage3:  # the model's own copies are loaded by load_state_dict itself
            return
        gathered = [params[name] for name in values]
        with deepspeed.zero.GatheredParameters(gathered, modifier_rank=0):  # re-partitioned from rank 0's
            with torch.no_grad():
                for name, value in values.items():
                    params[name].data.copy_(value.reshape(params[name].shape))
        for name in values:  # nothing left for the default loader, which would copy into the partitions
            del state_dict[prefix + name]
            self._loaded.add(prefix + name)

    def _loaded_model(self, module: torch.nn.Module, incompatible: Any) -> None:
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in self._loaded]
        self._loaded.clear()

    # -- the optimizer: whole per-parameter states in torch's format -----------------------

    def _flats(self, group: int) -> list[torch.Tensor]:
        """DeepSpeed's flat fp32 partitions of param group ``group`` (the tensors its optimizer
        state is keyed by): the group's params at stages 1-2; at stage 3 its sub-groups, which
        the group holds only while DeepSpeed steps them."""
        if not self._stage3:
            return list(self._optimizer.param_groups[group]["params"])
        z3 = self._engine.optimizer
        return [flat for i, flat in enumerate(z3.fp32_partitioned_groups_flat) if z3.sub_group_to_group_id[i] == group]

    def _flat_state(self, group: int) -> dict[str, Any]:
        flats = self._flats(group)
        return self._optimizer.state[flats[0]] if flats and flats[0] in self._optimizer.state else {}

    def _ensure_state(self, like: Mapping[str, Any]) -> None:
        """Creates the state of DeepSpeed's flat partitions where the optimizer has none yet (a
        fresh engine: torch's optimizers create it at their first step), shaped as ``like``'s
        entries, and links DeepSpeed's per-parameter views of it (ZeRO 1/2)."""
        created = False
        for group in range(len(self._optimizer.param_groups)):
            for flat in self._flats(group):
                if flat not in self._optimizer.state:
                    self._optimizer.state[flat] = {
                        k: (torch.zeros_like(flat) if v.dim() else v.clone()) if isinstance(v, torch.Tensor) else v
                        for k, v in like.items()}
                    created = True
        link = getattr(self._engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if created and link is not None:
            link()

    def state_dict(self) -> dict[str, Any]:
        """torch's ``Optimizer.state_dict`` format over the model's parameters, whole tensors."""
        from deepspeed.utils import safe_get_full_optimizer_state

        self._refuse()
        state: dict[int, dict[str, Any]] = {}
        groups = []
        index = 0
        for g, (group, params) in enumerate(zip(self.param_groups, self._groups)):
            flat = self._flat_state(g)
            keys = [k for k, v in flat.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
            scalars = {k: v for k, v in flat.items() if k not in keys}
            indices = []
            for param in params:
                entry = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()}
                for key in keys:
                    full = safe_get_full_optimizer_state(param, key)
                    entry[key] = full.detach().reshape(self.held_as(param).shape)
                if entry:
                    state[index] = entry
                indices.append(index)
                index += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": indices})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Puts whole per-parameter states (torch's format) into DeepSpeed's partitions."""
        from deepspeed.utils import safe_set_full_optimizer_state

        first = next(iter(state_dict["state"].values()), None)
        if first is not None:
            self._ensure_state(first)
        index = 0
        for g, (saved_group, params) in enumerate(zip(state_dict["param_groups"], self._groups)):
            live_group = self._optimizer.param_groups[g]
            for key, value in saved_group.items():
                if key != "params":
                    live_group[key] = value
            for param in params:
                for key, value in state_dict["state"].get(index, {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        _set_full(param, value, key, safe_set_full_optimizer_state)
                    else:  # the step count: one per flat partition, the same for its parameters
                        for flat in self._flats(g):
                            self._optimizer.state[flat][key] = value.clone() if isinstance(value, torch.Tensor) else value
                index += 1


def _set_full(param: torch.nn.Parameter, value: torch.Tensor, key: str | None, setter: Any) -> None:
    """Puts the whole fp32 ``value`` (the master weight, or the optimizer state ``key``) into
    this rank's partition of ``param``.

    At ZeRO stage 3 the partition is cut here: DeepSpeed's own setter (0.19) narrows the
    unpadded value, so a parameter with fewer elements than ranks (a bias of 1) fails on
    the ranks whose partition is padding.
    """
    value = value.to(torch.float32)
    z3 = getattr(param, "_z3_optimizer", None)
    if z3 is None or not hasattr(param, "ds_id"):
        if key is None:
            setter(param, value)
        else:
            setter(param, value, key)
        return
    if not param.requires_grad:
        return
    part, _ = z3._get_fp32_opt_state_partition(param, release_swap_buffers=False, optim_state_key=key)  # noqa: SLF001
    rank = z3._get_param_partition_rank(param)  # noqa: SLF001
    flat = value.flatten()
    padded = torch.zeros(max(flat.numel(), part.numel() * (rank + 1)), dtype=torch.float32, device=flat.device)
    padded[:flat.numel()] = flat
    with torch.no_grad():
        part.copy_(padded.narrow(0, part.numel() * rank, part.numel()))
