"""The process's resident memory, read without a dependency (``resource.getrusage``)."""

from __future__ import annotations

import sys

try:
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]


def peak_rss_bytes() -> int:
    """The peak resident set size of this process so far, in bytes (0 where unknown).

    ``getrusage``'s ``ru_maxrss`` is in KiB on Linux and in bytes on macOS; one call costs
    about a microsecond, so it is read at every log point.
    """
    if resource is None:
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024
