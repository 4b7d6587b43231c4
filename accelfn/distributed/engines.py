"""The launch engines that can start accelfn's processes, each read into one ``World``.

A cluster's own engine often starts the processes instead of ``accelfn launch``. Each
engine says where a process stands in its own variables; one small adapter per engine maps
them to a :class:`World`. ``detect`` tries them in this order, the first whose variables
are present winning::

    1  torchrun, accelfn launch   RANK, WORLD_SIZE with LOCAL_RANK or LOCAL_WORLD_SIZE
    2  Slurm (srun)               SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID,
                                  SLURM_STEP_TASKS_PER_NODE or SLURM_NTASKS_PER_NODE, the
                                  node list (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST,
                                  SLURM_NODELIST) and SLURM_JOB_ID, in a step (SLURM_STEP_ID)
    3  Open MPI (mpirun)          OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
    4  MPICH, Intel MPI (PMI)     PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS
    5  Kubeflow PyTorchJob (v1)   RANK, WORLD_SIZE without LOCAL_RANK: one process per pod

torchrun comes first because a job that runs ``accelfn launch`` inside an engine's task
(``srun accelfn launch ...``) gives its workers both sets of variables: the workers are
torchrun's. Kubeflow Trainer v2 runs torchrun itself, configured by ``PET_*`` variables;
``accelfn launch`` reads those as launch options (``accelfn/cli/precedence.py``).

The rendezvous address: ``MASTER_ADDR``/``MASTER_PORT`` where set (torchrun and Kubeflow
always set them). Otherwise Slurm's is the first host of the step's node list, and its port
``SLURM_PORT_BASE + SLURM_JOB_ID % SLURM_PORT_SPAN`` (every task of a job derives the same
one, and two jobs sharing a node get different ones, as Lightning's ``SLURMEnvironment``
does); MPI's is 127.0.0.1 when every rank is on one node (else ``MASTER_ADDR`` must be set)
and port ``MPI_DEFAULT_PORT``.

A world that looks like several processes to an engine but one to accelfn is an error, not
a silent solo run: each process would train on the whole data set alone. A launcher the
engine started as one of N (``srun accelfn launch``, a PyTorchJob pod running ``accelfn
launch``) joins the engine's job as node RANK of N instead (``placement``, read by the
launch config's precedence); one started by a batch script outside any step forms a world
of its own, on which the job's task count is no claim.

All functions here are pure: they take the environment as a mapping
(``accelfn/distributed/env.py`` is the one place that passes ``os.environ``).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Mapping

import attrs

from accelfn.errors import LaunchError

SLURM_PORT_BASE = 10000
SLURM_PORT_SPAN = 20000  # ports 10000..29999: below Linux's ephemeral range (32768..)
MPI_DEFAULT_PORT = 29500  # torch's default MASTER_PORT
LOCALHOST = "127.0.0.1"


@attrs.frozen
class World:
    """Where this process stands, as one engine said it.

    Attributes:
        engine: ``"torchrun"``, ``"slurm"``, ``"openmpi"``, ``"mpich"``, ``"kubeflow"`` or
            ``"none"`` (one process, no engine).
        rank, world_size: global rank 0..world_size-1, and processes in all.
        local_rank, local_world_size: rank on this node, and processes on this node.
        master_addr, master_port: rank 0's rendezvous address (None in one process).
        taken: the variables the values came from, as ``(name, value)`` pairs.
    """

    engine: str = "none"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    taken: tuple[tuple[str, str], ...] = ()


Adapter = Callable[[Mapping[str, str]], "World | None"]


def detect(env: Mapping[str, str]) -> World:
    """The world of the first engine of ``ENGINES`` whose variables ``env`` holds (see the
    module's docstring), else one process.

    Raises:
        LaunchError: an engine's variables are incomplete or not numbers, or another engine
            says there are several processes while the one detected (or none) says one
            (the message names the variables).
    """
    _torchrun_pair(env)
    world = next((w for w in (adapter(env) for adapter in ENGINES) if w is not None), World())
    claims = [(names, n) for names, n in _claims(env, world) if n > world.world_size]
    if claims:
        names, n = claims[0]
        seen = (f"{world.engine} says {world.world_size}" if world.engine != "none"
                else "no engine's variables place this process in it")
        if names.startswith("SLURM_") and not (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")):
            seen += " (SLURM_STEP_ID is unset: this is a batch script or an salloc shell, not a task of an srun step)"
        raise LaunchError(
            f"{names} says this job has {n} processes, but {seen}: each process would train alone on "
            "the whole data set. Start the processes with the engine so that each gets its rank "
            "(`srun python train.py` in a step of the job, `mpirun -np N python train.py`, or one "
            "`accelfn launch` per node with --nnodes/--node-rank), or run one process (`srun "
            "--ntasks=1`, or unset these variables)"
        )
    return world


def placement(env: Mapping[str, str]) -> World | None:
    """Where an engine other than torchrun placed this process, when it says the job has
    several processes: a launcher it started (``srun accelfn launch``, a Kubeflow pod whose
    command is ``accelfn launch``, ``mpirun accelfn launch``) is one node of that many.

    Returns:
        World | None: the engine's world; None for one process, where no engine's variables
        are set, or inside torchrun's workers (a launch started there is a job of its own).

    Raises:
        LaunchError: an engine's variables are incomplete or not numbers (as :func:`detect`).
    """
    if torchrun(env) is not None:
        return None
    _torchrun_pair(env)
    world = next((w for w in (adapter(env) for adapter in ENGINES) if w is not None), None)
    return world if world is not None and world.world_size > 1 else None


def _torchrun_pair(env: Mapping[str, str]) -> None:
    given = [k for k in ("RANK", "WORLD_SIZE") if k in env]
    if len(given) == 1:
        missing = "WORLD_SIZE" if given == ["RANK"] else "RANK"
        raise LaunchError(
            f"{given[0]} is set but {missing} is not; start workers with `accelfn launch` "
            "(or torchrun), which sets both, or unset both to run one process"
        )


def torchrun(env: Mapping[str, str]) -> World | None:
    """torchrun and ``accelfn launch``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``."""
    if "RANK" not in env or not ("LOCAL_RANK" in env or "LOCAL_WORLD_SIZE" in env):
        return None
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    rank, world_size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    local_rank = _int(env, "LOCAL_RANK") if env.get("LOCAL_RANK") else rank
    local_world_size = _int(env, "LOCAL_WORLD_SIZE") if env.get("LOCAL_WORLD_SIZE") else world_size
    return _world("torchrun", env, names, rank, world_size, local_rank, local_world_size, None, None)


def kubeflow(env: Mapping[str, str]) -> World | None:
    """Kubeflow's PyTorchJob (training-operator v1): ``RANK`` (the pod's index),
    ``WORLD_SIZE`` (the pods), ``MASTER_ADDR``, ``MASTER_PORT``; one process per pod, so
    each is local rank 0 of 1."""
    if "RANK" not in env:
        return None
    return _world("kubeflow", env, ("RANK", "WORLD_SIZE"), _int(env, "RANK"), _int(env, "WORLD_SIZE"), 0, 1,
                  None, None)


def slurm(env: Mapping[str, str]) -> World | None:
    """A task of a Slurm job step (``srun``).

    The batch script itself (``sbatch``; no ``SLURM_STEP_ID``) and an ``salloc`` shell are
    not tasks of a step: there a job of several tasks is an error of :func:`detect`.

    Raises:
        LaunchError: a variable missing or not a number, a node list or tasks-per-node
            list that does not parse, or no rendezvous address.
    """
    if "SLURM_PROCID" not in env or not (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")):
        return None
    _require(env, ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID"), "slurm")
    rank, world_size = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    local_rank, node = _int(env, "SLURM_LOCALID"), _int(env, "SLURM_NODEID")
    per_node_var = next((v for v in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
                         if env.get(v)), None)
    if per_node_var is None:
        raise LaunchError("a Slurm step without SLURM_STEP_TASKS_PER_NODE or SLURM_NTASKS_PER_NODE: accelfn "
                          "cannot tell how many tasks run on this node; start the tasks with srun")
    per_node = tasks_per_node(env[per_node_var], name=per_node_var)
    # SLURM_NTASKS_PER_NODE is one count for every node; the step's list has one per node
    local_world_size = per_node[node] if node < len(per_node) else per_node[-1]
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    taken = ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", per_node_var, "SLURM_NODEID"]
    if not addr:
        list_var = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(v)),
                        None)
        if list_var is None and world_size > 1:
            raise LaunchError("a Slurm step without SLURM_STEP_NODELIST, SLURM_JOB_NODELIST or SLURM_NODELIST, "
                              "and no MASTER_ADDR: set MASTER_ADDR to the first node of the job")
        addr = expand_hostlist(env[list_var], name=list_var)[0] if list_var else LOCALHOST
        taken += [list_var] if list_var else []
    if not port:
        _require(env, ("SLURM_JOB_ID",), "slurm")
        port = str(SLURM_PORT_BASE + _int(env, "SLURM_JOB_ID") % SLURM_PORT_SPAN)
        taken.append("SLURM_JOB_ID")
    return _world("slurm", env, tuple(taken), rank, world_size, local_rank, local_world_size, addr, port)


def open_mpi(env: Mapping[str, str]) -> World | None:
    """A rank of Open MPI's ``mpirun``: ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``."""
    names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
    return _mpi("openmpi", env, names)


