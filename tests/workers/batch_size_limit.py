"""Worker for tests/loop/test_batch_size.py: ``find_batch_size`` against a real memory limit.

For each ``--case BUDGET_MIB START``, in order, the process (Linux, glibc) caps its own
address space (``RLIMIT_AS``, the soft limit) at its current size plus BUDGET_MIB, so an
allocation beyond the budget fails inside torch's CPU allocator exactly as it does on a full
machine, runs ``find_batch_size`` from START, and lifts the cap again. The training step's
activations take 8 MiB per sample; each attempt records whether the previous attempt's
activations were freed (a weak reference to them is dead), though they sit in a reference
cycle only the garbage collector breaks. Prints one JSON line per case: its budget and start,
the batch sizes tried, whether each earlier attempt was freed when the next began, and the
batch size that trained (or the error at batch size 1).

Usage: python batch_size_limit.py --case BUDGET_MIB START [--case BUDGET_MIB START ...]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import resource
import weakref

import torch
import torch.nn.functional as F

import accelfn as af


class Wide(torch.nn.Module):
    """Its forward holds two activations of 1 Mi float32 (4 MiB) per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.attempt: list[weakref.ref] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.repeat(1, 2**20 // x.shape[1]) * self.scale  # (batch, 2**20)
        cycle: list = [wide]
        cycle.append(cycle)  # freed only by gc.collect()
        self.attempt.append(weakref.ref(wide))
        return (wide * wide).mean(dim=1, keepdim=True)


def fit_under_cap(budget_mib: int | None, start: int) -> dict:
    """``find_batch_size`` from ``start`` with ``budget_mib`` more MiB of address space than the
    process holds now (None: uncapped); what it tried, freed and returned."""
    tried: list[int] = []
    freed: list[bool] = []
    held: list[weakref.ref] = []

    def fit(batch_size: int) -> int:
        tried.append(batch_size)
        if held:
            freed.append(held[-1]() is None)
        model = Wide()
        model.attempt = held
        data = [(torch.ones(batch_size, 8), torch.zeros(batch_size, 1))] * 2
        state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        state = af.run(af.train_step(lambda m, b: F.mse_loss(m(b[0]), b[1])), state, data,
                       backend=af.backends.CPU(), progress=False)
        return batch_size

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc returns the freed heap, so the cap counts from here
    with open("/proc/self/status") as status:
        size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if budget_mib is not None:
        resource.setrlimit(resource.RLIMIT_AS, (size + budget_mib * 2**20, hard))
    try:
        result: int | str = af.find_batch_size(fit, start=start)
        error = None
    except torch.OutOfMemoryError as e:
        result, error = "error", {"message": str(e), "cause": type(e.__cause__).__name__,
                                  "cause_message": str(e.__cause__)[:200]}
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    return {"budget_mib": budget_mib, "start": start, "tried": tried, "freed": freed, "result": result,
            "error": error}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", type=int, nargs=2, action="append", required=True, metavar=("BUDGET_MIB", "START"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    fit_under_cap(None, 1)  # imports what training imports on first use (torch._dynamo for the optimizer) uncapped
    for budget_mib, start in args.case:
        print(json.dumps(fit_under_cap(budget_mib, start)))


if __name__ == "__main__":
    main()
