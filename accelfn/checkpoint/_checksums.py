"""Checksums of tensor files, by the name a manifest records: ``xxh3_128`` or ``sha256``.

Tensor files are hashed with XXH3-128 (the ``xxhash`` package): a non-cryptographic hash
built for checksums at memory speed (measured on 96 MiB here: 13 GB/s on one core, and the
package releases the GIL, so files hash in parallel; sha256 ran at 0.8 GB/s, crc32c at
5.3 GB/s, blake3 at 1.5 GB/s). Its 128 bits make an undetected accidental corruption
vanishingly unlikely; it does not protect against a deliberate forgery, which a checkpoint
beside its own manifest could not anyway. Format versions up to 3 used sha256, which is
still read (and written, when ``xxhash`` is not installed).

References:
    Y. Collet, "xxHash - Extremely fast hash algorithm", https://xxhash.com (XXH3).
"""

from __future__ import annotations

import hashlib
from typing import Protocol

from accelfn.errors import CheckpointError

try:  # a dependency of accelfn; an install without it writes sha256 and reads xxh3 with a clear error
    import xxhash
except ImportError:  # pragma: no cover - where xxhash is not installed
    xxhash = None  # type: ignore[assignment]

#: the algorithms a manifest may name, fastest first
ALGORITHMS = ("xxh3_128", "sha256")


class Hasher(Protocol):
    """An incremental hash (``hashlib``'s interface)."""

    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


def default() -> str:
    """The algorithm new checkpoints use: ``"xxh3_128"``, or ``"sha256"`` without ``xxhash``."""
    return "xxh3_128" if xxhash is not None else "sha256"


def new(algorithm: str) -> Hasher:
    """A fresh hasher of ``algorithm`` (one of ``ALGORITHMS``).

    Raises:
        CheckpointError: an unknown algorithm, or ``xxh3_128`` without ``xxhash`` installed.
    """
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "xxh3_128":
        if xxhash is None:
            raise CheckpointError("this checkpoint's files are checked with xxh3_128, which needs the xxhash "
                                  "package (a dependency of accelfn): pip install xxhash")
        return xxhash.xxh3_128()
    raise CheckpointError(f"unknown checksum algorithm {algorithm!r}; this accelfn knows {', '.join(ALGORITHMS)} "
                          "(a newer accelfn wrote it?)")
