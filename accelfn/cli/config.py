"""The launch configuration of ``accelfn launch``: a frozen record, stored as YAML.

``accelfn config`` writes it, ``accelfn launch`` and ``accelfn test`` read it, ``accelfn
env`` shows it; ``precedence.py`` merges the flags, the environment and the files into the
config in effect. The record is (de)structured by one private cattrs converter, so a new
field cannot be forgotten in the file format, and an unknown key in a file is an error
rather than a silently ignored typo.
"""

from __future__ import annotations

import math
import os
import re
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import cattrs
import yaml

from accelfn.distributed.env import BACKEND_NAMES, DEFAULT_TIMEOUT_S, parse_shard_params
from accelfn.errors import LaunchError
from accelfn.transforms.deepspeed import OFFLOAD_DEVICES, STAGES, launch_config
from accelfn.transforms.precision import POLICY_NAMES

#: the file ``accelfn config`` writes and ``accelfn launch`` reads when no ``--config`` is given
DEFAULT_CONFIG_FILE = Path("accelfn.yaml")
RDZV_BACKENDS = ("c10d", "etcd", "etcd-v2", "static")


def _at_least(minimum: int) -> Any:
    def check(instance: object, attribute: attrs.Attribute, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{attribute.name} must be an int, got {value!r}")
        if value < minimum:
            raise ValueError(f"{attribute.name}={value!r}: must be >= {minimum}")

    return check


def _one_of(names: tuple[str, ...]) -> Any:
    def check(instance: object, attribute: attrs.Attribute, value: str | None) -> None:
        if value is not None and value not in names:
            raise ValueError(f"{attribute.name}={value!r}: accepted values are {', '.join(names)}")

    return check


def _port(instance: object, attribute: attrs.Attribute, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ValueError(f"master_port={value!r}: must be a TCP port, an int in 1..65535")


def _gpu_ids(instance: object, attribute: attrs.Attribute, value: str | None) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise TypeError(f"gpu_ids must be a string such as \"0,1\" or \"all\", got {value!r}")
    if not _GPU_IDS.fullmatch(value):
        raise ValueError(f"gpu_ids={value!r}: must be \"all\" or GPU ids separated by commas, such as \"0,1\" "
                         "(CUDA_VISIBLE_DEVICES's syntax: indices or GPU-/MIG- UUIDs, no spaces)")


_GPU_ID = r"(?:\d+|(?:GPU|MIG)-[A-Za-z0-9-]+)"  # an index, or a GPU-/MIG- UUID
_GPU_IDS = re.compile(rf"all|(?:{_GPU_ID}(?:,{_GPU_ID})*)?")  # "" hides every GPU


def _shard_spec(instance: object, attribute: attrs.Attribute, value: str | None) -> None:
    if value is not None:
        if not isinstance(value, str):
            raise TypeError(f"shard_params must be a string such as \"defaults\" or \"shard_size=node\", got {value!r}")
        parse_shard_params(value)  # ValueError naming the option


def _boolean(instance: object, attribute: attrs.Attribute, value: bool) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{attribute.name} must be true or false, got {value!r}")


#: torchrun's rendezvous settings ``timeout_s`` sets (``join_timeout``, or ``timeout`` for static and etcd)
_TIMEOUT_KEYS = ("timeout", "join_timeout")


def rdzv_settings(text: str) -> dict[str, str]:
    """``rdzv_conf``'s ``key=value`` pairs, separated by commas, as a dict.

    Raises:
        ValueError: a pair without ``=`` or with an empty key, or a key ``timeout_s`` sets.
    """
    settings: dict[str, str] = {}
    for pair in text.split(","):
        key, sep, value = (part.strip() for part in pair.partition("="))
        if not sep or not key:
            raise ValueError(f"rdzv_conf={text!r}: {pair.strip()!r} is not key=value; give torchrun's rendezvous "
                             "settings as key=value pairs separated by commas, e.g. last_call_timeout=2")
        if key in _TIMEOUT_KEYS:
            raise ValueError(f"rdzv_conf={text!r}: {key} is the wait for every node to join, which --timeout-s "
                             "(timeout_s) sets; leave it out of rdzv_conf")
        settings[key] = value
    return settings


def _rdzv_settings(instance: object, attribute: attrs.Attribute, value: str | None) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise TypeError(f"rdzv_conf must be a string of key=value pairs, got {value!r}")
    rdzv_settings(value)


def _address(instance: object, attribute: attrs.Attribute, value: str | None) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise TypeError(f"{attribute.name} must be a string HOST:PORT, got {value!r}")
    host, _, port = value.removeprefix("http://").rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{attribute.name}={value!r}: must be HOST:PORT (a TCP port in 1..65535), e.g. "
                         "node0:29510")


def lighthouse_url(address: str) -> str:
    """``HOST:PORT`` (or ``http://HOST:PORT``) as the URL torchft's clients take."""
    return address if address.startswith("http://") else f"http://{address}"


def nnodes_range(text: str) -> tuple[int | None, int]:
    """``--nnodes``' value: ``"N"`` -> ``(None, N)``, ``"MIN:MAX"`` -> ``(MIN, MAX)``.

    Raises:
        ValueError: neither form, a count below 1, or MIN above MAX.
    """
    low, sep, high = text.strip().partition(":")
    try:
        counts = (int(low), int(high)) if sep else (None, int(low))
    except ValueError:
        raise ValueError(f"nnodes={text!r}: must be a number of nodes N, or MIN:MAX for an elastic job "
                         "(e.g. 1:4)") from None
    least, most = counts
    if most < 1 or (least is not None and not 1 <= least <= most):
        raise ValueError(f"nnodes={text!r}: must be N >= 1, or MIN:MAX with 1 <= MIN <= MAX")
    return least, most


def _positive_seconds(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"timeout_s={value!r}: must be a finite number of seconds > 0")


@attrs.frozen(kw_only=True)
class LaunchConfig:
    """How ``accelfn launch`` starts a job (the options of ``torch.distributed.run``).

    Attributes:
        nproc_per_node: worker processes on this node (one per GPU for CUDA).
        nnodes: nodes in the job; of an elastic job (``min_nnodes``), the most.
        min_nnodes: the fewest nodes an elastic job trains on (``--nnodes MIN:MAX``; the
            config key ``nnodes: "MIN:MAX"`` or ``min_nnodes: MIN``): torchrun's c10d
            rendezvous admits nodes that join and drops nodes that die, restarting the
            workers at the new world size; None: a job of exactly ``nnodes`` nodes.
        node_rank: this node's rank, 0..nnodes-1 (static rendezvous: with ``master_addr``).
        master_addr: the address of node 0 (static rendezvous), None on one node.
        master_port: a free TCP port on node 0; None on one node picks a free port.
        rdzv_endpoint: ``host:port`` of a c10d rendezvous (instead of master address/port).
        rdzv_backend: the rendezvous backend used with ``rdzv_endpoint``.
        rdzv_id: the job id every node of a ``rdzv_endpoint`` rendezvous shares.
        rdzv_conf: more settings of torchrun's rendezvous, ``key=value`` pairs separated by
            commas (``last_call_timeout=2,keep_alive_interval=1``: how long a re-rendezvous
            waits for more nodes once it has ``min_nnodes``, how often nodes say they live);
            the wait for nodes to join is ``timeout_s``'s; None: torchrun's defaults.
        max_restarts: restarts of the whole worker group after a failure (an elastic job's
            survivors restart after a node is lost: give at least 1).
        replica_group: this launch's replica group under ``af.tolerate_faults``, 0..N-1
            (``ACCELFN_REPLICA_GROUP`` for the workers); None: not a replica group.
        lighthouse: ``host:port`` of torchft's lighthouse the replica groups meet at
            (``TORCHFT_LIGHTHOUSE`` for the workers).
        serve_lighthouse: this launch runs the lighthouse itself, on ``lighthouse``'s port, for
            as long as it runs (the other groups' launches take its address).
        backend: ``"cpu"``, ``"cuda"`` or ``"xla"`` for ``af.backends.auto()``; None: choose.
        precision: a policy name (``"bf16"``, ...) added when the script sets none; None: the script's.
        accumulate: micro-batches per optimizer update, ``af.accumulate(n)`` added when the
            script sets none; None: the script's.
        compile: add ``af.compile()`` (``torch.compile`` with its defaults) when the script
            sets none.
        gpu_ids: the GPUs the workers may use, ``"0,1"`` (set as ``CUDA_VISIBLE_DEVICES``),
            or ``"all"`` (``CUDA_VISIBLE_DEVICES`` removed); None: the environment's.
        timeout_s: seconds a collective (and process group creation) may wait for a rank.
        shard_params: ``af.shard_params`` for scripts that set none, replacing their
            ``replicate()``: ``"defaults"``, or options such as ``"shard_size=node,offload=false"``
            (see ``accelfn.distributed.env.parse_shard_params``); None: the script's.
        deepspeed_config_file: a DeepSpeed JSON/HJSON config: ``af.deepspeed(file)`` is added
            to scripts that set none (it replaces their ``replicate()``).
        zero_stage, offload_optimizer_device, offload_param_device, gradient_accumulation_steps:
            Accelerate's DeepSpeed plugin keys; set in that config (``zero_optimization.stage``,
            ``...offload_optimizer.device``, ``...offload_param.device``,
            ``gradient_accumulation_steps``) over the file's values, or in an empty config.
    """

    nproc_per_node: int = attrs.field(default=1, validator=_at_least(1))
    nnodes: int = attrs.field(default=1, validator=_at_least(1))
    min_nnodes: int | None = attrs.field(default=None, validator=attrs.validators.optional(_at_least(1)))
    node_rank: int = attrs.field(default=0, validator=_at_least(0))
    master_addr: str | None = None
    master_port: int | None = attrs.field(default=None, validator=_port)
    rdzv_endpoint: str | None = None
    rdzv_backend: str = attrs.field(default="c10d", validator=_one_of(RDZV_BACKENDS))
    rdzv_id: str = "accelfn"
    rdzv_conf: str | None = attrs.field(default=None, validator=_rdzv_settings)
    max_restarts: int = attrs.field(default=0, validator=_at_least(0))
    replica_group: int | None = attrs.field(default=None, validator=attrs.validators.optional(_at_least(0)))
    lighthouse: str | None = attrs.field(default=None, validator=_address)
    serve_lighthouse: bool = attrs.field(default=False, validator=_boolean)
    backend: str | None = attrs.field(default=None, validator=_one_of(BACKEND_NAMES))
    precision: str | None = attrs.field(default=None, validator=_one_of(POLICY_NAMES))
    accumulate: int | None = attrs.field(default=None, validator=attrs.validators.optional(_at_least(1)))
    compile: bool = attrs.field(default=False, validator=_boolean)
    gpu_ids: str | None = attrs.field(default=None, validator=_gpu_ids)
    timeout_s: float = attrs.field(default=DEFAULT_TIMEOUT_S, validator=_positive_seconds)
    shard_params: str | None = attrs.field(default=None, validator=_shard_spec)
    deepspeed_config_file: str | None = None
    zero_stage: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.in_(STAGES)))
    offload_optimizer_device: str | None = attrs.field(default=None, validator=_one_of(OFFLOAD_DEVICES))
    offload_param_device: str | None = attrs.field(default=None, validator=_one_of(OFFLOAD_DEVICES))
    gradient_accumulation_steps: int | None = attrs.field(default=None,
                                                          validator=attrs.validators.optional(_at_least(1)))

    def check(self) -> None:
        """Checks that the fields make a launchable job together.

        Raises:
            LaunchError: ``node_rank`` outside ``nnodes``; several nodes without
                ``master_addr``/``master_port`` or ``rdzv_endpoint``; both given; a master
                address without a port.
        """
        if self.min_nnodes is not None and self.min_nnodes > self.nnodes:
            raise LaunchError(f"--nnodes {self.min_nnodes}:{self.nnodes}: the fewest nodes ({self.min_nnodes}) is "
                              f"more than the most ({self.nnodes})")
        if self.elastic:
            self._check_elastic()
        if self.serve_lighthouse and self.lighthouse is None:
            raise LaunchError("--serve-lighthouse runs the lighthouse on the port of --lighthouse HOST:PORT; give "
                              "--lighthouse too (HOST: this machine, as the other replica groups reach it)")
        if self.node_rank >= self.nnodes:
            raise LaunchError(
                f"--node-rank {self.node_rank} is outside --nnodes {self.nnodes} "
                f"(node ranks are 0..{self.nnodes - 1})"
            )
        static = self.master_addr is not None or self.master_port is not None
        if static and self.rdzv_endpoint is not None:
            raise LaunchError(
                "give either --master-addr/--master-port (static rendezvous) or "
                f"--rdzv-endpoint, not both (got {self.master_addr}:{self.master_port} and "
                f"{self.rdzv_endpoint})"
            )
        if self.nnodes == 1 and self.master_addr is not None and self.master_port is None:
            raise LaunchError(
                f"--master-addr {self.master_addr} needs --master-port too; on one node, leave both "
                "out to let the OS pick a free port"
            )
        if self.nnodes > 1 and self.rdzv_endpoint is None and (self.master_addr is None or self.master_port is None):
            raise LaunchError(
                f"--nnodes {self.nnodes} needs the address of node 0 on every node: "
                "--master-addr HOST --master-port PORT --node-rank R, or --rdzv-endpoint HOST:PORT"
            )

    @property
    def elastic(self) -> bool:
        """Whether the job's nodes may come and go (``--nnodes MIN:MAX`` with MIN < MAX)."""
        return self.min_nnodes is not None and self.min_nnodes < self.nnodes

    @property
    def nnodes_arg(self) -> str:
        """torchrun's ``--nnodes``: ``"N"``, or ``"MIN:MAX"`` for an elastic job."""
        return f"{self.min_nnodes}:{self.nnodes}" if self.elastic else str(self.nnodes)

    def _check_elastic(self) -> None:
        where = f"--nnodes {self.nnodes_arg}"
        if self.rdzv_endpoint is None or self.rdzv_backend == "static":
            raise LaunchError(
                f"{where}: an elastic job meets at a dynamic rendezvous that admits nodes as they come and go: give "
                "--rdzv-endpoint HOST:PORT (the same on every node, HOST one that outlives the others: the "
                "rendezvous store runs in the launcher on HOST) with --rdzv-backend c10d, not --master-addr/"
                "--master-port (a static rendezvous of a fixed number of nodes)")
        if self.max_restarts < 1:
            raise LaunchError(
                f"{where}: when a node is lost, the survivors' workers fail and restart at the smaller world size, "
                "which takes a restart: give --max-restarts K (K >= 1: how many losses the job survives; a node "
                "joining restarts the workers without counting)")

    def torchrun_args(self, *, loopback_port: int | None = None) -> list[str]:
        """The ``torch.distributed.run`` options for this job (the script comes after them).

        One node without a port or endpoint rendezvous at ``127.0.0.1:loopback_port``, the
        store this process hosts on loopback (``accelfn/cli/_loopback.py``; the OS picked the
        port, so two jobs on one machine never collide), with ``--local-addr 127.0.0.1`` so
        the workers' store is on loopback too; without ``loopback_port``, ``--standalone``
        (a c10d rendezvous on ``localhost:0``, whose store listens on every interface).
        ``timeout_s`` also bounds the rendezvous, the wait for every node to join (torchrun's
        own default is 600 s): ``--rdzv-conf timeout=`` for the static and etcd rendezvous,
        ``join_timeout=`` for c10d and etcd-v2, in whole seconds, rounded up.

        Raises:
            LaunchError: see :meth:`check`.
        """
        self.check()
        args = ["--nnodes", self.nnodes_arg, "--nproc-per-node", str(self.nproc_per_node),
                "--max-restarts", str(self.max_restarts)]
        seconds = math.ceil(self.timeout_s)
        extra = "".join(f",{k}={v}" for k, v in rdzv_settings(self.rdzv_conf).items()) if self.rdzv_conf else ""
        if self.rdzv_endpoint is not None:
            key = "timeout" if self.rdzv_backend in ("static", "etcd") else "join_timeout"
            return [*args, "--rdzv-backend", self.rdzv_backend, "--rdzv-endpoint", self.rdzv_endpoint,
                    "--rdzv-id", self.rdzv_id, "--rdzv-conf", f"{key}={seconds}{extra}"]
        if self.master_port is None and loopback_port is not None:
            return [*args, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{loopback_port}",
                    "--rdzv-id", self.rdzv_id, "--local-addr", "127.0.0.1", "--rdzv-conf",
                    f"join_timeout={seconds}{extra}"]
        if self.master_port is None:
            return [*args, "--standalone", "--rdzv-conf", f"join_timeout={seconds}{extra}"]
        return [*args, "--master-addr", self.master_addr or "127.0.0.1", "--master-port", str(self.master_port),
                "--node-rank", str(self.node_rank), "--rdzv-conf", f"timeout={seconds}{extra}"]

    def deepspeed_config(self) -> str | None:
        """The DeepSpeed config the workers add (JSON), or None when no DeepSpeed key is set.

        Raises:
            LaunchError: ``deepspeed_config_file`` is not a readable JSON/HJSON config.
        """
        try:
            return launch_config(self.deepspeed_config_file, zero_stage=self.zero_stage,
                                 offload_optimizer_device=self.offload_optimizer_device,
                                 offload_param_device=self.offload_param_device,
                                 gradient_accumulation_steps=self.gradient_accumulation_steps)
        except (TypeError, ValueError) as e:
            raise LaunchError(f"the DeepSpeed launch config: {e}") from e

    def worker_env(self) -> dict[str, str | None]:
        """The variables ``accelfn launch`` (and ``af.launch``) set for the workers (names in
        ``WORKER_ENV``, and ``LAUNCHER_SET_ENV`` listing the ``ACCELFN_*`` ones among them):
        ``LaunchEnv.from_env`` reads the ``ACCELFN_*`` ones, CUDA the GPU list. A value of
        None removes the variable (``gpu_ids="all"``); a field that is None sets nothing."""
        env: dict[str, str | None] = {WORKER_ENV["timeout_s"]: f"{self.timeout_s:g}",
                                      WORKER_ENV["compile"]: "1" if self.compile else "0"}
        for name in ("backend", "precision", "accumulate", "shard_params"):
            value = getattr(self, name)
            if value is not None:
                env[WORKER_ENV[name]] = str(value)
        deepspeed = self.deepspeed_config()
        if deepspeed is not None:
            env[DEEPSPEED_ENV] = deepspeed
        if self.gpu_ids is not None:
            env[WORKER_ENV["gpu_ids"]] = None if self.gpu_ids == "all" else self.gpu_ids
        if self.replica_group is not None:
            env[WORKER_ENV["replica_group"]] = str(self.replica_group)
        if self.lighthouse is not None:
            env[WORKER_ENV["lighthouse"]] = lighthouse_url(self.lighthouse)
        # told apart from the user's settings by a launch started inside a worker
        env[LAUNCHER_SET_ENV] = "".join(f"{name}={value}\n" for name, value in env.items() if value is not None
                                        and (name.startswith("ACCELFN_") or name == WORKER_ENV["lighthouse"]))
        return env


