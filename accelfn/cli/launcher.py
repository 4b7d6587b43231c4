"""``af.launch(fn, *args, nproc_per_node=N)``: a function run in N worker processes, from a
notebook or a script (Accelerate's ``notebook_launcher``), by torch's elastic agent."""

from __future__ import annotations

import importlib
import io
import multiprocessing
import os
import pickle
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import orjson

from accelfn.cli import _loopback
from accelfn.cli.config import LaunchConfig
from accelfn.distributed.engines import World, placement
from accelfn.distributed.env import DEFAULT_TIMEOUT_S, launcher_environment
from accelfn.distributed.process_group import user_code
from accelfn.errors import LaunchError

_R = TypeVar("_R")
_START_METHODS = ("spawn", "fork", "forkserver")
#: set for the workers of ``launch``: the folder where a worker writes the exception it raised
#: (a spawned worker inherits it while it imports the script, before it has its arguments)
FAILURES_ENV = "ACCELFN_LAUNCH_FAILURES"


def launch(fn: Callable[..., _R], *args: Any, nproc_per_node: int = 2, backend: str | None = None,
           timeout_s: float = DEFAULT_TIMEOUT_S, start_method: str | None = None) -> _R:
    """Runs ``fn(*args)`` in ``nproc_per_node`` processes on this machine and returns rank 0's
    result: the workers of ``accelfn launch``, started by torch's elastic agent
    (``torch.distributed.launcher.elastic_launch``, torchrun's own), each with ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` and accelfn's launch settings, so
    ``af.backends.auto()`` inside ``fn`` joins the process group. When a worker raises,
    the agent stops the others and ``launch`` raises that worker's exception (the first
    raised, with its traceback and rank in a note); a worker that dies without an exception
    (a signal, ``os._exit``) raises ``LaunchError``.

    Args:
        fn: the function; with ``start_method="spawn"`` (or ``"forkserver"``) it must be
            importable by name (a module's top-level ``def``, not a lambda or a nested
            function) and ``args`` picklable; in a script, keep the call under
            ``if __name__ == "__main__":`` (each spawned worker imports the script). Its
            result must be picklable (it is sent back to this process).
        *args: the arguments of ``fn``.
        nproc_per_node: processes to start, >= 1.
        backend: ``"cpu"``, ``"cuda"`` or ``"xla"`` for ``auto()`` in the workers
            (``accelfn launch --backend``), or None to let ``auto()`` choose.
        timeout_s: the collective timeout of the workers' process groups, and the wait for
            every worker to join, in seconds (``accelfn launch --timeout-s``' default).
        start_method: how workers start: ``"spawn"``, ``"fork"`` or ``"forkserver"``; None
            for ``"fork"`` where ``__main__`` is not a file (a notebook, a REPL, a script
            read from stdin: a spawned worker could not import their functions), else
            ``"spawn"``.

    Returns:
        rank 0's return value.

    Raises:
        TypeError: ``fn`` is not callable; with a spawning ``start_method``, ``fn`` or an
            argument cannot be pickled (a lambda, a nested function, a lock, ...), raised
            before any worker starts; a worker's result cannot be pickled (raised from rank 0
            or the first rank that returned one).
        ValueError: an unknown ``start_method``; a bad ``nproc_per_node``, ``backend`` or
            ``timeout_s`` (as ``accelfn launch`` checks them).
        LaunchError: a worker that died without an exception, or a rendezvous that failed;
            an engine that started this process as one of several (a Kubeflow pod of a
            PyTorchJob, a task of an ``srun`` step, an ``mpirun`` rank: each would train alone);
            ``launch`` called while a spawned worker imports the script (a script without
            ``if __name__ == "__main__":``, whose top level each worker runs again).
        BaseException: the exception a worker raised (its class, rebuilt from its arguments;
            a LaunchError with its traceback where that cannot be done).

    Example:
        >>> import accelfn as af
        >>> def world_size():
        ...     return af.backends.auto().world_size
        >>> af.launch(world_size, nproc_per_node=2)  # doctest: +SKIP
        2
    """
    if not callable(fn):
        raise TypeError(f"launch(fn, ...) takes a function, got {type(fn).__name__}")
    if getattr(multiprocessing.current_process(), "_inheriting", False):  # multiprocessing's own test
        _refuse_in_a_starting_worker()
    if start_method is None:
        main = getattr(sys.modules.get("__main__"), "__file__", None)  # "<stdin>" for python reading stdin
        start_method = "spawn" if main is not None and os.path.isfile(main) else "fork"
    if start_method not in _START_METHODS:
        raise ValueError(f"launch(start_method={start_method!r}): accepted values are "
                         f"{', '.join(map(repr, _START_METHODS))} or None")
    try:
        config = LaunchConfig(nproc_per_node=nproc_per_node, backend=backend, timeout_s=timeout_s)
        config.check()
    except LaunchError as e:
        raise ValueError(f"launch(...): {e}") from None
    _refuse_a_placed_process(placement(os.environ))
    if start_method != "fork":
        _check_picklable(fn, args)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig as ElasticConfig
    from torch.distributed.launcher.api import elastic_launch

    with (tempfile.TemporaryDirectory(prefix="accelfn-launch-") as failures, _worker_environment(config, failures),
          _loopback.rendezvous_store(config) as port):  # the job listens on loopback alone
        elastic = ElasticConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc_per_node, run_id=uuid.uuid4().hex,
                                rdzv_backend="c10d", rdzv_endpoint=f"{_loopback.LOOPBACK}:{port}",
                                local_addr=_loopback.LOOPBACK, max_restarts=0, start_method=start_method,
                                rdzv_configs={"join_timeout": timeout_s})
        try:
            results = elastic_launch(elastic, _run_worker)(fn, args, failures)
        except ChildFailedError as e:
            raise _worker_failure(Path(failures), e) from None
    return results[0]


