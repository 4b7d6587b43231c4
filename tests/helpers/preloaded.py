"""``python`` and ``accelfn`` commands of the docs' bash blocks, forked from one process that
has imported torch and accelfn already, instead of each importing them anew (about 1.5 s of
CPU a command; a page starts dozens).

``Preloaded`` starts the server: this file run as a script, which imports torch and accelfn
(and accelfn's command line), then waits on a Unix socket. The shims of ``tests/docs`` run
this file as a client (``python -I -S preloaded.py python|accelfn ARGS...``, no torch): it
sends its standard streams, working directory, environment and arguments; the server forks a
monitor, which forks the command's process, reports its pid and then its end (an exit status,
or the signal that ended it) and ends it if the client goes away; the client forwards
SIGTERM, SIGINT and SIGHUP to it and ends as it ended. The command's process takes the
client's streams, directory and environment, and runs as ``python`` would: ``-c CODE``,
``-m MODULE`` or ``SCRIPT`` as ``__main__`` with its ``sys.argv`` and ``sys.path[0]``, ending
through the interpreter's own exit (atexit handlers, a traceback and status 1 for an
exception). Its children (torchrun's workers, a plan's script) are started as always: fresh
interpreters. A ``python`` command with other options (``-u``, ``-W``, none) is not sent:
the client runs the interpreter itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import types
from pathlib import Path

_HEADER = struct.Struct("!I")
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# what the server imports once, for every command to find imported
_PRELOAD = ("torch", "accelfn", "accelfn.cli.commands", "torch.distributed.run")


def _send(conn: socket.socket, payload: bytes, fds: tuple[int, ...] = ()) -> None:
    message = _HEADER.pack(len(payload)) + payload
    if fds:
        socket.send_fds(conn, [message], list(fds))
    else:
        conn.sendall(message)


def _receive(conn: socket.socket, max_fds: int = 0) -> tuple[bytes, list[int]]:
    """One length-prefixed message, and up to ``max_fds`` descriptors sent with it (no byte
    of the next message is read: the client's two messages may arrive together)."""
    if max_fds:
        header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, max_fds)
    else:
        header, fds = conn.recv(_HEADER.size), []
    header += _exactly(conn, _HEADER.size - len(header))
    return _exactly(conn, _HEADER.unpack(header)[0]), fds


def _exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        more = conn.recv(size - len(data))
        if not more:
            raise EOFError("the other end closed the connection")
        data += more
    return data


# ---- the server ---------------------------------------------------------------------------


class Preloaded:
    """The server process (its socket in ``directory``), ended by ``stop``."""

    def __init__(self, directory: Path, env: dict[str, str]) -> None:
        self.socket = directory / "preloaded.sock"
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", str(self.socket)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        ready = self.proc.stdout.readline() if self.proc.stdout else b""
        assert ready == b"ready\n", f"the preloaded server did not start (exit {self.proc.poll()})"

    def stop(self) -> None:
        """Ends the server: it waits for its commands' monitors (so that their CPU time is
        counted as its own), or is killed with them after a minute."""
        try:
            self.proc.communicate(timeout=60)  # closes its standard input: the signal to end
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _serve(path: str) -> dict:
    """Imports, then forks a monitor per request until its standard input closes; returns
    only in a command's process, its request."""
    for module in _PRELOAD:
        __import__(module)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    while select.select([listener, sys.stdin], [], [])[0] != [sys.stdin]:
        conn, _ = listener.accept()
        if os.fork() == 0:  # the monitor
            listener.close()
            try:
                request = _monitor(conn)
            except BaseException:
                os._exit(1)
            if request is not None:  # in the command's process
                return request
            os._exit(0)
        conn.close()
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:  # the monitors that ended
                pass
    listener.close()  # standard input closed: the end
    os.unlink(path)
    with contextlib.suppress(ChildProcessError):
        while True:
            os.wait()
    sys.exit(0)


def _monitor(conn: socket.socket) -> dict | None:
    """Forks the command and returns its request there; here, reports its pid and its end to
    the client, and ends the command (its process group) if the client goes away first."""
    payload, fds = _receive(conn, max_fds=3)
    pid = os.fork()
    if pid == 0:
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        return json.loads(payload)
    for fd in fds:
        os.close(fd)
    _send(conn, str(pid).encode())
    readable, _, _ = select.select([conn, os.pidfd_open(pid)], [], [])
    if conn in readable:  # the client is gone (killed), so is its command
        for kill in (os.killpg, os.kill):  # its group, or itself before it made one
            with contextlib.suppress(ProcessLookupError):
                kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    end = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit": os.waitstatus_to_exitcode(status)}
    with contextlib.suppress(OSError):
        _send(conn, json.dumps(end).encode())
    return None


def _run(request: dict) -> None:
    """Runs the request's command as ``python ARGS`` would, in this (forked) process."""
    os.setsid()  # its own process group, which the monitor ends with it
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    args = request["args"]
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    if args[0] == "-m":
        import runpy
        sys.argv = [args[1], *args[2:]]  # runpy puts the module's path in argv[0]
        sys.path[0] = os.getcwd()
        runpy._run_module_as_main(args[1])  # what ``python -m`` calls
    elif args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[0] = ""
        exec(compile(args[1], "<string>", "exec"), main.__dict__)  # noqa: S102 - the command's code
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        main.__dict__["__file__"] = args[0]
        source = Path(args[0]).read_bytes()
        exec(compile(source, args[0], "exec"), main.__dict__)  # noqa: S102 - the command's script


# ---- the client ---------------------------------------------------------------------------


def _python_args(command: str, args: list[str]) -> list[str] | None:
    """The arguments of ``python`` for the command, None where the server cannot run it."""
    if command == "accelfn":
        return ["-m", "accelfn", *args]
    if args and (args[0] in ("-c", "-m") and len(args) > 1 or not args[0].startswith("-")):
        return args
    return None


def _client(command: str, args: list[str]) -> None:
    python_args = _python_args(command, args)
    server = os.environ.get("ACCELFN_DOCS_PRELOADED")
    if python_args is None or not server:
        os.execv(sys.executable, [sys.executable, *(python_args or args)])
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(server)
    request = {"args": python_args, "cwd": os.getcwd(), "env": dict(os.environ)}
    _send(conn, json.dumps(request).encode(), fds=(0, 1, 2))
    pid = int(_receive(conn)[0])
    for sig in _FORWARDED:
        signal.signal(sig, lambda sig, _: os.kill(pid, sig))
    end = json.loads(_receive(conn)[0])
    if "signal" in end:
        signal.signal(end["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), end["signal"])
    sys.exit(end["exit"])


def _command(request: dict) -> None:
    """The command's process: runs it, and ends as the interpreter would after it."""
    try:
        _run(request)
    except SystemExit:
        raise
    except BaseException as error:  # the traceback from the command's code on, as python prints it
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        sys.excepthook(type(error), error.with_traceback(tb), tb)
        if isinstance(error, KeyboardInterrupt):
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        sys.exit(1)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        _command(_serve(sys.argv[2]))
    else:
        _client(sys.argv[1], sys.argv[2:])
