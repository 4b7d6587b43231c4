"""The process's resident memory, read cheaply and without a dependency."""

from __future__ import annotations

import os
import sys
from typing import IO

try:
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_statm: tuple[int, IO[bytes]] | None = None  # (pid, open /proc/self/statm of that process)


def rss_bytes() -> int:
    """This process's resident set size in bytes: the current one on Linux (the second field of
    ``/proc/self/statm``, kept open: a few microseconds a read), elsewhere the peak so far
    (``getrusage``, which on Linux can take a hundred microseconds); 0 where neither exists."""
    global _statm
    if sys.platform.startswith("linux"):
        if _statm is None or _statm[0] != os.getpid():  # opened by this process, not a parent
            _statm = (os.getpid(), open("/proc/self/statm", "rb"))  # noqa: SIM115 - kept open on purpose
        handle = _statm[1]
        handle.seek(0)
        return int(handle.read().split()[1]) * _PAGE_BYTES
    if resource is None:
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024
