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
    cuda: tuple[str, ...] = ()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = tuple(_hex(s) for s in torch.cuda.get_rng_state_all())
    version, internal, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return RngState(
        torch_cpu=_hex(torch.get_rng_state()),
        torch_cuda=cuda,
        python=(version, tuple(internal), gauss_next),
        numpy=(str(name), tuple(int(k) for k in keys), int(pos), int(has_gauss), float(cached)),
    )


#: bytes of a CUDA generator's state: its seed (uint64) and Philox offset (int64), as
#: ``CUDAGeneratorImpl::get_state`` writes them; the live size is used once CUDA is initialized
_CUDA_STATE_BYTES = 16


def _cuda_state_bytes(device: int) -> int:
    if torch.cuda.is_initialized():
        return torch.cuda.get_rng_state(device).numel()
    return _CUDA_STATE_BYTES


def problems(rng: RngState) -> list[str]:
    """Every way ``rng`` is not a state that ``restore`` can set (empty if it is one).

    Each state is tried on a scratch generator of the same kind (the global generators are
    not touched, and CUDA is not initialized): a state that passes here cannot fail in
    ``restore``. CUDA states are checked for the devices ``restore`` would set.
    """
    found = []
    try:  # a probe: any exception of a scratch generator's setter means a state it refuses
        torch.Generator().set_state(_tensor(rng.torch_cpu))
    except Exception as e:
        found.append(f"torch_cpu: not a state of torch's CPU generator ({e})")
    count = min(len(rng.torch_cuda), torch.cuda.device_count()) if torch.cuda.is_available() else 0
    for device, state in enumerate(rng.torch_cuda[:count]):
        try:
            size = len(bytes.fromhex(state))
        except (TypeError, ValueError) as e:
            found.append(f"torch_cuda[{device}]: not a generator state in hex ({e})")
            continue
        if size != _cuda_state_bytes(device):
            found.append(f"torch_cuda[{device}]: {size} bytes; the state of a CUDA generator has "
                         f"{_cuda_state_bytes(device)}")
    try:
        version, internal, gauss_next = rng.python
        random.Random().setstate((version, tuple(internal), gauss_next))
    except Exception as e:
        found.append(f"python: not a state of Python's random ({e})")
    try:
        name, keys, pos, has_gauss, cached = rng.numpy
        np.random.RandomState(0).set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    except Exception as e:  # an IndexError for fewer than 624 keys
        found.append(f"numpy: not a state of NumPy's RandomState ({e})")
    return found


def restore(rng: RngState) -> None:
    """Sets the global generators to ``rng`` (check it first with ``problems``).

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
