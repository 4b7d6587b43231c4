"""``deepspeed``: the model phase interpreted by a DeepSpeed engine (ZeRO stages 0-3, offload).

The user's DeepSpeed configuration (a dict, or a JSON/HJSON file) is parsed and checked
once, here; the other transforms of the program fill it in (``engine_config``), and where
the user's configuration says otherwise, composing them raises ``af.TransformError``
naming both::

    accumulate(n)       gradient_accumulation_steps: n
    clip(max_norm)      gradient_clipping: max_norm   (absent: 0.0, DeepSpeed's 1.0 never leaks in)
    with_precision(p)   "bf16": {"enabled": true} / "fp16": {"enabled": true, "loss_scale": 0}
    replicate(), shard_params(), clip_value()   refused: DeepSpeed is its own data-parallel engine

The backend builds the engine (``deepspeed.initialize``) with the TrainState's model,
optimizer and scheduler; this module never imports DeepSpeed or ``torch.distributed``.

References:
    Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
    Models", SC 2020. Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model
    Training", USENIX ATC 2021.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import attrs

from accelfn.step import Phase, TransformBase
from accelfn.transforms.accumulate import Accumulate
from accelfn.transforms.clip import Clip, ClipValue
from accelfn.transforms.invariant import Invariant
from accelfn.transforms.precision import DynamicScaling, WithPrecision
from accelfn.transforms.replicate import Replicate
from accelfn.transforms.shard_params import ShardParams
from accelfn.transforms.tensor_parallel import TensorParallel

#: ``zero_optimization.stage`` values DeepSpeed has
STAGES = (0, 1, 2, 3)
#: where ZeRO offloads optimizer state or parameters (``offload_*.device``)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
#: DeepSpeed's precision sections, by the ``with_precision`` policy each stands for
PRECISION_SECTIONS = {"bf16": "bf16", "fp16": "fp16"}
#: the entries ``engine_config`` fills in from the program's other transforms
FILLED_FROM_PROGRAM = ("gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
                       "train_micro_batch_size_per_gpu", "fp16.enabled", "bf16.enabled")


def _load(value: object) -> dict[str, Any]:
    """A config dict from a mapping or a path to a JSON/HJSON file."""
    if isinstance(value, Mapping):
        config = dict(value)
    elif isinstance(value, (str, os.PathLike)):
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"deepspeed(config={str(value)!r}): no such file; pass a dict or the path of a "
                             "DeepSpeed JSON/HJSON config file (ds_config.json)")
        text = path.read_text()
        try:
            config = json.loads(text)
        except json.JSONDecodeError as e:
            try:
                import hjson  # DeepSpeed's own config parser, installed with it
            except ImportError:
                raise ValueError(f"deepspeed(config={str(value)!r}): not valid JSON ({e}), and hjson (for "
                                 "HJSON files) is not installed") from e
            try:
                config = json.loads(json.dumps(hjson.loads(text)))
            except hjson.HjsonDecodeError as e2:
                raise ValueError(f"deepspeed(config={str(value)!r}): neither JSON nor HJSON ({e2})") from e2
        if not isinstance(config, dict):
            raise ValueError(f"deepspeed(config={str(value)!r}): the file holds a {type(config).__name__}, "
                             "not a JSON object")
    else:
        raise TypeError(f"deepspeed(config=...) takes a dict or the path of a JSON/HJSON file, got {value!r}")
    try:
        json.dumps(config)
    except (TypeError, ValueError) as e:
        raise ValueError(f"deepspeed(config=...) must hold JSON values only (numbers, strings, lists, dicts): "
                         f"{e}") from e
    return config


def _auto_paths(value: object, path: str = "") -> list[str]:
    """The dotted paths of every ``"auto"`` value in ``value`` (a JSON tree)."""
    if isinstance(value, dict):
        return [p for key, item in value.items() for p in _auto_paths(item, f"{path}.{key}" if path else str(key))]
    if isinstance(value, list):
        return [p for i, item in enumerate(value) for p in _auto_paths(item, f"{path}[{i}]")]
    return [path] if value == "auto" else []


def _describe_section(section: object) -> str:
    """``AdamW (lr=0.0003)``: a config section's type and params, for messages."""
    if not isinstance(section, dict):
        return repr(section)
    params = section.get("params")
    shown = ", ".join(f"{k}={v!r}" for k, v in params.items()) if isinstance(params, dict) else ""
    return f"{section.get('type', '?')}({shown})"


