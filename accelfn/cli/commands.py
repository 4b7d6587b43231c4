"""The ``accelfn`` command: ``accelfn launch | config | env``.

``launch`` drives ``torch.distributed.run`` (torchrun): it turns the launch config and
flags into torchrun's arguments and runs it in this process; torchrun starts the workers,
runs the rendezvous and restarts. ``config`` writes a YAML launch config, ``env`` prints
what a bug report needs.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import attrs
import torch

from accelfn._version import __version__
from accelfn.backends._env import BACKEND_NAMES, PRECISION_FROM_ENV, LaunchEnv, launcher_environment, timeout_from_env
from accelfn.cli import config as _config
from accelfn.cli._torchrun import run_torchrun
from accelfn.errors import LaunchError
from accelfn.transforms.precision import POLICY_NAMES

_EXAMPLES = """\
examples:
  accelfn launch train.py                                  one process
  accelfn launch --nproc-per-node 4 train.py --lr 3e-4     four processes, a free port
  accelfn launch --nproc-per-node 8 --nnodes 2 --node-rank 0 \\
      --master-addr 10.0.0.1 --master-port 29500 train.py  node 0 of two (node 1: --node-rank 1)
  accelfn launch --nnodes 2 --nproc-per-node 8 --rdzv-endpoint 10.0.0.1:29400 train.py
  accelfn config --nproc-per-node 4 --backend cuda --precision bf16 && accelfn launch train.py
