"""The worker side of tests/helpers/pool.py: each rank runs the scenarios the test process sends.

Usage: accelfn launch LAUNCH_ARGS... pool.py (with ACCELFN_TEST_POOL=HOST:PORT and
ACCELFN_TEST_POOL_TOKEN set; tests/helpers/pool.py starts it).

torch and accelfn are imported once; each scenario then runs as in a freshly started
worker of the same launch and leaves nothing behind:

- environment: the worker's own at start (the launch's variables), with the request's
  changes, ``MASTER_ADDR``/``MASTER_PORT`` a new port on 127.0.0.1 and no
  ``TORCHELASTIC_USE_AGENT_STORE``, so that the scenario's backend forms a new default
  process group (rank 0 hosts its store) instead of reusing the previous scenario's;
- working directory, ``sys.argv``, ``sys.path``, warning filters, the handlers of the
  signals tests use, the root logger's handlers and level, torch's thread count, default
  dtype, float32 matmul precision, grad mode and deterministic flag, accelfn's count of
  ``arrive`` checks: as at the worker's start, put back after;
- random generators: torch's, Python's and NumPy's global ones as at the worker's start;
- modules of ``tests.workers`` a scenario imported are forgotten (their module state is new
  each time); torch.compile's caches are reset;
- a function or class of an already imported module that a scenario replaced (a patched
  ``pickle.load``, ``safetensors.torch.save``) is put back;
- the process group the scenario formed is left (the ranks meet first) and destroyed.

Standard output and error (Python's ``sys.stdout``/``sys.stderr``) are captured per
scenario and sent back with the outcome: a result, or the traceback of what the rank raised
(a ``SystemExit`` with a non-zero code counts as a failure, as a worker exit code would).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import logging
import os
import random
import runpy
import signal
import socket
import sys
import time
import traceback
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import accelfn  # noqa: F401  (imported once for every scenario: the point of the pool)
from accelfn.distributed import agreement, process_group
from tests.helpers.pool import ADDRESS_VAR, TOKEN_VAR, receive, send

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM)
_FRESH_ELASTIC = ("TORCHELASTIC_USE_AGENT_STORE",)


class Start:
    """What a scenario may change, as it was when this worker started."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.argv = list(sys.argv)
        self.path = list(sys.path)
        self.modules = set(sys.modules)
        self.handlers = {s: signal.getsignal(s) for s in SIGNALS}
        self.torch_rng = torch.get_rng_state()
        self.python_rng = random.getstate()
        self.numpy_rng = np.random.get_state()
        self.threads = torch.get_num_threads()
        self.dtype = torch.get_default_dtype()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.matmul_precision = torch.get_float32_matmul_precision()
        self.log_handlers, self.log_level = list(logging.root.handlers), logging.root.level
        self.functions = {name: _functions(module) for name, module in list(sys.modules.items())}

    def enter(self, request: dict[str, Any]) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        for name in request["unset"]:
            os.environ.pop(name, None)
        os.environ.update(request["env"])
        for name in _FRESH_ELASTIC:
            os.environ.pop(name, None)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(request["port"])
        os.chdir(request["cwd"])
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.python_rng)
        np.random.set_state(self.numpy_rng)
        agreement._arrivals = 0

    def leave(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.argv[:] = self.argv
        sys.path[:] = self.path
        for name in [m for m in sys.modules if m not in self.modules and m.startswith("tests.workers")]:
            del sys.modules[name]
        importlib.invalidate_caches()
        for name, functions in self.functions.items():
            module = sys.modules.get(name)
            if module is None:
                continue
            now = vars(module)
            for attribute, value in functions.items():
                if now.get(attribute) is not value:
                    with contextlib.suppress(AttributeError, TypeError):
                        setattr(module, attribute, value)
        for s, handler in self.handlers.items():
            signal.signal(s, handler)
        torch.set_num_threads(self.threads)
        torch.set_default_dtype(self.dtype)
        torch.use_deterministic_algorithms(self.deterministic)
        torch.set_float32_matmul_precision(self.matmul_precision)
        torch.set_grad_enabled(True)
        logging.root.handlers[:] = self.log_handlers
        logging.root.setLevel(self.log_level)
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()
        gc.collect()


def _functions(module: Any) -> dict[str, Any]:
    """The functions and classes a module holds (the values a test would patch)."""
    try:
        items = list(vars(module).items())
    except TypeError:
        return {}
    return {k: v for k, v in items if callable(v) and not k.startswith("__")}


def scenario(request: dict[str, Any]) -> Any:
    """Runs the request's script as ``__main__`` (its result: None) or calls its function."""
    if "script" in request:
        sys.argv[:] = [request["script"], *request["args"]]
        sys.path[:0] = [os.path.dirname(request["script"])]  # as python SCRIPT does
        try:
            runpy.run_path(request["script"], run_name="__main__")
        except SystemExit as e:
            if e.code not in (None, 0):
                raise
        return None
    module, _, name = request["function"].partition(":")
    return getattr(importlib.import_module(f"tests.workers.{module}"), name)(**request["kwargs"])


def serve(request: dict[str, Any], start: Start) -> dict[str, Any]:
    """One scenario, run as in a fresh worker; its outcome."""
    out, err = io.StringIO(), io.StringIO()
    reply: dict[str, Any] = {"ok": True, "result": None}
    began = time.monotonic()
    start.enter(request)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            reply["result"] = scenario(request)
    except BaseException:  # noqa: BLE001 - a failing scenario is an outcome to report, not this worker's end
        reply = {"ok": False, "error": traceback.format_exc()}
    finally:
        if dist.is_initialized():
            if reply["ok"]:
                process_group.leave()  # the ranks meet, then destroy the group
            else:
                dist.destroy_process_group()  # a peer may be gone: no waiting (the pool ends now anyway)
        start.leave()
    reply.update(stdout=out.getvalue(), stderr=err.getvalue(), seconds=time.monotonic() - began)
    return reply


def main() -> None:
    host, _, port = os.environ.pop(ADDRESS_VAR).rpartition(":")
    token = os.environ.pop(TOKEN_VAR)
    start = Start()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with socket.create_connection((host, int(port))) as sock:
        send(sock, {"token": token, "rank": rank, "world_size": world_size, "pid": os.getpid()})
        while True:
            try:
                request = receive(sock)
            except EOFError:  # the test process is gone
                return
            if request.get("quit"):
                return
            send(sock, serve(request, start))


if __name__ == "__main__":
    main()