def _check_sections(config: dict[str, Any]) -> None:
    """Raises one ValueError naming every section DeepSpeed would act on behind the
    TrainState's back (``optimizer``, ``scheduler``) and every ``"auto"`` value, which only
    the Hugging Face Trainer resolves."""
    problems = []
    if "optimizer" in config:
        problems.append(
            f"the config's \"optimizer\" section ({_describe_section(config['optimizer'])}) would not be used: the "
            "TrainState's optimizer is the one handed to deepspeed.initialize, and DeepSpeed ignores the section "
            "when given one, so its hyperparameters would silently not apply. Remove the section and build that "
            "optimizer in the TrainState (a torch.optim optimizer, or DeepSpeed's own, such as "
            "deepspeed.ops.adam.DeepSpeedCPUAdam)")
    if "scheduler" in config:
        problems.append(
            f"the config's \"scheduler\" section ({_describe_section(config['scheduler'])}) would be built by "
            "DeepSpeed outside the TrainState: it would drive the learning rate while no checkpoint holds it, and "
            "a resumed run would start it again. Remove the section and give the schedule to the TrainState, e.g. "
            "af.TrainState.create(model, optimizer, scheduler=deepspeed.runtime.lr_schedules.WarmupLR(optimizer, "
            "warmup_min_lr=..., warmup_max_lr=..., warmup_num_steps=...)) or any torch.optim.lr_scheduler: "
            "DeepSpeed steps it once per applied update, and accelfn's checkpoints save and resume it")
    autos = _auto_paths({k: v for k, v in config.items() if k not in ("optimizer", "scheduler")})
    if autos:
        filled = [p for p in autos if p in FILLED_FROM_PROGRAM]
        others = [p for p in autos if p not in FILLED_FROM_PROGRAM]
        parts = []
        if filled:
            parts.append(f"remove {', '.join(filled)}: accelfn fills them from the program (accumulate, clip, "
                         "with_precision, the batch size)")
        if others:
            parts.append(f"give {', '.join(others)} numbers (or remove them for DeepSpeed's defaults)")
        problems.append(f"\"auto\" is resolved by the Hugging Face Trainer, not by DeepSpeed or accelfn; found at "
                        f"{', '.join(autos)}: " + "; ".join(parts))
    if len(problems) == 1:
        raise ValueError(f"deepspeed(config=...): {problems[0]}")
    if problems:
        names = [f'the "{k}" section' for k in ("optimizer", "scheduler") if k in config]
        names += ['"auto" values'] * bool(autos)
        raise ValueError(f"deepspeed(config=...): {' and '.join(names)} cannot be used:"
                         + "".join(f"\n- {p}" for p in problems))


def _check(config: dict[str, Any]) -> None:
    """Raises ValueError for the entries accelfn reads that hold values DeepSpeed would refuse."""
    _check_sections(config)
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ValueError(f"deepspeed(config=...): zero_optimization must be an object, got {zero!r}")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"deepspeed(config=...): zero_optimization.stage must be one of {STAGES}, got {stage!r}")
    gas = config.get("gradient_accumulation_steps")
    if gas is not None and (isinstance(gas, bool) or not isinstance(gas, int) or gas < 1):
        raise ValueError(f"deepspeed(config=...): gradient_accumulation_steps must be an int >= 1, got {gas!r}")
    clip = config.get("gradient_clipping")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                             or not math.isfinite(clip) or clip < 0):
        raise ValueError(f"deepspeed(config=...): gradient_clipping must be a finite number >= 0 (0: no "
                         f"clipping), got {clip!r}")
    for name in PRECISION_SECTIONS.values():
        section = config.get(name, {})
        if not isinstance(section, dict):
            raise ValueError(f"deepspeed(config=...): {name} must be an object such as {{\"enabled\": true}}, "
                             f"got {section!r}")
    if len(enabled_precisions(config)) > 1:
        raise ValueError("deepspeed(config=...): bf16 and fp16 are both enabled; enable at most one")


