"""The ``accelfn`` command: ``accelfn launch | plan | config | env | test``.

``launch`` drives ``torch.distributed.run`` (torchrun): it turns the launch config and
flags into torchrun's arguments and runs it in this process; torchrun starts the workers,
runs the rendezvous and restarts. ``plan`` runs the script in one process where ``af.run``
prints the plan for the launch's world size and exits. ``config`` writes a YAML launch config, ``env`` prints
what a bug report needs, ``test`` checks the machine end to end (``_selftest.py``).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import subprocess
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import attrs
import torch

from accelfn._version import __version__
from accelfn.cli import _lighthouse, _loopback
from accelfn.cli import config as _config
from accelfn.cli import precedence as _precedence
from accelfn.cli._environment import availability, devices, package_versions
from accelfn.cli._selftest import FAULTS, self_test
from accelfn.cli._torchrun import run_torchrun
from accelfn.distributed.env import (
    BACKEND_NAMES,
    PLAN_LOCAL_WORLD_SIZE_ENV,
    PLAN_WORLD_SIZE_ENV,
    PRECISION_FROM_ENV,
    SHARD_PARAMS_DEFAULTS,
    LaunchEnv,
    launcher_environment,
)
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
    add("--nnodes", type=_nnodes, metavar="M",
        help=f"nodes in the job, or MIN:MAX for an elastic job whose nodes may come and go (with --rdzv-endpoint "
        f"and --max-restarts; default {d.nnodes})")
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
    add("--rdzv-conf", "--rdzv_conf", metavar="KEY=VALUE,...",
        help="more settings of torchrun's rendezvous, e.g. last_call_timeout=2,keep_alive_interval=1 (the wait "
        "for nodes to join is --timeout-s)")
    add("--max-restarts", "--max_restarts", type=int, metavar="K",
        help=f"restarts of the whole worker group after a failure (default {d.max_restarts})")
    add("--replica-group", "--replica_group", type=int, metavar="I",
        help="this launch's replica group under af.tolerate_faults(), 0..N-1 (ACCELFN_REPLICA_GROUP)")
    add("--lighthouse", metavar="HOST:PORT",
        help="torchft's lighthouse the replica groups of af.tolerate_faults() meet at (TORCHFT_LIGHTHOUSE)")
    add("--serve-lighthouse", "--serve_lighthouse", action=argparse.BooleanOptionalAction,
        help="run the lighthouse in this launcher, on --lighthouse's port, while it runs (default: no)")
    add("--backend", choices=BACKEND_NAMES,
        help="backend af.backends.auto() picks in the workers (default: CUDA if a GPU is seen, else CPU)")
    add("--precision", choices=POLICY_NAMES,
        help="precision policy for scripts that set none with af.with_precision (default: fp32)")
    add("--accumulate", type=int, metavar="N",
        help="micro-batches per optimizer update for scripts that set none with af.accumulate (default: 1)")
    add("--shard-params", "--shard_params", action="store_const", const=SHARD_PARAMS_DEFAULTS,
        help="add af.shard_params() to scripts that set none, replacing their af.replicate() (default: the script's)")
    add("--shard-params-options", dest="shard_params", metavar="OPTIONS",
        help="as --shard-params, with options: name=value pairs such as shard_size=node,reshard_after_forward=false")
    add("--compile", action=argparse.BooleanOptionalAction,
        help="add af.compile() (torch.compile) to scripts that set none (default: no)")
    add("--gpu-ids", "--gpu_ids", metavar="IDS",
        help="the GPUs the workers use, e.g. 0,1 (sets CUDA_VISIBLE_DEVICES); all: every GPU (default: as the "
        "environment has it)")
    add("--deepspeed", dest="deepspeed_config_file", metavar="FILE",
        help="a DeepSpeed JSON/HJSON config: af.deepspeed(FILE) for scripts that set none (replacing their "
        "af.replicate())")
    add("--zero-stage", "--zero_stage", type=int, choices=(0, 1, 2, 3),
        help="DeepSpeed's zero_optimization.stage (over --deepspeed's file, or alone)")
    add("--offload-optimizer-device", "--offload_optimizer_device", choices=("none", "cpu", "nvme"),
        help="DeepSpeed's zero_optimization.offload_optimizer.device")
    add("--offload-param-device", "--offload_param_device", choices=("none", "cpu", "nvme"),
        help="DeepSpeed's zero_optimization.offload_param.device")
    add("--gradient-accumulation-steps", "--gradient_accumulation_steps", type=int, metavar="N",
        help="DeepSpeed's gradient_accumulation_steps")
    add("--timeout-s", "--timeout_s", type=float, metavar="SECONDS",
        help=f"how long a collective may wait for a rank before failing (default {d.timeout_s:g})")


def _nnodes(text: str) -> tuple[int | None, int]:
    """``--nnodes N`` or ``--nnodes MIN:MAX``, for argparse."""
    try:
        return _config.nnodes_range(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("nnodes=")) from None


def _given(args: argparse.Namespace) -> dict[str, Any]:
    names = [f.name for f in attrs.fields(_config.LaunchConfig)]
    given = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    if isinstance(given.get("nnodes"), tuple):  # --nnodes N or MIN:MAX: both bounds are the flag's (N: N to N)
        least, most = given["nnodes"]
        given["nnodes"], given["min_nnodes"] = most, most if least is None else least
    return given


def _active_config(args: argparse.Namespace, *, stderr: TextIO | None = None,
                   placed: bool = True) -> _precedence.Resolved:
    """The launch config in effect for ``args`` (flags, environment, files, defaults; see
    ``accelfn.cli.precedence.resolve``; ``placed``: joining the job of an engine that started
    this process); the files read are announced on ``stderr``."""
    resolved = _precedence.resolve(_given(args), config_file=args.config, placed=placed)
    if stderr is not None and resolved.files and args.config is None:
        print(f"accelfn: using the launch config {', '.join(map(str, resolved.files))} (pass --config to "
              "choose another)", file=stderr)
    return resolved


# -- accelfn launch -------------------------------------------------------------------------

def _launch(args: argparse.Namespace) -> int:
    resolved = _active_config(args, stderr=sys.stderr)
    config = resolved.config
    if not args.module and not Path(args.script).is_file():
        raise LaunchError(f"the training script {args.script!r} does not exist (use -m/--module for a module name)")
    config.check()
    # torchrun's workers inherit this process's environment (the config already holds the
    # variables set there, below the flags)
    for name, value in config.worker_env().items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    origin = resolved.sources.get("precision")  # where it came from, for the workers' warnings
    if config.precision is not None and origin is not None and origin != _config.WORKER_ENV["precision"]:
        os.environ[PRECISION_FROM_ENV] = origin
    else:
        os.environ.pop(PRECISION_FROM_ENV, None)
    for name, value in launcher_environment(config.backend).items():
        os.environ.setdefault(name, value)
    os.environ.update(_loopback.worker_variables(config, os.environ))
    with _lighthouse.served(config), _loopback.rendezvous_store(config) as port:  # a job on this machine
        # listens on loopback alone
        script = [*(["--module"] if args.module else []), args.script, *args.script_args]
        return run_torchrun([*config.torchrun_args(loopback_port=port), *script], config)


# -- accelfn plan ---------------------------------------------------------------------------

def _plan(args: argparse.Namespace) -> int:
    """Runs SCRIPT in one process that plans for the launch's world size (``af.run`` prints the
    plan and exits: 0, or 1 if the plan has errors)."""
    resolved = _active_config(args, stderr=sys.stderr)
    config = resolved.config
    if not args.module and not Path(args.script).is_file():
        raise LaunchError(f"the training script {args.script!r} does not exist (use -m/--module for a module name)")
    env = {k: v for k, v in os.environ.items() if k not in _WORLD_VARS}
    for name, value in config.worker_env().items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    env[PLAN_WORLD_SIZE_ENV] = str(config.nproc_per_node * config.nnodes)
    env[PLAN_LOCAL_WORLD_SIZE_ENV] = str(config.nproc_per_node)
    command = [sys.executable, *(["-m"] if args.module else []), args.script, *args.script_args]
    return subprocess.run(command, env=env, check=False).returncode


#: what a launch sets for a worker's place in the world: `accelfn plan`'s one process has none
_WORLD_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


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
    """An answer in the field's type: ``int``, ``float``, ``bool``, or a string; ``null`` for None.

    Raises:
        LaunchError: not a number where one is needed, not true/false where a bool is.
    """
    kind = attrs.fields_dict(attrs.resolve_types(_config.LaunchConfig))[field.name].type
    options = typing.get_args(kind) or (kind,)  # int | None -> (int, NoneType)
    if answer.lower() in ("null", "none") and type(None) in options:
        return None
    if bool in options:
        truth = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}.get(answer.lower())
        if truth is None:
            raise LaunchError(f"{field.name}={answer!r}: must be true or false")
        return truth
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
    path = _config.save(config, _precedence.user_config_file() if args.user else args.output)
    stdout.write(f"wrote the launch config {path}:\n{_config.to_yaml(config)}")
    try:
        config.check()
    except LaunchError as e:  # a file shared by the nodes may leave the rest to flags
        print(f"accelfn config: warning: {path} cannot be launched as it is: {e}; give the missing options "
              "as flags to `accelfn launch --config`, or add them to the file", file=sys.stderr)
    return 0


# -- accelfn env ----------------------------------------------------------------------------

def _report(args: argparse.Namespace) -> int:
    out = sys.stdout
    out.write(f"accelfn: {__version__}\n")
    out.write(f"torch: {torch.__version__} (CUDA {torch.version.cuda}, cuDNN "
              f"{torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None})\n")
    out.write(f"python: {platform.python_version()} ({platform.python_implementation()}, {sys.executable})\n")
    out.write(f"platform: {platform.platform()}\n")
    out.write(f"packages: {package_versions()}\n")
    out.write("devices:\n" + "".join(f"  {line}\n" for line in devices()))
    out.write("backends:\n" + "".join(f"  {name}: {value}\n" for name, value in availability()))
    try:
        env = LaunchEnv.from_env()
        out.write(f"launch environment: rank {env.rank} of world size {env.world_size} "
                  f"(local rank {env.local_rank} of {env.local_world_size}), backend {env.backend}, "
                  f"precision {env.precision}, accumulate {env.accumulate}, compile {'yes' if env.compile else 'no'}, "
                  f"timeout {env.timeout_s:g} s, shard_params {env.shard_params!r}\n")
        taken = ", ".join(f"{name}={value}" for name, value in env.engine_vars)
        out.write(f"launch engine: {env.engine}{f' ({taken})' if taken else ''}; rendezvous "
                  f"{f'{env.master_addr}:{env.master_port}' if env.master_addr else 'none'}\n")
        placed = True
    except LaunchError as e:
        out.write(f"launch environment: invalid: {e}\n")
        placed = False  # the engine's variables that do not place this process place no launch either
    passed = _config.launcher_set(os.environ)
    if passed:
        out.write(f"set by the launch that started this process, for its workers (not settings of a launch "
                  f"from here): {', '.join(f'{k}={v}' for k, v in passed.items())}\n")
    resolved = _active_config(args, placed=placed)
    source = ", ".join(map(str, resolved.files)) or "none found, the defaults"
    out.write(f"launch config ({source}):\n")
    for line in _config.to_yaml(resolved.config).splitlines():
        origin = resolved.sources.get(line.partition(":")[0])
        out.write(f"  {line}{f'  # from {origin}' if origin else ''}\n")
    return 0


# -- accelfn test ---------------------------------------------------------------------------

def _test(args: argparse.Namespace) -> int:
    return self_test(_active_config(args, stderr=sys.stderr, placed=False).config, fault=args.fault)


# -- the parser -----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The ``accelfn`` argument parser (its ``--help`` documents every flag)."""
    # allow_abbrev=False everywhere: an argument after SCRIPT that starts like a flag of ours
    # (`--n`, `--timeout`, `--master`) is the script's, never an abbreviation to expand or an
    # "ambiguous option" error (argparse classifies every argument before the script's REMAINDER
    # takes them); ours are spelled out in full
    parser = argparse.ArgumentParser(
        prog="accelfn", description="Run accelfn training scripts on one or many processes and machines.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"accelfn {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{launch,plan,config,env,test}")

    launch = commands.add_parser(
        "launch", allow_abbrev=False, help="run a script on N processes per node (drives torch.distributed.run)",
        description="Runs SCRIPT on --nproc-per-node processes on each of --nnodes nodes through "
        "torch.distributed.run (torchrun). Workers get RANK, LOCAL_RANK, WORLD_SIZE, "
        "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and ACCELFN_BACKEND, ACCELFN_PRECISION, "
        "ACCELFN_ACCUMULATE, ACCELFN_COMPILE, ACCELFN_TIMEOUT_S for af.backends.auto(). Each option "
        "comes from the first of: its flag; its variable in the environment (ACCELFN_PRECISION, ..., "
        "CUDA_VISIBLE_DEVICES for --gpu-ids); the config file (--config FILE, else $ACCELFN_CONFIG_FILE, "
        f"else ./{_config.DEFAULT_CONFIG_FILE} if present); the user's config file "
        "($XDG_CONFIG_HOME/accelfn/config.yaml, ~/.config/accelfn/config.yaml); the defaults.",
        epilog=_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    launch.add_argument("--config", metavar="FILE",
                        help="YAML launch config written by `accelfn config` (default $ACCELFN_CONFIG_FILE, else "
                        f"./{_config.DEFAULT_CONFIG_FILE} if it exists), over the user's config file")
    _add_launch_options(launch)
    launch.add_argument("-m", "--module", action="store_true",
                        help="SCRIPT is a module name, run as `python -m SCRIPT`")
    # SCRIPT is optional to argparse only so that its absence gets a message of our own
    # (argparse would also call the REMAINDER of ARGS required)
    launch.add_argument("script", metavar="SCRIPT", nargs="?", help="the training script (or module, with -m)")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="arguments passed to SCRIPT unchanged")
    launch.set_defaults(run=_launch, parser=launch)

    plan = commands.add_parser(
        "plan", allow_abbrev=False, help="print what a launch would do, hold and break on, training nothing (af.plan)",
        description="Runs SCRIPT unchanged in one process that stands for the launch's "
        "--nproc-per-node x --nnodes processes: af.run prints af.plan(...) for that world size "
        "(updates, samples per rank, memory per rank, collectives per update, misconfigurations) "
        "and exits without training, with status 1 if the plan has errors. Code before af.run runs "
        "for real (build the model on the meta device to plan a model this machine cannot hold).",
    )
    plan.add_argument("--config", metavar="FILE",
                      help="YAML launch config (default $ACCELFN_CONFIG_FILE, else "
                      f"./{_config.DEFAULT_CONFIG_FILE} if it exists), over the user's config file")
    _add_launch_options(plan)
    plan.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name, run as `python -m SCRIPT`")
    plan.add_argument("script", metavar="SCRIPT", nargs="?", help="the training script (or module, with -m)")
    plan.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                      help="arguments passed to SCRIPT unchanged")
    plan.set_defaults(run=_plan, parser=plan)

    config = commands.add_parser(
        "config", allow_abbrev=False, help="write a YAML launch config for `accelfn launch`",
        description="Writes a launch config: the flags given, the defaults for the rest (or, with "
        "--interactive, answers read from standard input).",
    )
    config.add_argument("-o", "--output", metavar="FILE", default=str(_config.DEFAULT_CONFIG_FILE),
                        help=f"where to write it (default ./{_config.DEFAULT_CONFIG_FILE})")
    config.add_argument("--user", action="store_true",
                        help="write the user's default config instead, $XDG_CONFIG_HOME/accelfn/config.yaml "
                        "(~/.config/accelfn/config.yaml), which every launch reads below ./accelfn.yaml")
    config.add_argument("--interactive", action="store_true",
                        help="ask for every option not given as a flag (an empty answer keeps the default)")
    _add_launch_options(config)
    config.set_defaults(run=_write_config, parser=config)

    env = commands.add_parser(
        "env", allow_abbrev=False, help="print versions, devices, backends and the launch config (for bug reports)",
        description="Prints accelfn, torch, Python and platform versions, devices, which "
        "distributed backends this installation can use, the launch environment and the "
        "active launch config.",
    )
    env.add_argument("--config", metavar="FILE",
                     help="the launch config to show (default $ACCELFN_CONFIG_FILE, else "
                     f"./{_config.DEFAULT_CONFIG_FILE} if it exists), over the user's config file")
    env.set_defaults(run=_report, parser=env)

    test = commands.add_parser(
        "test", allow_abbrev=False, help="check this machine end to end: training, backends, precisions, checkpoints, collectives",
        description="Trains a tiny model on 1 process and on --nproc-per-node processes (2 when the "
        "config says 1) with the launch config in effect, and prints one line per check: PASS, FAIL or "
        "SKIP. Checks: shard_data + replicate + accumulate + clip equals 1 process on the whole batch; "
        "each available backend and precision lowers the loss; a checkpoint saves and loads bitwise; "
        "gather joins tensors of unequal sizes; on several processes, shard_params, tensor_parallel, "
        "pipeline and (where installed) deepspeed over all of them equal 1 process too. The config's "
        "precision, accumulate and compile defaults are left out (the checks set their own). Exits 1 when "
        "a check fails.",
    )
    test.add_argument("--config", metavar="FILE",
                      help="YAML launch config (default $ACCELFN_CONFIG_FILE, else "
                      f"./{_config.DEFAULT_CONFIG_FILE} if it exists), over the user's config file")
    _add_launch_options(test)
    test.add_argument("--fault", choices=FAULTS,
                      help="test hook: break one check on purpose to see it FAIL (no-allreduce: the "
                      "multi-process training runs without replicate(); corrupt-checkpoint: a byte of "
                      "the saved checkpoint is flipped before it is loaded)")
    test.set_defaults(run=_test, parser=test)
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
    if args.command in ("launch", "plan") and args.script is None:
        args.parser.error(f"the training SCRIPT is missing: accelfn {args.command} [options] SCRIPT [ARGS...]")
    command: Callable[[argparse.Namespace], int] = args.run
    try:
        return command(args)
    except LaunchError as e:
        print(f"accelfn {args.command}: error: {e}", file=sys.stderr)
        return 2


def console() -> typing.NoReturn:
    """The ``accelfn`` command as a process: ``main`` on ``sys.argv``, then exits with its status.

    Before exiting it moves every object to the collector's permanent generation
    (``gc.freeze``): the collections the interpreter runs at exit then skip the ~180,000
    objects the imports of torch and accelfn made, about 0.3 s of CPU less per command (a
    launcher's end too, measured on 2 cores); nothing of this process is used after."""
    status = main()
    gc.freeze()
    sys.exit(status)

