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


def read_tensorboard(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` of a directory's scalars as TensorBoard shows them:
    read by TensorBoard's own reader (``EventAccumulator``), which reads every event file
    of the directory in name order and drops the points a restart marker (``purge_step``)
    hides."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(logdir))
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}