def loss_scale_options(scaling: DynamicScaling | None) -> tuple[dict[str, int], str | None]:
    """The ``fp16`` section entries that carry ``with_precision("fp16", ...)``'s loss-scale
    options to DeepSpeed's dynamic loss scaler, and the reason options that it has no
    counterpart for cannot be given (or None).

    Only the options that differ from :class:`DynamicScaling`'s defaults are carried (the
    others leave DeepSpeed's own defaults: an initial scale of 2**16, ``loss_scale_window``
    1000, ``hysteresis`` 2, ``min_loss_scale`` 1). ``init_scale`` becomes
    ``initial_scale_power`` (so it must be a power of two), ``growth_interval`` becomes
    ``loss_scale_window``; DeepSpeed's scaler always grows by 2 and backs off by 2, and its
    floor is ``fp16.min_loss_scale``.
    """
    if scaling is None:
        return {}, None
    default = DynamicScaling()
    options: dict[str, int] = {}
    if scaling.init_scale != default.init_scale:
        mantissa, exponent = math.frexp(scaling.init_scale)
        if mantissa != 0.5:
            return {}, (f"DeepSpeed's fp16 loss scale starts at a power of two (fp16.initial_scale_power); "
                        f"with_precision('fp16', init_scale={scaling.init_scale!r}) is none")
        options["initial_scale_power"] = exponent - 1
    if scaling.growth_interval != default.growth_interval:
        options["loss_scale_window"] = scaling.growth_interval
    fixed = [f"{name}={getattr(scaling, name)!r}" for name in ("growth_factor", "backoff_factor", "min_scale",
                                                               "max_consecutive_skips")
             if getattr(scaling, name) != getattr(default, name)]
    if fixed:
        return {}, (f"DeepSpeed's fp16 loss scaler grows and backs off by a factor of 2, stops at "
                    f"fp16.min_loss_scale and has no limit of skipped updates in a row; with_precision('fp16', "
                    f"{', '.join(fixed)}) cannot be given to it. Drop those options (set fp16.min_loss_scale in "
                    "the config for the floor)")
    return options, None


def enabled_precisions(config: Mapping[str, Any]) -> list[str]:
    """The policy names (``"bf16"``, ``"fp16"``) whose section ``config`` enables."""
    return [policy for policy, section in PRECISION_SECTIONS.items()
            if isinstance(config.get(section), dict) and config[section].get("enabled") is True]


@attrs.frozen
class DeepSpeed(TransformBase):
    """A DeepSpeed engine runs the model phase: ZeRO partitioning, offload, its optimizer step.

    See :func:`deepspeed`.

    Attributes:
        config_json: the user's configuration as canonical JSON (sorted keys): the record
            stays frozen and hashable; :attr:`config` reads it back as a dict.
    """

    phase: ClassVar[Phase] = Phase.MODEL
    kind: ClassVar[str] = "deepspeed"
    verb: ClassVar[str] = "deepspeed"
    couples_ranks: ClassVar[bool] = True
    engine: ClassVar[bool] = True

    config_json: str

    @property
    def config(self) -> dict[str, Any]:
        """A fresh copy of the user's configuration (changing it changes nothing here)."""
        loaded: dict[str, Any] = json.loads(self.config_json)
        return loaded

    @property
    def stage(self) -> int:
        """The ZeRO stage, ``zero_optimization.stage`` (0 when absent)."""
        return int(self.config.get("zero_optimization", {}).get("stage", 0))

    @property
    def num_micro_batches(self) -> int | None:
        """``gradient_accumulation_steps`` of the user's config, or None when absent."""
        value = self.config.get("gradient_accumulation_steps")
        return None if value is None else int(value)

    def conflicts_with(self, other: TransformBase) -> str | None:
        config = self.config
        if isinstance(other, (Replicate, ShardParams)):
            return (f"deepspeed() is its own data-parallel engine (ZeRO stage {self.stage} partitions "
                    f"and reduces over all processes); {other.verb}() would wrap the model a second time. "
                    f"Remove {other.verb}(), and choose the partitioning with zero_optimization.stage")
        if isinstance(other, (TensorParallel, Invariant)):
            return (f"deepspeed() runs the model phase in a DeepSpeed engine, which {other.verb}() cannot enter "
                    f"(its partitioning and gradient reduction are DeepSpeed's); use one of them")
        if isinstance(other, ClipValue):
            return ("DeepSpeed clips by the global gradient norm only (gradient_clipping); it has no "
                    "value clipping. Use af.clip(max_norm) instead of clip_value()")
        if isinstance(other, Accumulate):
            gas = config.get("gradient_accumulation_steps")
            if gas is not None and gas != other.num_micro_batches:
                return (f"the DeepSpeed config's gradient_accumulation_steps={gas} contradicts "
                        f"accumulate({other.num_micro_batches}); keep one of them, or make them equal")
        if isinstance(other, Clip):
            clip = config.get("gradient_clipping")
            if other.norm_type != 2.0:
                return (f"DeepSpeed clips by the 2-norm only; clip(norm_type={other.norm_type!r}) cannot be "
                        "given to it")
            if clip is not None and float(clip) != other.max_norm:
                return (f"the DeepSpeed config's gradient_clipping={clip} contradicts clip({other.max_norm}); "
                        "keep one of them, or make them equal")
        if isinstance(other, WithPrecision):
            name = other.policy.name
            if name not in ("fp32", *PRECISION_SECTIONS):
                return (f"with_precision({name!r}) has no DeepSpeed counterpart; DeepSpeed runs 'fp32', "
                        "'bf16' (its bf16 section) or 'fp16' (its fp16 section, dynamic loss scale)")
            enabled = enabled_precisions(config)
            if enabled and enabled != [name]:
                return (f"the DeepSpeed config enables {enabled[0]} ({enabled[0]}.enabled: true), which "
                        f"contradicts with_precision({name!r}); keep one of them, or make them agree")
            autocast = config.get("torch_autocast")
            if isinstance(autocast, dict) and autocast.get("enabled") is True:
                return (f"the DeepSpeed config's torch_autocast section (enabled: true) sets the precision of the "
                        f"forward, and so does with_precision({name!r}); keep one of them")
            if name == "fp16":
                return _loss_scale_conflict(config.get("fp16", {}), other)
        return None


