"""Finding the largest batch size that fits: retry with half of it after running out of memory."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

#: what the CPU allocator's error says (it raises a plain RuntimeError, not OutOfMemoryError)
_CPU_OUT_OF_MEMORY = "DefaultCPUAllocator: can't allocate memory"
#: torch_xla's: the XLA runtime's status code for an allocation that failed
_XLA_OUT_OF_MEMORY = "RESOURCE_EXHAUSTED"


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is a device's allocator running out of memory.

    ``torch.OutOfMemoryError`` (CUDA's caching allocator, and XPU/MPS), the CPU allocator's
    ``RuntimeError`` ("DefaultCPUAllocator: can't allocate memory") and torch_xla's
    ``RESOURCE_EXHAUSTED``.
    """
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and (_CPU_OUT_OF_MEMORY in str(error) or _XLA_OUT_OF_MEMORY in str(error))


def free_memory() -> None:
    """Frees what unreachable objects hold: a garbage collection, then the CUDA caching
    allocator's unused blocks (where CUDA is initialized)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def find_batch_size(fn: Callable[[int], T], *, start: int) -> T:
    """``fn(batch_size)`` with the largest batch size, ``start`` halved, that fits in memory.

    Calls ``fn(start)``; when it runs out of memory, frees what the failed attempt held and
    calls ``fn(start // 2)``, then ``start // 4``, ... down to 1. ``fn`` should build
    everything that depends on the batch size (the DataLoader, and the TrainState if a
    failed attempt may have changed it) inside itself.

    Args:
        fn: the work to fit, called with the batch size (an int >= 1).
        start: the first batch size tried (an int >= 1).

    Returns:
        The return value of the first call of ``fn`` that did not run out of memory.

    Raises:
        TypeError: ``fn`` not callable, ``start`` not an int.
        ValueError: ``start`` below 1.
        torch.OutOfMemoryError: ``fn(1)`` ran out of memory too (the message lists the batch
            sizes tried; the last allocator error is its ``__cause__``).
        Exception: whatever else ``fn`` raises, unchanged (no retry).

    References:
        Hugging Face Accelerate, ``accelerate.utils.find_executable_batch_size``.

    Example:
        >>> import accelfn as af
        >>> def fit(batch_size):
        ...     if batch_size > 16:
        ...         raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        ...     return batch_size
        >>> af.find_batch_size(fit, start=64)
        16
    """
    if not callable(fn):
        raise TypeError(f"find_batch_size(fn, ...) needs a callable fn(batch_size), got {type(fn).__name__}")
    if isinstance(start, bool) or not isinstance(start, int):
        raise TypeError(f"find_batch_size(start=...) must be an int, got {start!r}")
    if start < 1:
        raise ValueError(f"find_batch_size(start={start}): must be >= 1")
    tried: list[int] = []
    batch_size = start
    while True:
        tried.append(batch_size)
        try:
            return fn(batch_size)
        except Exception as error:  # noqa: BLE001 (only out-of-memory errors are retried)
            if not is_out_of_memory(error):
                raise
            if batch_size == 1:
                raise torch.OutOfMemoryError(
                    f"find_batch_size: even batch size 1 runs out of memory (tried {', '.join(map(str, tried))}); "
                    "the model and optimizer state alone do not fit: use a smaller model, a lower precision "
                    "(af.with_precision('bf16-true')), or a device with more memory"
                ) from error
        # the error, its traceback and the frames of the failed attempt are gone; collect the cycles
        free_memory()
        batch_size //= 2