def mpich(env: Mapping[str, str]) -> World | None:
    """A rank of MPICH's or Intel MPI's ``mpiexec`` (Hydra, PMI): ``PMI_RANK``, ``PMI_SIZE``,
    ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``."""
    return _mpi("mpich", env, ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"))


def _mpi(engine: str, env: Mapping[str, str], names: tuple[str, str, str, str]) -> World | None:
    if names[0] not in env:
        return None
    _require(env, names, engine)
    rank, world_size, local_rank, local_world_size = (_int(env, name) for name in names)
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    taken = list(names)
    if not addr:
        if local_world_size != world_size:
            raise LaunchError(
                f"{engine}: {names[1]}={world_size} ranks on several nodes ({names[3]}={local_world_size} on this "
                "one), and MASTER_ADDR is not set: pass the address of rank 0's node, e.g. "
                "`mpirun -x MASTER_ADDR=node01 -x MASTER_PORT=29500 ...`"
            )
        addr = LOCALHOST
    return _world(engine, env, tuple(taken), rank, world_size, local_rank, local_world_size, addr,
                  port or str(MPI_DEFAULT_PORT))


#: the adapters ``detect`` tries, in order
ENGINES: tuple[Adapter, ...] = (torchrun, slurm, open_mpi, mpich, kubeflow)


def _claims(env: Mapping[str, str], world: World) -> list[tuple[str, int]]:
    """What each engine's variables say the number of processes is, where they say one.

    A Slurm job's task count is no claim on a torchrun world started outside a step (by
    ``accelfn launch`` or ``af.launch`` in the batch script of ``sbatch --ntasks=N``, or in an
    ``salloc`` shell): that launcher is one process of the job, not N tasks, and the world it
    starts is its own. Inside a step (``srun accelfn launch``) each task is a launcher, so the
    count is a claim there.
    """
    in_step = bool(env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID"))
    found = []
    for name in ("SLURM_NTASKS", "SLURM_NPROCS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "WORLD_SIZE"):
        text = env.get(name, "")
        if name.startswith("SLURM_") and world.engine == "torchrun" and not in_step:
            continue
        if text.isdigit():
            found.append((f"{name}={text}", int(text)))
    return found


def _world(engine: str, env: Mapping[str, str], names: tuple[str, ...], rank: int, world_size: int,
           local_rank: int, local_world_size: int, addr: str | None, port: str | None) -> World:
    """The checked world; ``names`` are the variables read for the first four values, in order."""
    r, w, lr, lw = (names + ("", "", "", ""))[:4]
    if world_size < 1:
        raise LaunchError(f"{w}={world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise LaunchError(f"{r}={rank} is outside the world of {w}={world_size} (0..{world_size - 1})")
    if not 1 <= local_world_size <= world_size:
        raise LaunchError(f"{lw or 'the local world size'}={local_world_size} must be in 1..{w}={world_size}")
    if not 0 <= local_rank < local_world_size:
        raise LaunchError(f"{lr or 'the local rank'}={local_rank} is outside "
                          f"{lw or 'the local world size'}={local_world_size}")
    addr = env.get("MASTER_ADDR") or addr
    port = env.get("MASTER_PORT") or port
    extra = tuple(v for v in ("MASTER_ADDR", "MASTER_PORT") if env.get(v))
    if world_size > 1 and (not addr or not port):
        raise LaunchError(
            f"{w}={world_size} but MASTER_ADDR/MASTER_PORT are not set; start workers "
            "with `accelfn launch --nproc-per-node N script.py`"
        )
    port_number = None
    if port:
        try:
            port_number = int(port)
        except ValueError:
            raise LaunchError(f"MASTER_PORT={port!r} is not an integer") from None
    taken = tuple((name, env[name]) for name in dict.fromkeys(names + extra) if name in env)
    return World(engine, rank, world_size, local_rank, local_world_size, addr or None, port_number, taken)


def _require(env: Mapping[str, str], names: tuple[str, ...], engine: str) -> None:
    missing = [name for name in names if not env.get(name)]
    if missing:
        given = ", ".join(f"{n}={env[n]}" for n in names if env.get(n))
        raise LaunchError(f"{engine}: {given} are set but {', '.join(missing)} not; accelfn needs all of "
                          f"{', '.join(names)} to place this process (start it with the engine's launcher)")


def _int(env: Mapping[str, str], name: str) -> int:
    value = env.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not an integer") from None


_REPEAT = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def tasks_per_node(text: str, *, name: str = "SLURM_STEP_TASKS_PER_NODE") -> list[int]:
    """Slurm's tasks-per-node list, expanded: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    Raises:
        LaunchError: ``text`` is not of that form (``name`` is named).
    """
    counts: list[int] = []
    for part in text.split(","):
        match = _REPEAT.fullmatch(part.strip())
        if match is None:
            raise LaunchError(f"{name}={text!r} is not a list of task counts such as 2(x3),1")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def expand_hostlist(text: str, *, name: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Slurm's hostlist syntax, expanded in order: ``"node[01-02,07],gpu-a[1-2]"`` ->
    ``["node01", "node02", "node07", "gpu-a1", "gpu-a2"]`` (zero padding kept; several
    bracket groups in one name give their product).

    Raises:
        LaunchError: unbalanced brackets or a range that is not ``N`` or ``N-M`` with N <= M.
    """
    hosts: list[str] = []
    for item in _split_top(text, name):
        parts = re.split(r"(\[[^\]]*\])", item)
        choices = []
        for part in parts:
            if part.startswith("["):
                choices.append(_ranges(part[1:-1], text, name))
            elif "[" in part or "]" in part:
                raise LaunchError(f"{name}={text!r}: unbalanced brackets in the host list")
            else:
                choices.append([part])
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    if not hosts or not all(hosts):
        raise LaunchError(f"{name}={text!r} is not a host list such as node[01-04,07]")
    return hosts


def _split_top(text: str, name: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += (c == "[") - (c == "]")
        if depth not in (0, 1):
            raise LaunchError(f"{name}={text!r}: unbalanced brackets in the host list")
        if c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise LaunchError(f"{name}={text!r}: unbalanced brackets in the host list")
    return [*items, text[start:]]


def _ranges(inner: str, text: str, name: str) -> list[str]:
    names = []
    for part in inner.split(","):
        match = _RANGE.fullmatch(part)
        if match is None or (match[2] is not None and int(match[2]) < int(match[1])):
            raise LaunchError(f"{name}={text!r}: {part!r} is not a number or a range N-M")
        first, last = match[1], match[2] or match[1]
        names += [str(i).zfill(len(first)) for i in range(int(first), int(last) + 1)]
    return names
