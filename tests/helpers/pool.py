"""A pool of started ``accelfn launch`` worker processes that tests share instead of a launch each.

Starting a 2-process job costs three imports of torch (the launcher and each worker) and
torchrun's start-up: several seconds each time, most of the suite's time. Tests whose
subject is not the launch itself (training, checkpoints, collectives across ranks) run their
worker script in a pool instead: one ``accelfn launch LAUNCH_ARGS... tests/workers/pool.py``
job per distinct ``LAUNCH_ARGS``, started at first use and kept for the session
(``tests/conftest.py``'s ``pool`` fixture).

Each run is a *scenario*: either a worker script of ``tests/workers`` with its arguments,
run as ``__main__`` on every rank the way the launch would run it (``Pools.launch``, the
same arguments as ``tests.helpers.launch.launch``), or a function of a module of
``tests.workers`` called with JSON keyword arguments, returning JSON (``Pools.call``). Every
rank runs it in a fresh default process group on a new port, with the environment, working
directory, arguments, random generators and signal handlers of a freshly started worker,
and puts them all back afterwards (``tests/workers/pool.py``).

A scenario that fails on some rank fails the test with that rank's traceback; the pool is
then ended (the other rank may be waiting in a collective for the failed one) and the next
test starts a new one, so a failure never leaks into another test. A worker that dies, or a
scenario that does not finish within its timeout, is handled the same way.

The pool talks to its workers over one TCP connection per rank on 127.0.0.1 (length-prefixed
JSON, no pickle), authenticated by a random token the job gets in its environment.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import select
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.helpers import launch as _launch

SERVER = _launch.WORKERS / "pool.py"
START_TIMEOUT_S = 180
ADDRESS_VAR, TOKEN_VAR = "ACCELFN_TEST_POOL", "ACCELFN_TEST_POOL_TOKEN"
_HEADER = struct.Struct("!Q")


class PoolError(AssertionError):
    """A pooled scenario failed, or the pool's workers died or did not answer in time."""


def send(sock: socket.socket, message: Any) -> None:
    """Sends ``message`` as length-prefixed JSON."""
    data = json.dumps(message).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def receive(sock: socket.socket, deadline: float | None = None) -> Any:
    """The next length-prefixed JSON message; raises EOFError when the peer closed, TimeoutError after ``deadline``."""
    header = _read(sock, _HEADER.size, deadline)
    return json.loads(_read(sock, _HEADER.unpack(header)[0], deadline))


