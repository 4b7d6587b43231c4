"""Reads TensorBoard event files (TFRecord framing + tensorboardX's Event protobuf)."""

from __future__ import annotations

import struct
from collections import defaultdict
from pathlib import Path

from tensorboardX.proto import event_pb2


def read_scalars(path: Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` of every scalar in one event file."""
    scalars: dict[str, list[tuple[int, float]]] = defaultdict(list)
    data = path.read_bytes()
    offset = 0
    while offset < len(data):
        (length,) = struct.unpack_from("<Q", data, offset)
        record = data[offset + 12: offset + 12 + length]
        offset += 12 + length + 4
        event = event_pb2.Event.FromString(record)
        for value in event.summary.value:
            scalars[value.tag].append((event.step, value.simple_value))
    return dict(scalars)
