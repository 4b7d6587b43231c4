"""``set_seed``: one call seeds every global random number generator of this process.

What it seeds is what a snapshot records (``accelfn.checkpoint``'s RNG state): Python's
``random``, NumPy's legacy global ``RandomState``, torch's CPU generator and every CUDA
device's generator, and torch_xla's generator where torch_xla is installed. It is the start of
a reproducible run; ``shard_data(seed=...)`` and snapshots take over from there:

- ``shard_data(seed=s)`` shuffles epoch ``e`` with ``s + e`` on every rank and seeds the
  DataLoader workers per batch, whatever ``set_seed`` was given;
- a snapshot holds each rank's generator states, so a resumed run continues the draws of
  the uninterrupted one rather than starting again from the seed.
"""

from __future__ import annotations

import importlib.util
import os
import random

import numpy as np
import torch

#: the largest seed every generator takes (NumPy's legacy RandomState takes 32 bits)
MAX_SEED = 2**32 - 1


def set_seed(seed: int, *, deterministic: bool = False) -> None:
    """Seeds Python's, NumPy's and torch's (CPU, CUDA, XLA) global random number generators.

    Call it once at the top of the script, before the model is built, on every process
    with the same ``seed``: replicas start from the same weights, and ``run`` gives the
    same result on every rerun. DataLoader workers are seeded from torch's generator when
    their iterator starts (torch seeds ``random``, NumPy and torch in each worker from it),
    so their random augmentation repeats too.

    Args:
        seed: an int in ``0..2**32 - 1``.
        deterministic: also make torch choose deterministic algorithms
            (``torch.use_deterministic_algorithms(True)``: an operation without a
            deterministic implementation raises ``RuntimeError``), turn cuDNN's autotuner off
            and its deterministic mode on, and set ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless
            it is set (cuBLAS needs it to be deterministic on CUDA >= 10.2). Slower on GPUs.

    Raises:
        TypeError: ``seed`` is not an int, or ``deterministic`` not a bool.
        ValueError: ``seed`` outside ``0..2**32 - 1``.

    References:
        PyTorch, "Reproducibility": https://pytorch.org/docs/stable/notes/randomness.html

    Example:
        >>> import torch, accelfn as af
        >>> af.set_seed(0); a = torch.rand(2)
        >>> af.set_seed(0); b = torch.rand(2)
        >>> bool(torch.equal(a, b))
        True
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"set_seed(seed=...) must be an int, got {seed!r}")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"set_seed(seed={seed}): must be in 0..2**32 - 1 (NumPy's generator takes 32 bits)")
    if not isinstance(deterministic, bool):
        raise TypeError(f"set_seed(deterministic=...) must be True or False, got {deterministic!r}")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # every CUDA device's generator too (lazily, if CUDA is not initialized)
    if importlib.util.find_spec("torch_xla") is not None:  # imported only where installed
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
