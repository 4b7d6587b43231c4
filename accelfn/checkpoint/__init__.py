"""Checkpoints: the snapshot of a TrainState in memory and on disk.

``snapshot``/``restore`` take and put back a detached CPU copy of everything a run needs
(``snapshot.py``). ``save``/``load`` write and read it as a directory, collectively and
atomically, in one flow for sharded and unsharded states (``save_load.py``: a load is
``open_checkpoint``, which verifies and checks everything, then ``Opened.put``).
``Checkpoints`` is where and how often ``run`` saves, how many it keeps, and whether in the
background (``checkpoints.py``); ``save_model`` exports consolidated weights for inference
(``export.py``). ``_format.pack_live`` packs a live state for a replica group that heals
from it under ``tolerate_faults`` (the same encoding, in memory).

The layout of a checkpoint directory is described once, in docs/06-checkpoints.md ("The
format"): ``manifest.json`` written last (its schema ``_manifest.py``, the snapshot encoded
into it ``_format.py``), ``manifest.sha256``, the tensor files (``_tensorfiles.py``), and
``dcp/`` for a sharded state (``_sharded.py``; its frozen tensors, a LoRA's base, in
``dcp-frozen/``, written once per run: ``_frozen.py``); the directory is written as a hidden
sibling and renamed into place (``_atomic.py``), so a crash at any instant leaves the old
checkpoint or the new one. Nothing in it is a pickle, and loading never unpickles: records
carry stable tags from one closed registry, never module paths (``_codec.py``, with the
rules a snapshot's values meet). A save checks what it writes by the reader a load runs.
"""

from accelfn.checkpoint._format import LiveTransfer
from accelfn.checkpoint.checkpoints import Checkpoints
from accelfn.checkpoint.export import load_model, save_model
from accelfn.checkpoint.save_load import Opened, find_checkpoint, load, open_checkpoint, save
from accelfn.checkpoint.snapshot import Snapshot, restore, snapshot
from accelfn.distributed.fault_tolerance import register_transfer

register_transfer(LiveTransfer())  # distributed.fault_tolerance, the layer below, moves the bytes

__all__ = ["Checkpoints", "Opened", "Snapshot", "find_checkpoint", "load", "open_checkpoint", "restore", "save",
           "save_model", "snapshot", "load_model"]
