"""Small JSON values between the ranks of a checkpoint's process context, without pickle.

``torch.distributed``'s ``*_object`` collectives pickle what they send; checkpoints keep
to JSON (orjson) in a uint8 tensor over the context's own ``gather``.
"""

from __future__ import annotations

import struct
from typing import Any

import orjson
import torch

from accelfn.checkpoint._context import ProcessContext

__all__ = ["exchange"]


def exchange(backend: ProcessContext, value: Any) -> list[Any]:
    """Every rank's JSON-able ``value``, in rank order, on every rank (a collective).

    Raises:
        TypeError: ``value`` is not JSON-able (orjson's).
    """
    if backend.world_size == 1:
        return [orjson.loads(orjson.dumps(value))]
    data = orjson.dumps(value)
    payload = torch.frombuffer(bytearray(struct.pack("<Q", len(data)) + data), dtype=torch.uint8)
    lengths = backend.gather(torch.tensor([payload.numel()], dtype=torch.int64)).cpu().tolist()
    gathered = backend.gather(payload).cpu().numpy().tobytes()
    values, offset = [], 0
    for n in lengths:
        (length,) = struct.unpack_from("<Q", gathered, offset)
        values.append(orjson.loads(gathered[offset + 8:offset + 8 + length]))
        offset += n
    return values