def _read(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    chunks, left = [], n
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([sock], [], [], wait)[0]:
                raise TimeoutError
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class Pool:
    """One started ``accelfn launch LAUNCH_ARGS... pool.py`` job and a connection to each of its ranks."""

    def __init__(self, launch_args: tuple[str, ...], log: Path) -> None:
        self.launch_args = launch_args
        self.log = log
        self.base_env = _launch.environment()
        token = secrets.token_hex(16)
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        env = dict(self.base_env, **{ADDRESS_VAR: f"127.0.0.1:{port}", TOKEN_VAR: token})
        with log.open("w") as out:
            self.proc = subprocess.Popen(_launch.accelfn_command("launch", *launch_args, SERVER), env=env,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.ranks: dict[int, socket.socket] = {}
        self.quitting = False
        try:
            self._accept(listener, token)
        except BaseException:
            self.close(kill=True)
            raise
        finally:
            listener.close()

    def _accept(self, listener: socket.socket, token: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        world_size = None
        while world_size is None or len(self.ranks) < world_size:
            if self.proc.poll() is not None:
                raise PoolError(f"the pool's launch exited with {self.proc.returncode} before its workers "
                                f"connected\n{self.output()}")
            if time.monotonic() > deadline:
                raise PoolError(f"the pool's workers did not connect within {START_TIMEOUT_S} s\n{self.output()}")
            if not select.select([listener], [], [], 0.5)[0]:
                continue
            sock, _ = listener.accept()
            try:
                hello = receive(sock, time.monotonic() + 30)
            except (EOFError, TimeoutError, ValueError):
                sock.close()
                continue
            if hello.get("token") != token:  # not one of ours
                sock.close()
                continue
            self.ranks[hello["rank"]] = sock
            world_size = hello["world_size"]

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None and bool(self.ranks)

    def output(self, chars: int = 6000) -> str:
        """The end of what the launcher and its workers printed outside scenarios."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return f"--- pool log {self.log} (last {chars} characters)\n{text[-chars:]}"

    def run(self, request: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
        """Runs one scenario on every rank; the replies in rank order.

        Raises:
            PoolError: a rank failed (its traceback), died, or did not answer within ``timeout_s``;
                the pool is closed then.
        """
        try:
            return self._run(request, timeout_s)
        except PoolError:
            raise
        except BaseException:  # interrupted (a test timeout, Ctrl-C): replies may still come, so no reuse
            self.close(kill=True)
            raise

    def _run(self, request: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
        for sock in self.ranks.values():
            send(sock, request)
        deadline = time.monotonic() + timeout_s
        replies: dict[int, dict[str, Any]] = {}
        problems: dict[int, str] = {}
        pending = dict(self.ranks)
        while pending:
            ready, _, _ = select.select(list(pending.values()), [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                problems.update({r: f"did not finish within {timeout_s:g} s" for r in pending})
                break
            for rank in [r for r, s in pending.items() if s in ready]:
                try:
                    replies[rank] = receive(pending.pop(rank), deadline)
                except (EOFError, ConnectionError):
                    problems[rank] = "died (its connection closed; see the pool log for its last words)"
                except TimeoutError:
                    problems[rank] = f"did not finish within {timeout_s:g} s"
                    continue
                if not replies.get(rank, {"ok": True})["ok"] and pending:
                    # the others may wait in a collective for this rank: give them a moment, no more
                    deadline = min(deadline, time.monotonic() + 5)
        for rank, reply in replies.items():
            if not reply["ok"]:
                problems[rank] = f"failed:\n{reply['error']}"
        if problems:
            self.close(kill=True)
            what = request.get("script") or request.get("function")
            lines = [f"pooled scenario {what} {request.get('args', '')} (pool {' '.join(self.launch_args)}):"]
            for rank in sorted(problems):
                lines.append(f"=== rank {rank} {problems[rank]}")
                reply = replies.get(rank)
                if reply is not None:
                    lines.append(f"--- rank {rank} stdout\n{reply['stdout'][-3000:]}\n"
                                 f"--- rank {rank} stderr\n{reply['stderr'][-6000:]}")
            for rank in sorted(set(replies) - set(problems)):
                lines.append(f"=== rank {rank} finished")
            lines.append(self.output())
            raise PoolError("\n".join(lines))
        return [replies[r] for r in sorted(replies)]

    def quit(self) -> None:
        """Asks the workers to return from their loop (the job then ends; ``close`` waits for it)."""
        if self.quitting:
            return
        self.quitting = True
        for sock in self.ranks.values():
            with contextlib.suppress(OSError):  # already gone: close kills what is left
                send(sock, {"quit": True})

    def close(self, *, kill: bool = False, wait_s: float = 60) -> None:
        """Ends the job: its workers return from their loop, and after ``wait_s`` (or at once,
        with ``kill``) the launch's whole process session is killed."""
        if not kill and self.alive:
            self.quit()
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                kill = True
        if kill and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for sock in self.ranks.values():
            sock.close()
        self.ranks = {}


class Pools:
    """The session's pools, one per distinct set of launch arguments, each started at first use."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._pools: dict[tuple[str, ...], Pool] = {}
        self.started = 0

    def get(self, launch_args: tuple[str, ...]) -> Pool:
        """The live pool of ``launch_args``, started (again, after a failure) when there is none."""
        pool = self._pools.get(launch_args)
        if pool is None or not pool.alive:
            if pool is not None:
                pool.close(kill=True)
            self.started += 1
            pool = self._pools[launch_args] = Pool(launch_args, self.directory / f"pool{self.started}.log")
        return pool

    def launch(self, *launch_args: str | os.PathLike[str], script: str | os.PathLike[str],
               script_args: tuple[Any, ...] = (), cwd: Path | None = None, env: dict[str, str] | None = None,
               timeout_s: float = _launch.DEFAULT_TIMEOUT_S) -> subprocess.CompletedProcess:
        """What ``tests.helpers.launch.launch`` with these arguments does, in a pool of
        ``accelfn launch LAUNCH_ARGS...``: SCRIPT (a name is looked up in tests/workers) runs
        as ``__main__`` on every rank with SCRIPT_ARGS in ``sys.argv``, in ``cwd`` (default:
        the test's), with the variables of ``env`` that differ from ``environment()``.

        Returns the outcome as a successful process's: stdout and stderr, rank 0's then rank 1's.

        Raises:
            PoolError: a rank's script raised or exited non-zero (its traceback), or died.
        """
        path = Path(script)
        if not path.is_absolute() and not path.exists():
            path = _launch.WORKERS / path
        pool = self.get(tuple(map(str, launch_args)))
        replies = pool.run(self._request(pool, cwd, env, script=str(path), args=[str(a) for a in script_args]),
                           timeout_s)
        return subprocess.CompletedProcess(["pool", *pool.launch_args, str(path), *map(str, script_args)], 0,
                                           "".join(r["stdout"] for r in replies),
                                           "".join(r["stderr"] for r in replies))

    def call(self, *launch_args: str, function: str, cwd: Path | None = None, env: dict[str, str] | None = None,
             timeout_s: float = _launch.DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        """Calls ``function`` (``"MODULE:NAME"`` of a module in tests/workers) with the JSON
        keyword arguments ``kwargs`` on every rank of the pool of ``launch_args``; its JSON
        results in rank order.

        Raises:
            PoolError: as ``launch``.
        """
        pool = self.get(tuple(launch_args))
        replies = pool.run(self._request(pool, cwd, env, function=function, kwargs=kwargs), timeout_s)
        return [r["result"] for r in replies]

    @staticmethod
    def _request(pool: Pool, cwd: Path | None, env: dict[str, str] | None, **what: Any) -> dict[str, Any]:
        wanted = _launch.environment() if env is None else env
        changed = {k: v for k, v in wanted.items() if pool.base_env.get(k) != v}
        removed = [k for k in pool.base_env if k not in wanted]
        return {**what, "cwd": str(cwd or Path.cwd()), "port": _launch.free_port(), "env": changed,
                "unset": removed}

    def close(self) -> None:
        """Ends every pool (at the end of the session), all at once."""
        for pool in self._pools.values():
            pool.quit()
        for pool in self._pools.values():
            pool.close(wait_s=5)  # nothing is left to save: no need to wait for torchrun's own shutdown
        self._pools = {}