def _refuse_a_placed_process(world: World | None) -> None:
    """Raises LaunchError where an engine started this process as one of several (``world``,
    from ``engines.placement``): ``launch`` starts a world on this machine alone, so each of
    the engine's processes would train alone on the whole data set."""
    if world is None:
        return
    taken = ", ".join(f"{name}={value}" for name, value in world.taken[:2])
    raise LaunchError(
        f"af.launch starts workers on this machine alone, but {world.engine} ({taken}) started this process as "
        f"process {world.rank} of {world.world_size}: each of them would start a world of its own and train alone on "
        "the whole data set. Make the engine's command `accelfn launch --nproc-per-node N script.py` (it joins the "
        f"{world.world_size} processes' nodes into one world), or call af.launch from one process (`srun "
        "--ntasks=1`, a single pod, or unset the engine's variables)"
    )


def _check_picklable(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Pickles ``fn`` and each argument as a spawned worker's start does (multiprocessing's
    pickler, into nothing), before any worker starts.

    Raises:
        TypeError: ``fn`` or an argument cannot be pickled, naming it and the fix.
    """
    from multiprocessing.reduction import ForkingPickler

    for what, value in (("fn", fn), *((f"argument {i}", arg) for i, arg in enumerate(args))):
        try:
            ForkingPickler(_Discard(), pickle.HIGHEST_PROTOCOL).dump(value)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            name = getattr(value, "__qualname__", type(value).__name__)
            fix = (f"Define {name!r} with `def` at the top level of a module or of the script (a lambda or a "
                   "function defined inside another cannot be imported by name)" if what == "fn" else
                   "Pass something picklable (data, paths, tensors), or build the object inside fn")
            raise TypeError(f"launch(...): {what} ({name}) cannot be sent to the spawned workers: "
                            f"{type(e).__name__}: {e}. {fix}, or pass start_method=\"fork\" (Linux; a notebook's "
                            "default), which copies this process instead") from None


class _Discard(io.RawIOBase):
    """A file that keeps nothing written to it."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return len(memoryview(data))


def _refuse_in_a_starting_worker() -> None:
    """Raised where ``launch`` is called while a spawned worker imports the script (its top
    level runs again in every worker when it is not under ``if __name__ == "__main__":``); the
    reason is also written for the launching process, which raises it in turn.

    Raises:
        LaunchError: always.
    """
    script = getattr(sys.modules.get("__mp_main__"), "__file__", None) or "the script"
    message = (f"af.launch was called again while a spawned worker was importing {script}: its top level, "
               "which calls af.launch, runs in every worker. Put the code that starts the workers under "
               "`if __name__ == \"__main__\":` (as multiprocessing's spawn start method requires), e.g. "
               "`if __name__ == \"__main__\": print(af.launch(fn, nproc_per_node=2))`")
    folder = os.environ.get(FAILURES_ENV)
    if folder and os.path.isdir(folder):
        record = {"raised_ns": time.monotonic_ns(), "rank": None, "module": LaunchError.__module__,
                  "name": LaunchError.__qualname__, "args": [message], "traceback": ""}
        (Path(folder) / f"starting{os.getpid()}").write_bytes(orjson.dumps(record))
    raise LaunchError(message)


