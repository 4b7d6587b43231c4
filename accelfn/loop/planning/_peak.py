"""The peak bytes a stretch of tensor code adds, counted per operator as it runs.

``torch.distributed._tools.mem_tracker.MemTracker`` counts the same bytes (each new tensor
storage an operator returns, from that operator until the storage is freed), but after every
operator it walks all the modules it tracks to keep per-module peaks: quadratic in the size of
the model, 15 s for one micro-batch of a 1B-parameter transformer. The plan needs only the
peak of the whole micro-batch, so this mode keeps one running total and its maximum: the count
per operator is constant. On the same program it gives MemTracker's peak minus the storages
that existed before (parameters, buffers, the batch), to the byte.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError):  # a tensor without storage of its own (sparse, ...)
        return None


#: the CUDA caching allocator's smallest block: each allocation takes a multiple of it
CUDA_BLOCK_BYTES = 512


def _allocated(st: torch.UntypedStorage) -> int:
    """Bytes the device's allocator hands out for ``st``: on CUDA rounded up to 512-byte blocks
    (as MemTracker and ``torch.cuda.memory_allocated`` count them), elsewhere its size."""
    if st.device.type == "cuda":
        return -(-st.nbytes() // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
    return st.nbytes()


class PeakTracker(TorchDispatchMode):
    """Counts the bytes of the storages that operators create while it is active.

    Storages that existed before (``known``) and those already counted are not counted again;
    a counted storage stops counting when Python frees it (a weak reference's callback).

    Attributes:
        current: bytes of the counted storages alive now.
        peak: the largest ``current`` seen after any operator, in bytes.
    """

    def __init__(self, known: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        # id of a storage -> (a weak reference to it, [its bytes as counted], or None for a known
        # one); a storage's id is dropped by the callback that runs as it is freed, before the id
        # can be reused
        self._seen: dict[int, tuple[weakref.ref[torch.UntypedStorage], list[int] | None]] = {}
        self._known: list[torch.UntypedStorage] = []  # kept alive: counted as there all along
        for t in known:
            st = _storage(t)
            if st is not None and id(st) not in self._seen:
                self._known.append(st)
                self._seen[id(st)] = (weakref.ref(st), None)

    def _freed(self, key: int, counted: list[int], _ref: object) -> None:
        self._seen.pop(key, None)
        self.current -= counted[0]

    def _count(self, st: torch.UntypedStorage) -> None:
        entry = self._seen.get(id(st))
        if entry is not None:  # seen before: a storage an out= or resize_ operator grew counts anew
            counted = entry[1]
            if counted is not None and counted[0] != _allocated(st):
                self.current += _allocated(st) - counted[0]
                counted[0] = _allocated(st)
            return
        new = [_allocated(st)]
        key = id(st)
        self._seen[key] = (weakref.ref(st, functools.partial(self._freed, key, new)), new)
        self.current += new[0]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = _storage(t)
                if st is not None:
                    self._count(st)
        self.peak = max(self.peak, self.current)
        return out
