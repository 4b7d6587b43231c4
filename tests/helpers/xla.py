"""What the XLA tests share: torch_xla's runtime started early, counters, models and data.

Importing this module starts the XLA runtime: PyTorch's autograd engine learns the devices
at a process's first backward pass, so the XLA device must exist before any test (CPU
ones included) runs a backward. The XLA tests run in their own environment
(``scripts/xla-env.sh``: torch 2.9.0 + torch_xla 2.9.0, ``PJRT_DEVICE=CPU``).
"""

from __future__ import annotations

import pytest
import torch

SKIP_REASON = (
    "torch_xla is not installed in this environment; the XLA tests run in their own cached "
    "environment: scripts/xla-env.sh"
)

torch_xla = pytest.importorskip("torch_xla", reason=SKIP_REASON)
torch_xla.device()

import torch_xla.debug.metrics as met  # noqa: E402

from tests.helpers.models import loss_fn  # noqa: E402, F401  (the XLA tests' loss)


def counts() -> dict[str, int]:
    """torch_xla's running totals: graphs launched, of which compiled, and device-to-host reads.

    A graph launch looks its program up in the compilation cache (a hit or a compile), in the
    calling thread; executions themselves are counted later, on the runtime's threads.
    """
    hits, compiled = met.counter_value("CachedCompile") or 0, met.counter_value("UncachedCompile") or 0
    reads = met.metric_data("TransferFromDeviceTime")
    return {"graphs": hits + compiled, "compilations": compiled, "host_reads": 0 if reads is None else int(reads[0])}


def since(before: dict[str, int]) -> dict[str, int]:
    """The counts added since ``before``."""
    now = counts()
    return {k: now[k] - before[k] for k in now}



def flat(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter of ``model`` on the CPU in fp32, concatenated."""
    return torch.cat([p.detach().to("cpu", torch.float32).flatten() for p in model.parameters()])