#: the launch options passed to the workers as environment variables, by field; the same
#: variables, set in the environment of ``accelfn launch``, override the config files
WORKER_ENV = {"timeout_s": "ACCELFN_TIMEOUT_S", "backend": "ACCELFN_BACKEND", "precision": "ACCELFN_PRECISION",
              "accumulate": "ACCELFN_ACCUMULATE", "compile": "ACCELFN_COMPILE", "gpu_ids": "CUDA_VISIBLE_DEVICES",
              "shard_params": "ACCELFN_SHARD_PARAMS", "replica_group": "ACCELFN_REPLICA_GROUP",
              "lighthouse": "TORCHFT_LIGHTHOUSE"}
#: Kubeflow's variables for torchrun (``PET_*``: torchrun's own option names; Trainer v2's, and a
#: v1 PyTorchJob's ``elasticPolicy``: ``PET_NNODES=MIN:MAX`` with a c10d endpoint), read as
#: launch options below the variables of ``WORKER_ENV`` (not passed to workers)
ENGINE_ENV = {"nproc_per_node": "PET_NPROC_PER_NODE", "nnodes": "PET_NNODES", "node_rank": "PET_NODE_RANK",
              "master_addr": "PET_MASTER_ADDR", "master_port": "PET_MASTER_PORT",
              "rdzv_endpoint": "PET_RDZV_ENDPOINT", "rdzv_backend": "PET_RDZV_BACKEND", "rdzv_id": "PET_RDZV_ID",
              "max_restarts": "PET_MAX_RESTARTS"}
