"""The launch environment, read in this one place, and the transforms a launch adds to a program.

``torchrun`` (and so ``accelfn launch``) sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; ``accelfn launch`` also sets
``ACCELFN_BACKEND``, ``ACCELFN_PRECISION``, ``ACCELFN_ACCUMULATE``, ``ACCELFN_SHARD_PARAMS``,
``ACCELFN_COMPILE`` and
``ACCELFN_TIMEOUT_S``. Other engines (Slurm's ``srun``, ``mpirun``, Kubeflow) set variables of
their own, mapped to the same world by ``engines.py``. Nothing else in accelfn reads the
environment.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Mapping

import attrs

from accelfn.distributed.engines import detect
from accelfn.errors import LaunchError
from accelfn.step import Step
from accelfn.transforms import (
    Accumulate,
    Compile,
    DeepSpeed,
    Replicate,
    ShardParams,
    WithPrecision,
    accumulate,
    shard_params,
    with_precision,
)
from accelfn.transforms import compile as compile_transform
from accelfn.transforms.precision import POLICY_NAMES

DEFAULT_TIMEOUT_S = 600.0
BACKEND_NAMES = ("cpu", "cuda", "xla")
#: set by ``accelfn launch`` beside ``ACCELFN_PRECISION``: where the policy came from
PRECISION_FROM_ENV = "ACCELFN_PRECISION_FROM"
#: ``accelfn plan``: the world size (and processes per node) to plan for; ``run`` then prints the plan
PLAN_WORLD_SIZE_ENV, PLAN_LOCAL_WORLD_SIZE_ENV = "ACCELFN_PLAN_WORLD_SIZE", "ACCELFN_PLAN_LOCAL_WORLD_SIZE"

#: ``accelfn launch --shard-params`` without options
SHARD_PARAMS_DEFAULTS = "defaults"
#: the options of ``shard_params`` a launch may set, and how each value is read
_SHARD_OPTIONS = {"reshard_after_forward": "bool", "offload": "bool", "reduce_every_micro_batch": "bool",
                  "shard_size": "size"}


def parse_shard_params(text: str) -> ShardParams:
    """The ``shard_params`` transform a launch asks for: ``"defaults"`` (``shard_params()``)
    or options as ``name=value`` pairs separated by commas, e.g.
    ``"shard_size=node,reshard_after_forward=false"``; options: ``reshard_after_forward``,
    ``offload``, ``reduce_every_micro_batch`` (true/false) and ``shard_size`` (an int,
    ``node`` or ``all``). Module units are the script's business (``units`` is not an option).

    Raises:
        ValueError: an unknown option, a pair without ``=``, or a value the option refuses.
    """
    if text.strip() == SHARD_PARAMS_DEFAULTS:
        return shard_params()
    options: dict[str, object] = {}
    for pair in text.split(","):
        name, sep, value = (part.strip() for part in pair.partition("="))
        if not sep or name not in _SHARD_OPTIONS:
            raise ValueError(f"shard_params={text!r}: {pair.strip()!r} is not an option; give {SHARD_PARAMS_DEFAULTS!r} "
                             f"or name=value pairs separated by commas, names: {', '.join(_SHARD_OPTIONS)}")
        lowered = value.lower()
        if _SHARD_OPTIONS[name] == "bool":
            if lowered not in ("true", "false", "1", "0"):
                raise ValueError(f"shard_params={text!r}: {name}={value!r} must be true or false")
            options[name] = lowered in ("true", "1")
        else:
            options[name] = None if lowered == "all" else "node" if lowered == "node" else _size(text, value)
    try:
        return shard_params(**options)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise ValueError(f"shard_params={text!r}: {e}") from None


def _size(text: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"shard_params={text!r}: shard_size={value!r} must be an int, node or all") from None


@attrs.frozen
class LaunchEnv:
    """Where this process stands in the launched world.

    Attributes:
        rank: global rank, 0..world_size-1.
        local_rank: rank on this node.
        world_size: number of processes in all.
        local_world_size: number of processes on this node.
        master_addr, master_port: the rendezvous address of rank 0 (None in one process).
        backend: the backend requested by ``accelfn launch --backend`` (None: choose).
        precision: the policy requested by ``accelfn launch --precision`` (None: the script's).
        accumulate: the micro-batches per update requested by ``accelfn launch --accumulate``
            (None: the script's).
        compile: ``accelfn launch --compile``: add ``af.compile()`` when the script has none.
        timeout_s: collective timeout in seconds (process groups never wait forever).
        precision_from: where ``accelfn launch`` took ``precision`` from: ``"--precision"``
            or the launch config file's path (None: ``ACCELFN_PRECISION`` was set by hand).
        engine: what started this process and set the values above: ``"torchrun"``
            (``accelfn launch``), ``"slurm"``, ``"openmpi"``, ``"mpich"``, ``"kubeflow"``, or
            ``"none"`` (one process); see ``accelfn/distributed/engines.py``.
        engine_vars: the engine's variables the world was read from, ``(name, value)`` pairs.
        shard_params: ``accelfn launch --shard-params``: the ``shard_params`` transform for
            scripts that set none (it replaces a script's ``replicate()``); None: the script's.
        plan_world_size, plan_local_world_size: set by ``accelfn plan``: ``run`` prints the plan
            for this many processes (that many per node) and exits without training.
        agent_store: torchrun's agent hosts the workers' store at ``master_addr:master_port``
            (``TORCHELASTIC_USE_AGENT_STORE``), so rank 0 hosts none.
        debug_collectives: ``ACCELFN_DEBUG_COLLECTIVES=1``: every collective is first checked
            across ranks (function, op, shape, dtype), a mismatch named on every rank at once
            (``accelfn.distributed.ops``), and torch's ``TORCH_DISTRIBUTED_DEBUG`` is DETAIL.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    backend: str | None = None
    precision: str | None = None
    accumulate: int | None = None
    compile: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    precision_from: str | None = None
    engine: str = "none"
    engine_vars: tuple[tuple[str, str], ...] = ()
    shard_params: ShardParams | None = None
    plan_world_size: int | None = None
    plan_local_world_size: int | None = None
    deepspeed: str | None = None
    agent_store: bool = False
    debug_collectives: bool = False

    @property
    def env_rendezvous(self) -> bool:
        """Whether ``MASTER_ADDR``/``MASTER_PORT`` (and torchrun's store) are in the
        environment for ``init_method="env://"``: launched by torchrun; another engine's
        address is passed to ``torch.distributed`` as ``tcp://`` instead."""
        return self.engine == "torchrun"

    @property
    def planned_world_size(self) -> int:
        """The world this process stands for: ``accelfn plan``'s planned processes (it is their
        rank 0, so a script sizes what it sizes for the launch it plans; its collectives stay
        those of its one process: nothing else runs), else the launch's ``world_size``."""
        return self.plan_world_size or self.world_size

    @property
    def planned_local_world_size(self) -> int:
        """The processes per node of :attr:`planned_world_size`'s world."""
        if self.plan_world_size is None:
            return self.local_world_size
        return min(self.plan_local_world_size or self.plan_world_size, self.plan_world_size)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LaunchEnv:
        """Reads and checks the launch variables.

        The world (rank, sizes, rendezvous address) comes from the first launch engine whose
        variables are set: torchrun, Slurm, Open MPI, MPICH, Kubeflow (``engines.detect``).

        Raises:
            LaunchError: a variable that is not a number, ``RANK`` without ``WORLD_SIZE``
                (or the reverse), an engine's variables incomplete, a rank outside the world,
                a multi-process world without a rendezvous address, an engine that says
                several processes while the one detected says one, an unknown backend or
                precision name, an accumulation count below 1, a compile flag other than
                1/0/true/false (or a collectives debug flag other than those), a ``shard_params``
                spec that does not parse, or a timeout that
                is not > 0; the message names the variable
                and how the process should be started.
        """
        env = os.environ if environ is None else environ
        world = detect(env)
        backend = env.get("ACCELFN_BACKEND") or None
        if backend is not None and backend not in BACKEND_NAMES:
            raise LaunchError(f"ACCELFN_BACKEND={backend!r}: accepted values are {', '.join(BACKEND_NAMES)}")
        precision = env.get("ACCELFN_PRECISION") or None
        if precision is not None and precision not in POLICY_NAMES:
            raise LaunchError(f"ACCELFN_PRECISION={precision!r}: accepted values are {', '.join(POLICY_NAMES)}")
        accumulate = _int(env, "ACCELFN_ACCUMULATE", 0) if env.get("ACCELFN_ACCUMULATE") else None
        if accumulate is not None and accumulate < 1:
            raise LaunchError(f"ACCELFN_ACCUMULATE={accumulate} must be >= 1 micro-batches per update")
        sharded = None
        if env.get("ACCELFN_SHARD_PARAMS"):
            try:
                sharded = parse_shard_params(env["ACCELFN_SHARD_PARAMS"])
            except ValueError as e:
                raise LaunchError(f"ACCELFN_SHARD_PARAMS: {e}") from None
        compile_flag = env.get("ACCELFN_COMPILE", "").strip().lower()
        if compile_flag not in ("", "0", "1", "true", "false"):
            raise LaunchError(f"ACCELFN_COMPILE={compile_flag!r} must be 1 or 0 (true or false)")
        debug_flag = env.get("ACCELFN_DEBUG_COLLECTIVES", "").strip().lower()
        if debug_flag not in ("", "0", "1", "true", "false"):
            raise LaunchError(f"ACCELFN_DEBUG_COLLECTIVES={debug_flag!r} must be 1 or 0 (true or false)")
        plan_world = _int(env, PLAN_WORLD_SIZE_ENV, 0) or None
        plan_local = _int(env, PLAN_LOCAL_WORLD_SIZE_ENV, 0) or None
        if plan_world is not None and (plan_world < 1 or world.world_size > 1):
            raise LaunchError(f"{PLAN_WORLD_SIZE_ENV}={plan_world}: `accelfn plan` runs one process planning for "
                              "N >= 1 processes; use `accelfn plan --nproc-per-node N script.py`")
        deepspeed_config = env.get("ACCELFN_DEEPSPEED") or None
        if deepspeed_config is not None:
            try:
                json.loads(deepspeed_config)
            except ValueError as e:
                raise LaunchError(f"ACCELFN_DEEPSPEED must hold a DeepSpeed config as JSON ({e}); set it with "
                                  "`accelfn launch --deepspeed ds_config.json`") from e
        return cls(
            rank=world.rank, local_rank=world.local_rank, world_size=world.world_size,
            local_world_size=world.local_world_size, master_addr=world.master_addr, master_port=world.master_port,
            backend=backend, precision=precision, accumulate=accumulate,
            compile=compile_flag in ("1", "true"), timeout_s=timeout_from_env(env, DEFAULT_TIMEOUT_S),
            precision_from=(env.get(PRECISION_FROM_ENV) or None) if precision is not None else None,
            engine=world.engine, engine_vars=world.taken, shard_params=sharded,
            plan_world_size=plan_world, plan_local_world_size=plan_local,
            deepspeed=deepspeed_config, debug_collectives=debug_flag in ("1", "true"),
            agent_store=world.engine == "torchrun" and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        )


def timeout_from_env(env: Mapping[str, str], default: float) -> float:
    """``ACCELFN_TIMEOUT_S`` in seconds, or ``default`` when it is not set.

    Raises:
        LaunchError: not a number, or not a finite number > 0.
    """
    timeout_s = _float(env, "ACCELFN_TIMEOUT_S", default)
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise LaunchError(f"ACCELFN_TIMEOUT_S={timeout_s:g} must be a finite number of seconds > 0")
    return timeout_s


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not an integer") from None


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        return float(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not a number") from None


def launcher_environment(backend: str | None) -> dict[str, str]:
    """Settings ``accelfn launch`` gives torchrun itself for workers of ``backend``.

    torchrun (torch 2.4+) hands restarted workers the rendezvous store of the failed
    attempt, whose stale process-group keys make the new group hang or fail
    (pytorch/pytorch#167288); without sharing it, every attempt gets a fresh store.
    torch_xla's own rendezvous (``xla://``) serves a store at ``MASTER_PORT`` itself, which
    would collide with an unshared torchrun store, so XLA keeps torchrun's default.
    """
    if backend == "xla":
        return {}
    return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def with_launch_defaults(step: Step, env: LaunchEnv, *, warn: bool) -> Step:
    """``step`` with the transforms ``accelfn launch --precision/--accumulate/--shard-params/
    --compile`` asked for, added where the script set none of that kind (``--shard-params``
    replaces the script's ``replicate()``: the launch chooses sharded over data parallel). A
    script's own transform wins, with a warning (when ``warn``: the main process, once per
    job) where it differs from the launch's."""
    if env.precision is not None:
        present = step.find(WithPrecision)
        if present is None:
            step = with_precision(env.precision)(step)
        elif present.policy.name != env.precision and warn:
            origin = env.precision_from
            asked = (f"accelfn launch --precision {env.precision}" if origin == "--precision"
                     else f"ACCELFN_PRECISION={env.precision}" if origin is None
                     else f"precision: {env.precision} in the launch config {origin}")
            _overridden(asked, f"with_precision({present.policy.name!r})")
    if env.accumulate is not None:
        window = step.find(Accumulate)
        if window is None:
            step = accumulate(env.accumulate)(step)
        elif window.num_micro_batches != env.accumulate and warn:
            _overridden(f"accelfn launch --accumulate {env.accumulate}", f"accumulate({window.num_micro_batches})")
    if env.shard_params is not None:
        sharded = step.find(ShardParams)
        if sharded is None:  # data parallel by replicate(), or not at all: sharded instead
            step = attrs.evolve(step, transforms=tuple(t for t in step.transforms if not isinstance(t, Replicate)))
            step = env.shard_params(step)
        elif sharded != env.shard_params and warn:
            _overridden(f"accelfn launch --shard-params ({env.shard_params!r})", repr(sharded))
    if env.deepspeed is not None:
        step = _with_deepspeed(step, env.deepspeed, warn=warn)
    if env.compile and step.find(Compile) is None:  # the script's own compile(...) refines it
        step = compile_transform()(step)
    return step


def _with_deepspeed(step: Step, config_json: str, *, warn: bool) -> Step:
    """``step`` with the launch's ``af.deepspeed`` in place of its ``replicate()``; a script's
    own ``deepspeed(...)`` or ``shard_params(...)`` wins (with a warning when ``warn``)."""
    own = step.find(DeepSpeed) or step.find(ShardParams)
    if own is not None:
        if warn and not (isinstance(own, DeepSpeed) and own.config_json == config_json):
            _overridden("accelfn launch --deepspeed", f"{own.verb}(...)")
        return step
    kept = tuple(t for t in step.transforms if not isinstance(t, Replicate))
    return DeepSpeed(config_json)(attrs.evolve(step, transforms=kept))


def _overridden(asked: str, script: str) -> None:
    # _overridden <- with_launch_defaults <- Backend.prepare <- its caller (run, or the script)
    warnings.warn(f"{asked} is overridden by the script's {script}", stacklevel=4)
