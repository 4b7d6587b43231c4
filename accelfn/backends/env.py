"""The launch environment, read in this one place, and the transforms a launch adds to a program.

``torchrun`` (and so ``accelfn launch``) sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; ``accelfn launch`` also sets
``ACCELFN_BACKEND``, ``ACCELFN_PRECISION``, ``ACCELFN_ACCUMULATE``, ``ACCELFN_COMPILE`` and
``ACCELFN_TIMEOUT_S``. Nothing else in
accelfn reads the environment.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Mapping

import attrs

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
    with_precision,
)
from accelfn.transforms import compile as compile_transform
from accelfn.transforms.precision import POLICY_NAMES

DEFAULT_TIMEOUT_S = 600.0
BACKEND_NAMES = ("cpu", "cuda", "xla")
#: set by ``accelfn launch`` beside ``ACCELFN_PRECISION``: where the policy came from
PRECISION_FROM_ENV = "ACCELFN_PRECISION_FROM"


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
    deepspeed: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LaunchEnv:
        """Reads and checks the launch variables.

        Raises:
            LaunchError: a variable that is not a number, ``RANK`` without ``WORLD_SIZE``
                (or the reverse), a rank outside the world, a multi-process world without
                ``MASTER_ADDR``/``MASTER_PORT``, an unknown backend or precision name, an
                accumulation count below 1, a compile flag other than 1/0/true/false, or a
                timeout that is not > 0; the message names the variable and how the process
                should be started.
        """
        env = os.environ if environ is None else environ
        given = [k for k in ("RANK", "WORLD_SIZE") if k in env]
        if len(given) == 1:
            missing = "WORLD_SIZE" if given == ["RANK"] else "RANK"
            raise LaunchError(
                f"{given[0]} is set but {missing} is not; start workers with `accelfn launch` "
                "(or torchrun), which sets both, or unset both to run one process"
            )
        world_size = _int(env, "WORLD_SIZE", 1)
        rank = _int(env, "RANK", 0)
        local_rank = _int(env, "LOCAL_RANK", rank)
        local_world_size = _int(env, "LOCAL_WORLD_SIZE", world_size)
        if world_size < 1:
            raise LaunchError(f"WORLD_SIZE={world_size} must be >= 1")
        if not 0 <= rank < world_size:
            raise LaunchError(f"RANK={rank} is outside the world of WORLD_SIZE={world_size} (0..{world_size - 1})")
        if not 1 <= local_world_size <= world_size:
            raise LaunchError(f"LOCAL_WORLD_SIZE={local_world_size} must be in 1..WORLD_SIZE={world_size}")
        if not 0 <= local_rank < local_world_size:
            raise LaunchError(f"LOCAL_RANK={local_rank} is outside LOCAL_WORLD_SIZE={local_world_size}")
        addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
        if world_size > 1 and (not addr or not port):
            raise LaunchError(
                f"WORLD_SIZE={world_size} but MASTER_ADDR/MASTER_PORT are not set; start workers "
                "with `accelfn launch --nproc-per-node N script.py`"
            )
        backend = env.get("ACCELFN_BACKEND") or None
        if backend is not None and backend not in BACKEND_NAMES:
            raise LaunchError(f"ACCELFN_BACKEND={backend!r}: accepted values are {', '.join(BACKEND_NAMES)}")
        precision = env.get("ACCELFN_PRECISION") or None
        if precision is not None and precision not in POLICY_NAMES:
            raise LaunchError(f"ACCELFN_PRECISION={precision!r}: accepted values are {', '.join(POLICY_NAMES)}")
        accumulate = _int(env, "ACCELFN_ACCUMULATE", 0) if env.get("ACCELFN_ACCUMULATE") else None
        if accumulate is not None and accumulate < 1:
            raise LaunchError(f"ACCELFN_ACCUMULATE={accumulate} must be >= 1 micro-batches per update")
        compile_flag = env.get("ACCELFN_COMPILE", "").strip().lower()
        if compile_flag not in ("", "0", "1", "true", "false"):
            raise LaunchError(f"ACCELFN_COMPILE={compile_flag!r} must be 1 or 0 (true or false)")
        deepspeed_config = env.get("ACCELFN_DEEPSPEED") or None
        if deepspeed_config is not None:
            try:
                json.loads(deepspeed_config)
            except ValueError as e:
                raise LaunchError(f"ACCELFN_DEEPSPEED must hold a DeepSpeed config as JSON ({e}); set it with "
                                  "`accelfn launch --deepspeed ds_config.json`") from e
        return cls(
            rank=rank, local_rank=local_rank, world_size=world_size, local_world_size=local_world_size,
            master_addr=addr, master_port=_int(env, "MASTER_PORT", 0) if port else None,
            backend=backend, precision=precision, accumulate=accumulate,
            compile=compile_flag in ("1", "true"), timeout_s=timeout_from_env(env, DEFAULT_TIMEOUT_S),
            precision_from=(env.get(PRECISION_FROM_ENV) or None) if precision is not None else None,
            deepspeed=deepspeed_config,
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
    """``step`` with the transforms ``accelfn launch --precision/--accumulate/--compile``
    asked for, added where the script set none of that kind. A script's own transform
    wins, with a warning (when ``warn``: the main process, once per job) where it differs
    from the launch's."""
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