#: the DeepSpeed config (JSON) ``accelfn launch --deepspeed`` gives its workers
DEEPSPEED_ENV = "ACCELFN_DEEPSPEED"
#: set by ``accelfn launch`` for its workers: the ``ACCELFN_*`` variables of ``WORKER_ENV`` it
#: set itself, as ``NAME=value`` lines. A launch started inside a worker (a sweep driver, an
#: evaluation job) does not take a variable that still holds the value listed here as a
#: setting of its own: it passes the outer launch's options to its workers, it is not the user's.
LAUNCHER_SET_ENV = "ACCELFN_LAUNCHER_SET"


def launcher_set(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables (name: value) an outer ``accelfn launch`` set for this process
    (``LAUNCHER_SET_ENV``) that still hold the value it gave them."""
    listed = dict(line.partition("=")[::2] for line in environ.get(LAUNCHER_SET_ENV, "").splitlines() if "=" in line)
    return {name: value for name, value in listed.items() if environ.get(name) == value}


def _strict(kind: type, accepted: tuple[type, ...]) -> Any:
    """A structure hook that checks a YAML value's type instead of coercing it (cattrs'
    own hooks call ``int(value)``, turning 2.5 into 2, true into 1, and "two" into a
    ValueError that names no key); ``float`` fields take ints too."""

    def structure(value: Any, _: type) -> Any:
        if isinstance(value, bool) is not (kind is bool) or not isinstance(value, accepted):
            raise TypeError(_kind_name(value))
        return kind(value)

    return structure


def _kind_name(value: Any) -> str:
    """How YAML calls the type of ``value``."""
    names = {bool: "a boolean", int: "an int", float: "a float", str: "a string", type(None): "null",
             list: "a list", dict: "a mapping"}
    return names.get(type(value), type(value).__name__)


def _expected(kind: Any) -> str:
    """What a field of type ``kind`` takes, in words: ``int | None`` -> "an int or null"."""
    words = {int: "an int", float: "a number", str: "a string", bool: "true or false", type(None): "null"}
    options = typing.get_args(kind) or (kind,)
    return " or ".join(words.get(option, getattr(option, "__name__", str(option))) for option in options)


_converter = cattrs.Converter(forbid_extra_keys=True)
_converter.register_structure_hook(int, _strict(int, (int,)))
_converter.register_structure_hook(float, _strict(float, (int, float)))
_converter.register_structure_hook(str, _strict(str, (str,)))
_converter.register_structure_hook(bool, _strict(bool, (bool,)))


def to_yaml(config: LaunchConfig) -> str:
    """``config`` as a YAML document, every field named (None fields as ``null``)."""
    return yaml.safe_dump(_converter.unstructure(config), sort_keys=False)


def from_yaml(text: str, *, source: str = "<string>") -> LaunchConfig:
    """Parses a YAML launch config; missing keys take their defaults (see :func:`_parse`).

    Raises:
        LaunchError: see :func:`_parse`.
    """
    return _parse(text, source=source)[0]


def _parse(text: str, *, source: str = "<string>") -> tuple[LaunchConfig, frozenset[str]]:
    """Parses a YAML launch config and the keys it sets; missing keys take their defaults.

    Values are not coerced: ``nproc_per_node: 2.5``, ``true`` or ``two`` is an error, as is
    ``rdzv_id: 7`` (quote it: ``"7"``); an int is taken where a number of seconds is asked.

    Raises:
        LaunchError: not YAML, not a mapping, an unknown key, a value of the wrong type or
            out of range; the message names ``source``, the key, the value and what it
            must be.
    """
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        raise LaunchError(f"{source} is not valid YAML: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise LaunchError(f"{source} must hold a mapping of launch options, got {type(data).__name__}")
    known = {f.name for f in attrs.fields(LaunchConfig)}
    unknown = sorted(set(map(str, data)) - known)
    if unknown:
        raise LaunchError(f"{source}: unknown launch option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    if isinstance(data.get("nnodes"), str):  # an elastic job's range, as --nnodes takes it
        if data.get("min_nnodes") is not None:
            raise LaunchError(f"{source}: nnodes={data['nnodes']!r} gives the fewest nodes, and min_nnodes="
                              f"{data['min_nnodes']!r} gives them again; keep one")
        try:
            least, most = nnodes_range(data["nnodes"])
        except ValueError as e:
            raise LaunchError(f"{source}: {e}") from None
        data = {**data, "nnodes": most, "min_nnodes": least}
    try:
        return _converter.structure(data, LaunchConfig), frozenset(map(str, data))
    except (ValueError, TypeError) as e:  # a validator of LaunchConfig: it names the key
        raise LaunchError(f"{source}: {e}") from None
    except cattrs.ClassValidationError as e:  # a value of the wrong type (see _strict)
        raise LaunchError(f"{source}: {'; '.join(_type_errors(e, data))}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, refusing a key given twice (YAML 1.2 forbids it; PyYAML
    would silently keep the last value), and reading ``1:2`` as the string it is in YAML 1.2
    (an elastic ``nnodes: 1:2``), not YAML 1.1's base-60 integer 62."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice; keep one", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_INT = "tag:yaml.org,2002:int"
#: PyYAML's int pattern without YAML 1.1's base 60 (``1:2`` is 62 there)
_DECIMAL_INT = re.compile(r"""^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$""")
_UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, _DECIMAL_INT if tag == _INT else pattern) for tag, pattern in resolvers]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def _type_errors(error: cattrs.ClassValidationError, data: dict[str, Any]) -> list[str]:
    """``key=value: must be <type>, got <type>`` for each value of the wrong type."""
    with_notes, without = error.group_exceptions()
    problems = [str(e) for e in without]
    for exc, note in with_notes:
        name = getattr(note, "name", str(note))
        value = data.get(name)
        options = typing.get_args(note.type) or (note.type,)
        hint = " (quote it to make it a string)" if str in options and isinstance(value, (int, float)) else ""
        problems.append(f"{name}={_shown(value)}: must be {_expected(note.type)}, got {exc}{hint}")
    return problems


def _shown(value: Any) -> str:
    """``value`` as YAML writes the scalars whose Python repr differs (true, false, null)."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value)


def load(path: str | os.PathLike[str]) -> LaunchConfig:
    """Reads the launch config at ``path``.

    Raises:
        LaunchError: the file is missing or invalid (see :func:`from_yaml`).
    """
    return from_yaml(_read(Path(path)), source=str(path))


def _read(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise LaunchError(
            f"cannot read the launch config {path}: {e.strerror}; write one with `accelfn config`"
        ) from None
    return text


def save(config: LaunchConfig, path: str | os.PathLike[str]) -> Path:
    """Writes ``config`` to ``path`` as YAML (atomically: a temporary file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(to_yaml(config), encoding="utf-8")
    os.replace(tmp, path)
    return path


def merge(config: LaunchConfig, **overrides: Any) -> LaunchConfig:
    """``config`` with the given fields replaced (flags given on the command line)."""
    try:
        return attrs.evolve(config, **overrides)
    except (ValueError, TypeError) as e:
        raise LaunchError(str(e)) from None
