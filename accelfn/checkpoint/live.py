"""A live TrainState sent to another process: its snapshot in the checkpoint's own encoding,
in memory, for ``tolerate_faults``' healing replica groups.

``pack`` encodes the snapshot as a checkpoint does (``_codec``: plain JSON with tagged
records, every tensor in a table) and packs the JSON and the tensors' raw bytes into one
``uint8`` tensor (``_tensorfiles.pack_tensors``); ``unpack`` decodes it, never unpickling, checks it
against the receiving state exactly as a load does (``snapshot.verify``), then puts it in
place. Importing this module registers it with ``accelfn.distributed.fault_tolerance``, the
layer below, which moves the bytes between replica groups.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from accelfn._version import __version__
from accelfn.checkpoint._codec import Encoder, decode
from accelfn.checkpoint._tensorfiles import pack_tensors, unpack_tensors
from accelfn.checkpoint.snapshot import Snapshot, capture, put, verify
from accelfn.distributed.fault_tolerance import register_transfer
from accelfn.errors import CheckpointError
from accelfn.state import TrainState

#: what the header calls this encoding; another one is refused rather than misread
FORMAT = "accelfn-live-state-1"
_FIELDS = tuple(f.name for f in attrs.fields(Snapshot))


def pack(state: TrainState) -> torch.Tensor:
    """Everything ``state`` is (its snapshot: model, optimizer, scheduler, ``extra``, counters
    and data position, transform states, open-window gradients, this process's RNG states)
    as bytes in a ``uint8`` tensor. Nothing in ``state`` changes.

    Raises:
        TypeError: an ``extra`` object whose ``state_dict`` holds what a checkpoint cannot.
    """
    snap = capture(state, copy=False)
    encoder = Encoder()
    plain = {name: encoder.encode(getattr(snap, name), name) for name in _FIELDS}
    return pack_tensors({"format": FORMAT, "accelfn": __version__, "snapshot": plain}, encoder.tensors)


def unpack(state: TrainState, data: torch.Tensor, *, source: str) -> TrainState:
    """The state ``pack`` packed, checked against ``state`` and put into it (in place).

    Args:
        state: the receiving state (its model, optimizer, scheduler and ``extra`` objects are
            loaded; the returned record holds the sender's counters and transform states).
        data: ``pack``'s ``uint8`` tensor.
        source: what sent it, for messages.

    Returns:
        TrainState: ``state`` as the sender's.

    Raises:
        CheckpointError: ``data`` is not a packed state of this accelfn, holds values no
            state could take, or does not fit ``state`` (every difference named); nothing
            was changed.
    """
    try:
        header, tensors = unpack_tensors(data)
        if header.get("format") != FORMAT:
            raise CheckpointError(f"{source} is not in accelfn's live state format ({FORMAT}): its header says "
                                  f"{header.get('format')!r}")
        plain: dict[str, Any] = header["snapshot"]
        snap = Snapshot(**{name: decode(plain[name], tensors, name) for name in _FIELDS})
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{source} does not decode as a state: {type(e).__name__}: {e}") from None
    if header.get("accelfn") != __version__:
        raise CheckpointError(f"{source} comes from accelfn {header.get('accelfn')}, and this process runs "
                              f"{__version__}: run the same accelfn in every replica group")
    verify(state, snap, source=source)
    return put(state, snap, copy=False)


class LiveTransfer:
    """``distributed.fault_tolerance.StateTransfer``: ``pack`` and ``unpack``."""

    def pack(self, state: TrainState) -> torch.Tensor:
        return pack(state)

    def unpack(self, state: TrainState, data: torch.Tensor, *, source: str) -> TrainState:
        return unpack(state, data, source=source)


register_transfer(LiveTransfer())
