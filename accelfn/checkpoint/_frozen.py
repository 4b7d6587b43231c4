"""The frozen part of a model, written once per run: a LoRA's base model in every checkpoint
without rewriting it.

A model fine-tuned with adapters (``peft``'s LoRA) trains a few tensors and leaves the rest
(the base model: almost all of its bytes) untouched. Its checkpoints put the parameters that do
not require gradients (``requires_grad=False``) into files of their own, ``frozen.safetensors``
(``frozen-00000.safetensors``, ... above a shard's size), of the ``model`` group: a reader sees
the same model table as ever, so a checkpoint with frozen files loads in an accelfn that
predates them. Where the previous checkpoint of the same directory (``Checkpoints``) holds a
frozen file of the same name, size and checksum as the one about to be written, the new file
is a hard link to it: the same bytes on disk, nothing written. The decision is by content, not
by trust: the file's checksum is computed over the bytes it would hold (the layout
``_tensorfiles.write_file`` writes), and the linked file is verified on disk (read, hashed)
before it counts; a changed frozen tensor (a layer unfrozen and trained, a base edited by
hand) gives another checksum and a file written afresh. Hashing in memory runs at memory
speed (XXH3-128, ``_tensorfiles``), far below the cost of writing the bytes.

Why hard links rather than a manifest entry that points into an earlier checkpoint: every
checkpoint directory stays complete on its own. Retention (``keep``) deletes any checkpoint
without asking which others refer to it (the file lives on while a link to it does); a
checkpoint copied elsewhere (``cp -r``, ``rsync``) copies the bytes; the reader, the atomic
write (links are made in the temporary directory, before the rename) and every check of a
load are unchanged: a missing, truncated or corrupted frozen file is the ``CheckpointError``
naming the file that any tensor file gets. The cost of sharing: one corrupted frozen file
corrupts every checkpoint that links it (each load then refuses it, naming the file; a
reference into an earlier checkpoint would share that fate). Where the file system refuses a
hard link (another device, a file system without them), the file is written, as before.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from accelfn.checkpoint import _tensorfiles
from accelfn.checkpoint._tensorfiles import SUFFIX, FileEntry
from accelfn.checkpoint.snapshot import clean_name
from accelfn.errors import CheckpointError

#: the file name (stem) of a checkpoint's frozen model tensors
STEM = "frozen"
#: the tensor table frozen files belong to: the model's own
GROUP = "model"
#: errors of ``os.link`` that mean "no hard links here": the file is written instead
_NO_LINKS = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}


def names(model: torch.nn.Module) -> frozenset[str]:
    """The checkpoint names (``state_dict`` names, ``clean_name``) of the unwrapped ``model``'s
    parameters that do not require gradients, every name of a tied one."""
    return frozenset(clean_name(name) for name, p in model.named_parameters(remove_duplicate=False)
                     if not p.requires_grad)


def split(tensors: Mapping[str, torch.Tensor], frozen: frozenset[str]) -> tuple[dict[str, torch.Tensor],
                                                                              dict[str, torch.Tensor]]:
    """``tensors`` (the model table, key -> tensor) as (the others, the frozen ones)."""
    if not frozen:
        return dict(tensors), {}
    rest = {k: t for k, t in tensors.items() if k not in frozen}
    return rest, {k: t for k, t in tensors.items() if k in frozen}


def _filenames(num_files: int) -> list[str]:
    return [STEM + SUFFIX] if num_files == 1 else [f"{STEM}-{i:05d}{SUFFIX}" for i in range(num_files)]


def _linked(directory: Path, filename: str, earlier: Path, entry: FileEntry) -> bool:
    """Hard-links ``earlier/filename`` as ``directory/filename`` if it is intact (its size and
    checksum those of ``entry``); False where it is not, or the file system has no links."""
    try:
        _tensorfiles.verify_file(earlier / filename, entry)
    except CheckpointError:  # gone or damaged: written afresh
        return False
    try:
        os.link(earlier / filename, directory / filename)
    except FileNotFoundError:  # deleted between the check and the link
        return False
    except OSError as e:
        if e.errno in _NO_LINKS:
            return False
        raise
    return True


def write(directory: Path, tensors: Mapping[str, torch.Tensor], earlier: tuple[Path, Mapping[str, FileEntry]] | None,
          algorithm: str | None = None) -> tuple[dict[str, FileEntry], int]:
    """Writes the frozen ``tensors`` into ``directory`` (``frozen*.safetensors``, group
    ``model``), each file a hard link to ``earlier``'s identical one where it has one.

    Args:
        directory: the checkpoint's (temporary) directory.
        tensors: the frozen tensors, by key of the model table.
        earlier: the previous checkpoint's directory and its manifest's files, or None.
        algorithm: the checksum (one of ``_tensorfiles.ALGORITHMS``); by default the default.

    Returns:
        tuple: file name -> FileEntry, and the bytes written (0 when every file was linked).

    Raises:
        OSError: the file system refused (other than refusing a hard link).
        TypeError: a dtype that safetensors cannot store.
    """
    if not tensors:
        return {}, 0
    algorithm = algorithm or _tensorfiles.default()
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    shards = _tensorfiles.split_shards(tensors, _tensorfiles.shard_bytes(total))
    entries, written = {}, 0
    for filename, shard in zip(_filenames(len(shards)), shards):
        on_cpu = {k: t.to("cpu") for k, t in shard.items()}
        before = earlier[1].get(filename) if earlier is not None else None
        if before is not None and before.group == GROUP and before.checksum[0] == algorithm:
            digest, num_bytes = _tensorfiles.checksum(on_cpu, algorithm)
            if (digest, num_bytes) == (before.checksum[1], before.num_bytes) and _linked(
                    directory, filename, earlier[0], before):  # type: ignore[index]  # not None: `before` is set
                entries[filename] = FileEntry(group=GROUP, num_bytes=num_bytes, rank=None, **{algorithm: digest})
                continue
        digest, num_bytes = _tensorfiles.write_file(directory / filename, on_cpu, algorithm)
        entries[filename] = FileEntry(group=GROUP, num_bytes=num_bytes, rank=None, **{algorithm: digest})
        written += num_bytes
    return entries, written
