"""Where each launch option comes from, the first that sets it winning.

::

    1  a flag on the command line                 --precision bf16
    2  the environment                            ACCELFN_PRECISION=bf16 (WORKER_ENV), but
                                                  for a value an outer launch set for its
                                                  workers (LAUNCHER_SET_ENV): not the user's;
                                                  below them, Kubeflow Trainer v2's PET_NNODES,
                                                  PET_NPROC_PER_NODE, ... (ENGINE_ENV); where
                                                  none of those is set, the place of a launcher
                                                  an engine started as one of N processes
                                                  (``engines.placement``: a Kubeflow v1 pod's
                                                  RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
                                                  a task of an srun step; an mpirun rank):
                                                  node RANK of N nodes at the engine's address
    3  the chosen config file: --config FILE, else $ACCELFN_CONFIG_FILE, else ./accelfn.yaml
    4  the user's config file                     $XDG_CONFIG_HOME/accelfn/config.yaml
                                                  (~/.config/accelfn/config.yaml)
    5  the defaults of LaunchConfig

A file sets only the keys it holds with a value other than ``null``, so a user file with
``precision: bf16`` still applies under a project file that names only ``nproc_per_node``
(or ``precision: null``, as ``accelfn config`` writes an option it was not given).

A launcher an engine placed joins the engine's job, never a world of its own in which it
would train alone on the whole data set: its ``nnodes`` is the engine's number of
processes, and a flag that says otherwise is an error.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from accelfn.cli.config import (
    DEFAULT_CONFIG_FILE,
    ENGINE_ENV,
    WORKER_ENV,
    LaunchConfig,
    _expected,
    _parse,
    _read,
    launcher_set,
    merge,
    nnodes_range,
)
from accelfn.distributed.engines import World, placement
from accelfn.errors import LaunchError

#: the variable naming the config file to use instead of ./accelfn.yaml
CONFIG_FILE_VARIABLE = "ACCELFN_CONFIG_FILE"


@attrs.frozen
class Resolved:
    """The launch config in effect and where each of its options came from.

    Attributes:
        config: the merged, validated launch config.
        sources: for each field set by something other than the defaults, what set it: a
            flag (``--precision``), a variable (``ACCELFN_PRECISION``) or a file's path.
        files: the config files read, lowest precedence first.
    """

    config: LaunchConfig
    sources: Mapping[str, str]
    files: tuple[Path, ...]


def user_config_file(environ: Mapping[str, str] | None = None) -> Path:
    """The user's default launch config: ``$XDG_CONFIG_HOME/accelfn/config.yaml``, or
    ``~/.config/accelfn/config.yaml`` when ``XDG_CONFIG_HOME`` is unset, empty or relative
    (as the XDG Base Directory Specification says)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CONFIG_HOME") or ""
    root = Path(base) if os.path.isabs(base) else Path(env.get("HOME") or Path.home()) / ".config"
    return root / "accelfn" / "config.yaml"


def chosen_config_file(path: str | os.PathLike[str] | None, environ: Mapping[str, str] | None = None,
                       cwd: Path | None = None) -> Path | None:
    """The config file above the user's: ``path`` (``--config``), else ``$ACCELFN_CONFIG_FILE``,
    else ``./accelfn.yaml`` if it exists (in ``cwd``, by default the working directory), else None.

    A file named by ``--config`` or the variable must exist (``resolve`` raises otherwise).
    """
    env = os.environ if environ is None else environ
    if path is not None:
        return Path(path)
    named = env.get(CONFIG_FILE_VARIABLE)
    if named:
        return Path(named)
    local = DEFAULT_CONFIG_FILE if cwd is None else cwd / DEFAULT_CONFIG_FILE
    return local if local.is_file() else None


def _environment(environ: Mapping[str, str], variables: Mapping[str, str] = WORKER_ENV) -> dict[str, Any]:
    """The options set by ``variables`` (by field; ``WORKER_ENV`` or ``ENGINE_ENV``) in
    ``environ``, parsed and checked; a variable an outer ``accelfn launch`` set for this
    process (``launcher_set``) is not one.

    Raises:
        LaunchError: a value that does not parse, or that the field refuses.
    """
    kinds = attrs.fields_dict(attrs.resolve_types(LaunchConfig))
    found = {}
    passed = launcher_set(environ)  # an outer launch's options for its own workers
    for name, variable in variables.items():
        text = environ.get(variable)
        if text is None or (text == "" and name != "gpu_ids") or variable in passed:
            continue
        options = typing.get_args(kinds[name].type) or (kinds[name].type,)
        if name == "nnodes":  # N, or an elastic job's MIN:MAX (torchrun's PET_NNODES takes both)
            try:
                least, most = nnodes_range(text)
            except ValueError:
                raise LaunchError(f"{variable}={text!r}: must be a number of nodes N, or MIN:MAX") from None
            found["nnodes"], found["min_nnodes"] = most, most if least is None else least
            continue
        try:
            if bool in options:
                value: Any = {"1": True, "true": True, "0": False, "false": False}[text.strip().lower()]
            elif int in options:
                value = int(text)
            elif float in options:
                value = float(text)
            else:
                value = text
        except (KeyError, ValueError):
            expected = "1, 0, true or false" if bool in options else _expected(kinds[name].type).replace(" or null", "")
            raise LaunchError(f"{variable}={text!r}: must be {expected}") from None
        try:
            found[name] = getattr(attrs.evolve(LaunchConfig(), **{name: value}), name)  # validated
        except (ValueError, TypeError) as e:
            raise LaunchError(f"{variable}={text!r}: {e}") from None
    return found


