"""``accelfn test``: checks this machine end to end, one line per check.

Launches the checks of ``_selftest_worker`` twice through ``accelfn launch`` with the
launch config in effect: on 1 process, then on ``nproc_per_node`` processes (2 when the
config says 1). Prints ``PASS``, ``FAIL`` or ``SKIP`` and the check's name on one line
each, and returns 1 when a check failed or a launch did not report.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

import attrs
import orjson

from accelfn.cli import config as _config
from accelfn.cli import precedence as _precedence
from accelfn.errors import LaunchError

#: the faults ``accelfn test --fault`` injects so that a check fails (a test of the checks):
#: ``no-allreduce`` trains the N-process check without ``replicate()``, as a broken gradient
#: all-reduce would; ``corrupt-checkpoint`` flips a byte of a saved tensor file before loading
FAULTS = ("no-allreduce", "corrupt-checkpoint")
#: seconds one launch of the checks may take before it counts as failed
LAUNCH_TIMEOUT_S = 600
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory that holds accelfn/


def world_sizes(config: _config.LaunchConfig) -> tuple[int, int]:
    """1, and the config's processes per node (2 when it says 1)."""
    return 1, max(config.nproc_per_node, 2)


def _skipped(config: _config.LaunchConfig) -> list[tuple[str, str]]:
    """Backends this machine cannot check, and why."""
    import torch

    rows = []
    if not torch.cuda.is_available():
        rows.append(("cuda: every check", "torch sees no GPU"))
    if config.backend != "xla":
        installed = importlib.util.find_spec("torch_xla") is not None
        why = "run `accelfn test --backend xla`" if installed else "torch_xla is not installed"
        rows.append(("xla: every check", why))
    if importlib.util.find_spec("deepspeed") is None:
        rows.append(("deepspeed: every check", "DeepSpeed is not installed (`pip install --no-build-isolation "
                     "deepspeed` beside this torch)"))
    return rows


def _backend_for(requested: str | None, world_size: int) -> str | None:
    """The backend of a world: the config's; else CUDA (NCCL) where there is a GPU for every
    process, and CPU (gloo) where there is not (one GPU cannot host 2 CUDA processes)."""
    import torch

    if requested is None and torch.cuda.is_available() and torch.cuda.device_count() < world_size:
        return "cpu"
    return requested


def _launch_checks(config: _config.LaunchConfig, world_size: int, out: Path, fault: str | None,
                   environ: Mapping[str, str]) -> tuple[list[dict[str, str]], str]:
    """Runs the checks on ``world_size`` processes; their results, or the launch's error."""
    world = attrs.evolve(config, nproc_per_node=world_size, backend=_backend_for(config.backend, world_size))
    launch_file = _config.save(world, out / f"launch-{world_size}.yaml")
    env = {k: v for k, v in environ.items() if k not in _config.WORKER_ENV.values()}  # the file has them all
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), environ.get("PYTHONPATH")]))
    env.pop(_precedence.CONFIG_FILE_VARIABLE, None)
    # the user's file is in the launch file already; read again, its keys would fill the file's nulls
    env["XDG_CONFIG_HOME"] = str(out / "no-user-config")
    command = [sys.executable, "-m", "accelfn", "launch", "--config", str(launch_file),
               "-m", "accelfn.cli._selftest_worker", str(out), *(["--fault", fault] if fault else [])]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired:
        return [], f"the launch did not finish within {LAUNCH_TIMEOUT_S} s"
    results = out / f"results-{world_size}.json"
    if done.returncode != 0 or not results.is_file():
        tail = [line for line in done.stderr.splitlines() if line.strip()][-3:]
        return [], f"the launch exited with status {done.returncode}: {' | '.join(tail)}"
    return orjson.loads(results.read_bytes()), ""


def self_test(config: _config.LaunchConfig, *, fault: str | None = None, stdout: TextIO | None = None,
              environ: Mapping[str, str] | None = None) -> int:
    """Runs every check with ``config``, printing one line per check to ``stdout``.

    Returns:
        int: 0 when every check passed (or was skipped), else 1.

    Raises:
        LaunchError: a config for several nodes (the checks run on this machine).
    """
    out_stream = sys.stdout if stdout is None else stdout
    env = os.environ if environ is None else environ
    if config.nnodes != 1:
        raise LaunchError(f"accelfn test checks this machine, so it needs --nnodes 1, not {config.nnodes}")
    # the checks set their own transforms: the defaults a config adds to scripts stay out
    config = attrs.evolve(config, master_addr=None, master_port=None, rdzv_endpoint=None, node_rank=0,
                          max_restarts=0, precision=None, accumulate=None, compile=False,
                          shard_params=None)
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}

    def line(status: str, name: str, detail: str) -> None:
        counts[status] += 1
        out_stream.write(f"{status}  {name}{f': {detail}' if detail else ''}\n")
        out_stream.flush()

    with tempfile.TemporaryDirectory(prefix="accelfn-test-") as tmp:
        for world_size in world_sizes(config):
            results, error = _launch_checks(config, world_size, Path(tmp), fault, env)
            if error:
                line("FAIL", f"{world_size} process{'es' if world_size > 1 else ''}: every check", error)
            for result in results:
                line(result["status"], result["name"], result["detail"])
    for name, why in _skipped(config):
        line("SKIP", name, why)
    out_stream.write(f"accelfn test: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped\n")
    return 1 if counts["FAIL"] else 0
