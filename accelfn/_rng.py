"""The global random number generators of one process, as plain data.

A snapshot holds the state of every generator a training step may draw from without being
handed one: torch's CPU generator, each CUDA device's generator (when CUDA is initialized),
Python's ``random`` and NumPy's legacy global ``RandomState``. Generators a program owns
(a ``torch.Generator`` passed to a DataLoader, ``numpy.random.default_rng()``) are its own
business; ``shard_data`` seeds its loaders per epoch so that they never draw from these.
"""

from __future__ import annotations

import random

import attrs
import numpy as np
import torch


@attrs.frozen
class RngState:
    """The global generators' states.

    Attributes:
        torch_cpu: ``torch.get_rng_state()`` as hex (5056 bytes for the Mersenne Twister).
        torch_cuda: ``torch.cuda.get_rng_state_all()``, one hex string per device; empty
            when CUDA was not initialized in this process.
        python: ``random.getstate()``: (version, internal state, gauss_next).
        numpy: ``numpy.random.get_state()``: (bit generator, keys, pos, has_gauss,
            cached_gaussian).
    """

    torch_cpu: str
    torch_cuda: tuple[str, ...]
    python: tuple[int, tuple[int, ...], float | None]
    numpy: tuple[str, tuple[int, ...], int, int, float]


def _hex(state: torch.Tensor) -> str:
    return state.numpy().tobytes().hex()


def _tensor(hex_state: str) -> torch.Tensor:
    return torch.frombuffer(bytearray.fromhex(hex_state), dtype=torch.uint8)


def capture() -> RngState:
    """The current states of the global generators (drawing nothing from them)."""
    cuda = ()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = tuple(_hex(s) for s in torch.cuda.get_rng_state_all())
    version, internal, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    return RngState(
        torch_cpu=_hex(torch.get_rng_state()),
        torch_cuda=cuda,
        python=(version, tuple(internal), gauss_next),
        numpy=(str(name), tuple(int(k) for k in keys), int(pos), int(has_gauss), float(cached)),
    )


def restore(rng: RngState) -> None:
    """Sets the global generators to ``rng``.

    CUDA states are restored for the devices both the snapshot and this process have (a
    snapshot taken on GPUs restores on a CPU-only machine, leaving CUDA alone).
    """
    torch.set_rng_state(_tensor(rng.torch_cpu))
    if rng.torch_cuda and torch.cuda.is_available():
        count = min(len(rng.torch_cuda), torch.cuda.device_count())
        for device in range(count):
            torch.cuda.set_rng_state(_tensor(rng.torch_cuda[device]), device)
    version, internal, gauss_next = rng.python
    random.setstate((version, tuple(internal), gauss_next))
    name, keys, pos, has_gauss, cached = rng.numpy
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