def resolve(flags: Mapping[str, Any] | None = None, *, config_file: str | os.PathLike[str] | None = None,
            environ: Mapping[str, str] | None = None, cwd: Path | None = None, placed: bool = True) -> Resolved:
    """The launch config in effect: flags over the environment over the chosen config file
    over the user's config file over the defaults (see this module's docstring).

    Args:
        flags: options given on the command line, by field name (None values ignored).
        config_file: the file named by ``--config``, or None.
        environ: the environment (default ``os.environ``): ``ACCELFN_CONFIG_FILE``,
            ``XDG_CONFIG_HOME``, ``HOME``, the variables of ``WORKER_ENV`` and ``ENGINE_ENV``,
            and the launch engines' (``engines.placement``).
        cwd: the working directory, where ``accelfn.yaml`` is looked for.
        placed: whether a launcher an engine placed joins the engine's job (False for
            ``accelfn test``, which checks this machine alone).

    Returns:
        Resolved: the config and the source of each option.

    Raises:
        LaunchError: a file named by ``--config`` or ``ACCELFN_CONFIG_FILE`` that cannot be
            read; an invalid file or variable (the message names it); an engine's incomplete
            variables; a flag's ``--nnodes`` other than the number of processes of the engine
            that placed this launcher; options that are valid alone but not together are left
            to :meth:`LaunchConfig.check`.
    """
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    files: list[Path] = []
    user = user_config_file(env)
    chosen = chosen_config_file(config_file, env, cwd)
    for path in (user if user.is_file() else None, chosen):
        if path is None:
            continue
        config, named = _parse(_read(path), source=str(path))
        keys = [key for key in named if getattr(config, key) is not None]  # null: no opinion
        values.update({key: getattr(config, key) for key in keys})
        sources.update(dict.fromkeys(keys, str(path)))
        files.append(path)
    given = {name: value for name, value in (flags or {}).items() if value is not None}
    world = placement(env) if placed and not any(v in env for v in ENGINE_ENV.values()) else None
    if world is not None:
        joined = _joined(world, env, endpoint="rdzv_endpoint" in given or "rdzv_endpoint" in values)
        values.update({name: value for name, (value, _) in joined.items()})
        sources.update({name: source for name, (_, source) in joined.items()})
    for variables in (ENGINE_ENV, WORKER_ENV):
        from_env = _environment(env, variables)
        values.update(from_env)
        # min_nnodes comes from the variable of nnodes (PET_NNODES=MIN:MAX)
        sources.update({name: variables.get(name) or variables["nnodes"] for name in from_env})
    values.update(given)
    sources.update({name: "--" + name.replace("min_", "").replace("_", "-") for name in given})
    if world is not None and values["nnodes"] != world.world_size:
        raise LaunchError(
            f"--nnodes {values['nnodes']}, but {_named(world)} says this launcher is process {world.rank} of "
            f"{world.world_size}: a launch of its own would train alone on the whole data set. Leave --nnodes and "
            f"--node-rank out (the launch joins the job as node {world.rank} of {world.world_size}), give --nnodes "
            f"{world.world_size}, or unset the engine's variables to run a job on this machine alone"
        )
    return Resolved(merge(LaunchConfig(), **values), sources, tuple(files))


def _named(world: World) -> str:
    """The engine and the variables it placed this process with: ``kubeflow (RANK=1, WORLD_SIZE=2)``."""
    return f"{world.engine} ({', '.join(f'{name}={value}' for name, value in world.taken[:2])})"


def _joined(world: World, environ: Mapping[str, str], *, endpoint: bool) -> dict[str, tuple[Any, str]]:
    """The options by which a launcher the engine placed joins its job, and the source of
    each: node ``world.rank`` of ``world.world_size``, at the engine's rendezvous address
    (static; not where a ``rdzv_endpoint`` is given)."""
    rank_var, size_var = (name for name, _ in world.taken[:2])
    joined: dict[str, tuple[Any, str]] = {"nnodes": (world.world_size, size_var), "node_rank": (world.rank, rank_var)}
    if not endpoint:
        where = f"{world.engine}'s rendezvous address"
        joined["master_addr"] = (world.master_addr, "MASTER_ADDR" if environ.get("MASTER_ADDR") else where)
        joined["master_port"] = (world.master_port, "MASTER_PORT" if environ.get("MASTER_PORT") else where)
    return joined
