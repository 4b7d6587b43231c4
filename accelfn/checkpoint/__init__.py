"""Checkpoints: the snapshot of a TrainState in memory and on disk.

``snapshot``/``restore`` take and put back a detached CPU copy of everything a run needs
(``snapshots.py``, ``restoring.py``); ``save``/``load`` write and read it as a directory
(``io.py``): ``manifest.json`` (orjson via cattrs: format and library versions, counters,
per-rank RNG and transform states, optimizer/scheduler skeletons, the program's transforms,
a checksum of every tensor file), ``manifest.sha256`` (the manifest's own) and
``.safetensors`` tensor files. A directory is written atomically (``_atomic.py``), loaded
without unpickling anything (``_codec.py``: records by stable tags, ``_tags.py``), verified
against its checksums, and checked value by value against the state it is loaded into
before anything in that state changes. ``Checkpoints`` (``policy.py``) is where and how
often ``run`` saves, and whether in the background (``background.py``). Tensor files are
written and read with their XXH3-128 checksums in one pass (``_hashed_io.py``,
``_checksums.py``).
"""

from accelfn.checkpoint.export import save_model
from accelfn.checkpoint.io import load, save
from accelfn.checkpoint.policy import Checkpoints
from accelfn.checkpoint.restoring import restore
from accelfn.checkpoint.snapshots import Snapshot, snapshot

__all__ = ["Checkpoints", "Snapshot", "load", "restore", "save", "save_model", "snapshot"]