"""

_DEFAULTS = _config.LaunchConfig()


def _add_launch_options(parser: argparse.ArgumentParser) -> None:
    """The fields of LaunchConfig as flags; a flag not given is None (the file decides)."""
    d = _DEFAULTS
    group = parser.add_argument_group("launch options (override the config file)")
    add = group.add_argument
    add("--nproc-per-node", "--nproc_per_node", type=int, metavar="N",
        help=f"worker processes on this node, one per GPU for CUDA (default {d.nproc_per_node})")
    add("--nnodes", type=int, metavar="M", help=f"nodes in the job (default {d.nnodes})")
    add("--node-rank", "--node_rank", type=int, metavar="R",
        help=f"this node's rank, 0..M-1, with --master-addr/--master-port (default {d.node_rank})")
    add("--master-addr", "--master_addr", metavar="HOST",
        help="address of node 0 for a static rendezvous (default 127.0.0.1 when a port is given)")
    add("--master-port", "--master_port", type=int, metavar="PORT",
        help="TCP port on node 0; on one node, leave it out to let the OS pick a free port")
    add("--rdzv-endpoint", "--rdzv_endpoint", metavar="HOST:PORT",
        help="endpoint of a c10d rendezvous, instead of --master-addr/--master-port")
    add("--rdzv-backend", "--rdzv_backend", choices=_config.RDZV_BACKENDS,
        help=f"rendezvous backend used with --rdzv-endpoint (default {d.rdzv_backend})")
    add("--rdzv-id", "--rdzv_id", metavar="ID",
        help=f"job id shared by all nodes of a --rdzv-endpoint rendezvous (default {d.rdzv_id})")
    add("--max-restarts", "--max_restarts", type=int, metavar="K",
        help=f"restarts of the whole worker group after a failure (default {d.max_restarts})")
    add("--backend", choices=BACKEND_NAMES,
        help="backend af.backends.auto() picks in the workers (default: CUDA if a GPU is seen, else CPU)")
    add("--precision", choices=POLICY_NAMES,
        help="precision policy for scripts that set none with af.with_precision (default: fp32)")
    add("--timeout-s", "--timeout_s", type=float, metavar="SECONDS",
        help=f"how long a collective may wait for a rank before failing (default {d.timeout_s:g})")


def _given(args: argparse.Namespace) -> dict[str, Any]:
    names = [f.name for f in attrs.fields(_config.LaunchConfig)]
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def _active_config(path: str | None, *, stderr: TextIO | None = None) -> tuple[_config.LaunchConfig, Path | None]:
    """The config file named by ``--config``, else ``./accelfn.yaml`` if present, else defaults."""
    if path is not None:
        return _config.load(path), Path(path)
    if _config.DEFAULT_CONFIG_FILE.is_file():
        if stderr is not None:
            print(f"accelfn: using the launch config {_config.DEFAULT_CONFIG_FILE} (pass --config to choose another)",
                  file=stderr)
        return _config.load(_config.DEFAULT_CONFIG_FILE), _config.DEFAULT_CONFIG_FILE
    return _DEFAULTS, None


# -- accelfn launch -------------------------------------------------------------------------

def _launch(args: argparse.Namespace) -> int:
    base, path = _active_config(args.config, stderr=sys.stderr)
    given = _given(args)
    config = _config.merge(base, **given)
    if not args.module and not Path(args.script).is_file():
        raise LaunchError(f"the training script {args.script!r} does not exist (use -m/--module for a module name)")
    # torchrun's workers inherit this process's environment; a flag overrides a variable
    # already set there, a config file's value or a default does not
    flags = {_config.WORKER_ENV[name] for name in given if name in _config.WORKER_ENV}
    for name, value in config.worker_env().items():
        if name in flags or name not in os.environ:
            os.environ[name] = value
            if name == _config.WORKER_ENV["precision"]:  # where it came from, for the workers' warnings
                os.environ[PRECISION_FROM_ENV] = "--precision" if "precision" in given else str(path)
    # the rendezvous waits as long as the workers' collectives: ACCELFN_TIMEOUT_S as they see it
    config = _config.merge(config, timeout_s=timeout_from_env(os.environ, config.timeout_s))
    torchrun_args = [*config.torchrun_args(), *(["--module"] if args.module else []), args.script, *args.script_args]
    for name, value in launcher_environment(config.backend).items():
        os.environ.setdefault(name, value)
    return run_torchrun(torchrun_args, config)


# -- accelfn config -------------------------------------------------------------------------

class _NoAnswer(Exception):
    """Standard input ended before the answer to a question."""


def _ask(name: str, current: Any, stdin: TextIO, stdout: TextIO) -> str | None:
    """One answer from ``stdin``, stripped; None for an empty answer.

    Raises:
        _NoAnswer: ``stdin`` ended before an answer (``< /dev/null``, a closed pipe).
    """
    choices = {"backend": BACKEND_NAMES, "precision": POLICY_NAMES, "rdzv_backend": _config.RDZV_BACKENDS}.get(name)
    hint = f" ({'/'.join(choices)})" if choices else ""
    shown = "null" if current is None else current
    stdout.write(f"{name}{hint} [{shown}]: ")
    stdout.flush()
    line = stdin.readline()
    if not line:
        stdout.write("\n")
        raise _NoAnswer
    return line.strip() or None


def _parse_answer(field: attrs.Attribute, answer: str) -> Any:
    """An answer in the field's type: ``int``, ``float``, or a string; ``null`` for None.

    Raises:
        LaunchError: not a number where one is needed.
    """
    kind = attrs.fields_dict(attrs.resolve_types(_config.LaunchConfig))[field.name].type
    options = typing.get_args(kind) or (kind,)  # int | None -> (int, NoneType)
    if answer.lower() in ("null", "none") and type(None) in options:
        return None
    number = next((t for t in options if t in (int, float)), None)
    if number is None:
        return answer
    try:
        return number(answer)
    except ValueError:
        raise LaunchError(f"{field.name}={answer!r}: must be {'an int' if number is int else 'a number'}") from None


def _interactive(config: _config.LaunchConfig, given: dict[str, Any], stdin: TextIO,
                 stdout: TextIO) -> _config.LaunchConfig:
    """Asks for every field not given as a flag; a bad answer is explained and asked again.

    An empty answer keeps the value shown in brackets.

    Raises:
        LaunchError: ``stdin`` ended before every question was answered (nothing is written).
    """
    questions = [field for field in attrs.fields(_config.LaunchConfig) if field.name not in given]
    for number, field in enumerate(questions):
        while True:
            try:
                answer = _ask(field.name, getattr(config, field.name), stdin, stdout)
            except _NoAnswer:
                raise LaunchError(
                    f"--interactive: standard input ended before the answer to {field.name} "
                    f"({number} of {len(questions)} questions answered); nothing was written. Answer "
                    "each question on a line of its own (an empty line keeps the value in brackets), "
                    "or give the options as flags without --interactive"
                ) from None
            if answer is None:
                break
            try:
                config = _config.merge(config, **{field.name: _parse_answer(field, answer)})
                break
            except LaunchError as e:
                stdout.write(f"  {e}\n")
    return config


def _write_config(args: argparse.Namespace, *, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    stdin = sys.stdin if stdin is None else stdin
    stdout = sys.stdout if stdout is None else stdout
    given = _given(args)
    config = _config.merge(_DEFAULTS, **given)
    if args.interactive:
        config = _interactive(config, given, stdin, stdout)
    path = _config.save(config, args.output)
    stdout.write(f"wrote the launch config {path}:\n{_config.to_yaml(config)}")
    try:
        config.check()
    except LaunchError as e:  # a file shared by the nodes may leave the rest to flags
        print(f"accelfn config: warning: {path} cannot be launched as it is: {e}; give the missing options "
              "as flags to `accelfn launch --config`, or add them to the file", file=sys.stderr)
    return 0


# -- accelfn env ----------------------------------------------------------------------------

def _availability() -> list[tuple[str, str]]:
    """Each distributed backend and device type, and whether this installation can use it."""
    import importlib.metadata
    import importlib.util

    import torch
    import torch.distributed as dist

    def yes(flag: bool) -> str:
        return "yes" if flag else "no"

    distributed = dist.is_available()
    rows = [
        ("torch.distributed", yes(distributed)),
        ("gloo (CPU processes)", yes(distributed and dist.is_gloo_available())),
        ("nccl (CUDA processes)", yes(distributed and dist.is_nccl_available())),
        ("cuda", f"yes, {torch.cuda.device_count()} device(s)" if torch.cuda.is_available() else "no"),
    ]
    if importlib.util.find_spec("torch_xla") is None:
        rows.append(("torch_xla", "not installed"))
    else:
        rows.append(("torch_xla", f"installed, {importlib.metadata.version('torch_xla')}"))
    return rows


_PACKAGES = ("numpy", "attrs", "cattrs", "toolz", "safetensors", "tensorboardX", "orjson", "PyYAML", "tqdm")


def _package_versions() -> str:
    import importlib.metadata

    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return ", ".join(f"{name} {version(name)}" for name in _PACKAGES)


def _devices() -> list[str]:
    import torch

    lines = [f"cpu: {os.cpu_count()} logical cores, {torch.get_num_threads()} torch threads"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            lines.append(f"cuda:{i}: {props.name}, {props.total_memory / 2**30:.1f} GiB, "
                         f"compute capability {props.major}.{props.minor}")
    return lines


def _report(args: argparse.Namespace) -> int:
    out = sys.stdout
    out.write(f"accelfn: {__version__}\n")
    out.write(f"torch: {torch.__version__} (CUDA {torch.version.cuda}, cuDNN "
              f"{torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None})\n")
    out.write(f"python: {platform.python_version()} ({platform.python_implementation()}, {sys.executable})\n")
    out.write(f"platform: {platform.platform()}\n")
    out.write(f"packages: {_package_versions()}\n")
    out.write("devices:\n" + "".join(f"  {line}\n" for line in _devices()))
    out.write("backends:\n" + "".join(f"  {name}: {value}\n" for name, value in _availability()))
    try:
        env = LaunchEnv.from_env()
        out.write(f"launch environment: rank {env.rank} of world size {env.world_size} "
                  f"(local rank {env.local_rank} of {env.local_world_size}), backend {env.backend}, "
                  f"precision {env.precision}, timeout {env.timeout_s:g} s\n")
    except LaunchError as e:
        out.write(f"launch environment: invalid: {e}\n")
    config, path = _active_config(args.config)
    source = str(path) if path is not None else "none found, the defaults"
    out.write(f"launch config ({source}):\n")
    out.write("".join(f"  {line}\n" for line in _config.to_yaml(config).splitlines()))
    return 0


# -- the parser -----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The ``accelfn`` argument parser (its ``--help`` documents every flag)."""
    parser = argparse.ArgumentParser(
        prog="accelfn", description="Run accelfn training scripts on one or many processes and machines.",
    )
    parser.add_argument("--version", action="version", version=f"accelfn {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{launch,config,env}")

    launch = commands.add_parser(
        "launch", help="run a script on N processes per node (drives torch.distributed.run)",
        description="Runs SCRIPT on --nproc-per-node processes on each of --nnodes nodes through "
        "torch.distributed.run (torchrun). Workers get RANK, LOCAL_RANK, WORLD_SIZE, "
        "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and ACCELFN_BACKEND, ACCELFN_PRECISION, "
        "ACCELFN_TIMEOUT_S for af.backends.auto(). Options come from the defaults, then the "
        f"config file (--config, or ./{_config.DEFAULT_CONFIG_FILE} if present), then the flags.",
        epilog=_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    launch.add_argument("--config", metavar="FILE",
                        help=f"YAML launch config written by `accelfn config` (default ./{_config.DEFAULT_CONFIG_FILE} "
                        "if it exists)")
    _add_launch_options(launch)
    launch.add_argument("-m", "--module", action="store_true",
                        help="SCRIPT is a module name, run as `python -m SCRIPT`")
    # SCRIPT is optional to argparse only so that its absence gets a message of our own
    # (argparse would also call the REMAINDER of ARGS required)
    launch.add_argument("script", metavar="SCRIPT", nargs="?", help="the training script (or module, with -m)")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="arguments passed to SCRIPT unchanged")
    launch.set_defaults(run=_launch, parser=launch)

    config = commands.add_parser(
        "config", help="write a YAML launch config for `accelfn launch`",
        description="Writes a launch config: the flags given, the defaults for the rest (or, with "
        "--interactive, answers read from standard input).",
    )
    config.add_argument("-o", "--output", metavar="FILE", default=str(_config.DEFAULT_CONFIG_FILE),
                        help=f"where to write it (default ./{_config.DEFAULT_CONFIG_FILE})")
    config.add_argument("--interactive", action="store_true",
                        help="ask for every option not given as a flag (an empty answer keeps the default)")
    _add_launch_options(config)
    config.set_defaults(run=_write_config, parser=config)

    env = commands.add_parser(
        "env", help="print versions, devices, backends and the launch config (for bug reports)",
        description="Prints accelfn, torch, Python and platform versions, devices, which "
        "distributed backends this installation can use, the launch environment and the "
        "active launch config.",
    )
    env.add_argument("--config", metavar="FILE",
                     help=f"the launch config to show (default ./{_config.DEFAULT_CONFIG_FILE} if it exists)")
    env.set_defaults(run=_report, parser=env)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``accelfn`` console script and of ``python -m accelfn``.

    Returns:
        int: the exit status: 0 on success, 2 for a bad launch configuration, 128 + N when
        ``launch`` received signal N (143 for SIGTERM, 130 for SIGINT; torchrun forwards it
        to the workers, which checkpoint and exit, and waits for them), else the first
        failed worker's exit code.
    """
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # the command's own usage, not the top level's
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "launch" and args.script is None:
        args.parser.error("the training SCRIPT is missing: accelfn launch [options] SCRIPT [ARGS...]")
    command: Callable[[argparse.Namespace], int] = args.run
    try:
        return command(args)
    except LaunchError as e:
        print(f"accelfn {args.command}: error: {e}", file=sys.stderr)
        return 2