def _loss_scale_conflict(section: Mapping[str, Any], other: WithPrecision) -> str | None:
    """Why the config's ``fp16`` section contradicts ``with_precision("fp16", ...)``, or None."""
    static = section.get("loss_scale", 0)
    if static != 0:
        return (f"the DeepSpeed config's fp16.loss_scale={static} is a static loss scale, which contradicts "
                "with_precision('fp16') (a dynamic one); set loss_scale to 0 (or leave it out), or drop "
                "with_precision and keep the config's")
    options, reason = loss_scale_options(other.policy.scaling)
    if reason is not None:
        return reason
    for key, value in options.items():
        if key in section and section[key] != value:
            return (f"the DeepSpeed config's fp16.{key}={section[key]!r} contradicts with_precision('fp16', ...)'s "
                    f"{value!r}; keep one of them, or make them equal")
    return None


def micro_batches_per_update(step: Any) -> int:
    """The micro-batches of one optimizer update of ``step`` (a Step): ``accumulate``'s ``n``,
    else a ``deepspeed()`` config's ``gradient_accumulation_steps``, else 1. The one rule the
    step functions, ``count_updates`` and ``af.plan`` count windows by."""
    accumulate, ds = step.find(Accumulate), step.find(DeepSpeed)
    if accumulate is not None:
        return int(accumulate.num_micro_batches)
    if ds is not None and ds.num_micro_batches is not None:
        return ds.num_micro_batches
    return 1


def deepspeed(config: Mapping[str, Any] | str | os.PathLike[str]) -> DeepSpeed:
    """Interprets the model phase with a DeepSpeed engine built from ``config``.

    The TrainState's model, optimizer and scheduler are handed to ``deepspeed.initialize``
    in ``backend.prepare``: ZeRO stage 1 partitions the optimizer state over the processes,
    stage 2 also the gradients, stage 3 also the parameters; ``offload_optimizer`` /
    ``offload_param`` move them to CPU memory (or NVMe). The other transforms keep their
    meaning and fill the config: ``accumulate(n)`` is ``gradient_accumulation_steps``,
    ``clip(max_norm)`` is ``gradient_clipping`` (without ``clip``, and without the entry in
    ``config``, clipping is off: DeepSpeed's own default of 1.0 is not used),
    ``with_precision("bf16"|"fp16")`` enables the ``bf16``/``fp16`` section, and
    ``train_batch_size`` is made to agree (``train_micro_batch_size_per_gpu`` is 1 unless
    ``config`` sets it: the engine is built before the loader is read, and DeepSpeed uses it
    only for its throughput log). An entry of ``config`` that contradicts one of them is
    refused when they are composed.

    Args:
        config: a DeepSpeed configuration as a dict, or the path of a JSON or HJSON file
            (``ds_config.json``). Values ``"auto"`` are not resolved: give numbers.

    Returns:
        DeepSpeed: the transform.

    Raises:
        TypeError: ``config`` is neither a mapping nor a path.
        ValueError: a path that is no file or holds no JSON/HJSON object; values that are not
            JSON; ``zero_optimization.stage`` not 0-3; ``gradient_accumulation_steps`` not an
            int >= 1; ``gradient_clipping`` not a finite number >= 0; bf16 and fp16 both
            enabled.

    Example:
        >>> import accelfn as af
        >>> af.deepspeed({"zero_optimization": {"stage": 2}}).stage
        2
    """
    loaded = _load(config)
    _check(loaded)
    return DeepSpeed(json.dumps(loaded, sort_keys=True))