@contextmanager
def _worker_environment(config: LaunchConfig, failures: str) -> Iterator[None]:
    """This process's environment with the variables ``accelfn launch`` gives its workers
    (which inherit it when they start) and the folder for their exceptions; afterwards the
    environment as it was (torch's agent sets variables of its own in it too)."""
    saved = dict(os.environ)
    try:
        for name, value in {**config.worker_env(), **launcher_environment(config.backend),
                            **_loopback.worker_variables(config, os.environ), FAILURES_ENV: failures}.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name in set(os.environ) - set(saved):
            del os.environ[name]
        os.environ.update(saved)


def _run_worker(fn: Callable[..., _R], args: tuple[Any, ...], failures: str) -> _R:
    """A worker: ``fn(*args)``; an exception is written to ``failures/rank<r>`` (JSON: when it
    was raised, its class by module and name, its arguments where they are JSON values, and
    its traceback) for the launching process, then raised."""
    try:
        with user_code("af.launch's function"):  # raised on one rank: leave without the exit barrier
            result = fn(*args)
        _check_result(fn, result)
        return result
    except BaseException as e:
        rank = int(os.environ.get("RANK", "0"))
        try:
            arguments = orjson.loads(orjson.dumps(list(e.args)))
        except (TypeError, orjson.JSONEncodeError):
            arguments = None  # the launching process raises it as text
        record = {"raised_ns": time.monotonic_ns(), "rank": rank, "module": type(e).__module__,
                  "name": type(e).__qualname__, "args": arguments, "traceback": "".join(traceback.format_exception(e))}
        (Path(failures) / f"rank{rank:06d}").write_bytes(orjson.dumps(record))
        raise


def _check_result(fn: Callable[..., Any], result: Any) -> None:
    """Raises TypeError, naming ``fn`` and the result's type, where ``result`` cannot be pickled
    to be sent back to the launching process (torch's agent would fail after ``fn`` returned,
    with no word of why)."""
    from multiprocessing.reduction import ForkingPickler

    try:
        ForkingPickler(_Discard(), pickle.HIGHEST_PROTOCOL).dump(result)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(f"launch(...): {getattr(fn, '__qualname__', fn)!s} returned a "
                        f"{type(result).__module__}.{type(result).__qualname__} that cannot be sent back to the "
                        f"launching process ({type(e).__name__}: {e}); return picklable values (tensors, numbers, "
                        "lists, dicts, state_dict()s), or save the object to a file and return its path") from None


def _worker_failure(failures: Path, error: Exception) -> BaseException:
    """The exception raised first (the others are most often the collectives it broke on
    the other ranks), rebuilt from its class and arguments, with a note that gives its rank
    and traceback; a LaunchError holding that traceback where the class cannot be rebuilt
    so; a LaunchError with the agent's report where no worker raised."""
    raised = []
    for path in failures.iterdir():
        record = orjson.loads(path.read_bytes())
        raised.append((record["raised_ns"], -1 if record["rank"] is None else record["rank"], record))
    if not raised:
        return LaunchError(f"launch: a worker ended without raising an exception (a signal or os._exit): {error}")
    _, rank, record = min(raised, key=lambda r: r[:2])
    if record["rank"] is None:  # raised while the worker started, before fn: its message says it all
        return LaunchError(*record["args"])
    note = f"raised in af.launch's worker of rank {rank}:\n{record['traceback']}"
    exception = _rebuilt(record)
    if exception is None:
        return LaunchError(f"launch: rank {rank} raised {record['module']}.{record['name']}, which cannot be "
                           f"raised here again from its arguments; {note}")
    if hasattr(exception, "add_note"):
        exception.add_note(note)
    return exception


def _rebuilt(record: dict[str, Any]) -> BaseException | None:
    """The exception of class ``record["module"].record["name"]`` built from ``record["args"]``,
    or None (its module does not import here, it is no exception class, or its arguments
    did not survive JSON or do not build it)."""
    if record["args"] is None:
        return None
    try:
        cls: Any = importlib.import_module(record["module"])
        for part in record["name"].split("."):
            cls = getattr(cls, part)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            return cls(*record["args"])
    except Exception:  # noqa: BLE001 (any failure to rebuild it: raise the text instead)
        return None
    return None
