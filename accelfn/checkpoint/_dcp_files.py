"""A sharded checkpoint's DCP files: their checksums as written, and their checks before a load."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from accelfn.checkpoint import _tensorfiles
from accelfn.checkpoint._context import ProcessContext
from accelfn.checkpoint._exchange import exchange
from accelfn.checkpoint._manifest import FileEntry
from accelfn.errors import CheckpointError

#: the folder of a checkpoint holding DCP's files, and their tensor-table group in the manifest
DCP_DIR = "dcp"
GROUP = "dcp"
_RANK_FILE = re.compile(r"^shard-(\d{5})-model-\d{5}-of-\d{5}\.safetensors$")


def own_files(folder: Path, rank: int) -> dict[str, dict[str, Any]]:
    """Checksum and size of the DCP files rank ``rank`` wrote into ``folder``."""
    mine = sorted(e.name for e in os.scandir(folder)
                  if (m := _RANK_FILE.match(e.name)) is not None and int(m[1]) == rank + 1)
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        digests = list(pool.map(lambda n: _tensorfiles.hash_file(folder / n), mine))
    return {name: {algorithm: digest, "num_bytes": (folder / name).stat().st_size}
            for name, (algorithm, digest) in zip(mine, digests)}


def verify_files(backend: ProcessContext, directory: Path, files: Mapping[str, FileEntry]) -> None:
    """Checks the size and checksum of every DCP file, the ranks sharing the work.

    Raises:
        CheckpointError: on every rank, naming each missing, truncated or corrupted file.
    """
    names = sorted(name for name, entry in files.items() if entry.group == GROUP)
    mine = names[backend.rank::backend.world_size]

    def check(name: str) -> str | None:
        try:
            _tensorfiles.verify_file(directory / name, files[name])
        except CheckpointError as e:
            return str(e)
        return None

    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        found = [problem for problem in pool.map(check, mine) if problem is not None]
    problems = [p for found_by_rank in exchange(backend, found) for p in found_by_rank]
    if problems:
        raise CheckpointError("\n".join(problems))


def unexpected_files(directory: Path, files: Mapping[str, FileEntry]) -> list[str]:
    """Files in ``dcp/`` the manifest does not list (DCP's reader would read them too)."""
    listed = {name.removeprefix(f"{DCP_DIR}/") for name, e in files.items() if e.group == GROUP}
    try:
        present = {e.name for e in os.scandir(directory / DCP_DIR)}
    except FileNotFoundError:
        return []
    return sorted(present - listed)