def engine_config(ds: DeepSpeed, *, num_micro_batches: int, clip: Clip | None, precision: str,
                  micro_batch_size: int, world_size: int,
                  scaling: DynamicScaling | None = None) -> dict[str, Any]:
    """The configuration given to ``deepspeed.initialize``: the user's, filled in by the
    program's other transforms (composition already refused contradictions).

    Args:
        ds: the transform.
        num_micro_batches: micro-batches per optimizer update (``accumulate``'s n, else 1).
        clip: the program's ``clip``, or None.
        precision: the program's precision policy name (``"fp32"``, ``"bf16"``, ``"fp16"``).
        micro_batch_size: samples per micro-batch on each process.
        world_size: the number of processes.
        scaling: ``with_precision("fp16", ...)``'s loss-scale options, carried into the
            ``fp16`` section as :func:`loss_scale_options` says (None: DeepSpeed's defaults).

    Returns:
        dict: a new configuration (``ds.config`` is not changed).

    Raises:
        ValueError: the config's ``train_batch_size`` is not micro-batch size x
            ``num_micro_batches`` x ``world_size``; loss-scale options DeepSpeed has no
            counterpart for.
    """
    config = ds.config
    config["gradient_accumulation_steps"] = num_micro_batches
    if clip is not None:
        config["gradient_clipping"] = clip.max_norm
    config.setdefault("gradient_clipping", 0.0)  # DeepSpeed's default 1.0 would clip unasked
    if precision in PRECISION_SECTIONS:
        section = dict(config.get(PRECISION_SECTIONS[precision], {}))
        section["enabled"] = True
        if precision == "fp16":
            section.setdefault("loss_scale", 0)  # 0: dynamic, as with_precision("fp16") scales
            options, reason = loss_scale_options(scaling)
            if reason is not None:
                raise ValueError(reason)
            section.update(options)
        config[PRECISION_SECTIONS[precision]] = section
    if "train_micro_batch_size_per_gpu" not in config:
        config["train_micro_batch_size_per_gpu"] = micro_batch_size
    if "train_batch_size" in config:
        expected = config["train_micro_batch_size_per_gpu"] * num_micro_batches * world_size
        if config["train_batch_size"] != expected:
            raise ValueError(
                f"the DeepSpeed config's train_batch_size={config['train_batch_size']} is not the micro-batch "
                f"size ({config['train_micro_batch_size_per_gpu']}) x micro-batches per update "
                f"({num_micro_batches}) x processes ({world_size}) = {expected}; leave train_batch_size out "
                "(accelfn fills it in) or make it agree")
    config["train_batch_size"] = config["train_micro_batch_size_per_gpu"] * num_micro_batches * world_size
    zero = config.get("zero_optimization", {})
    if isinstance(zero, dict) and zero.get("offload_optimizer", {}).get("device", "none") != "none":
        config.setdefault("zero_force_ds_cpu_optimizer", False)  # the user's torch optimizer is kept
    return config


def launch_config(path: str | os.PathLike[str] | None, *, zero_stage: int | None = None,
                  offload_optimizer_device: str | None = None, offload_param_device: str | None = None,
                  gradient_accumulation_steps: int | None = None) -> str | None:
    """The DeepSpeed config of a launch (``accelfn launch --deepspeed FILE`` and the launch
    config's keys) as canonical JSON, or None when none of them is given: the file's
    config (or an empty one) with each given key set over it.

    Raises:
        ValueError: as :func:`deepspeed` for the file or the resulting config.
    """
    keys = (zero_stage, offload_optimizer_device, offload_param_device, gradient_accumulation_steps)
    if path is None and all(key is None for key in keys):
        return None
    config = _load(path) if path is not None else {}
    zero = dict(config.get("zero_optimization", {}))
    if zero_stage is not None:
        zero["stage"] = zero_stage
    for name, device in (("offload_optimizer", offload_optimizer_device), ("offload_param", offload_param_device)):
        if device is not None:
            zero[name] = {**zero.get(name, {}), "device": device}
    if zero:
        config["zero_optimization"] = zero
    if gradient_accumulation_steps is not None:
        config["gradient_accumulation_steps"] = gradient_accumulation_steps
    return deepspeed(config).config_json
