"""Save and load a ~100 MB TrainState sharded over the processes (FSDP2) or whole in one.

The state is an MLP of 1024 x 1024 layers (a ``ModuleList``) with AdamW
moments after one update, about ``--mb`` MiB of parameters and moments in all. Under
``accelfn launch --nproc-per-node N`` each layer and the root are ``fully_shard``-ed, so
``af.save`` writes each rank's shards through DCP (``dcp/shard-*.safetensors``) and
``af.load`` reads them back into a fresh sharded state; in one process it is the unsharded
path. Each row is the median wall time of ``--repeats`` runs (rank 0's clock, after a
barrier), each into a fresh path; loads read a checkpoint written before the timed repeats.

Run::

    PYTHONPATH=. python benchmarks/sharded_checkpoint.py [--mb 100] [--repeats 3]
    PYTHONPATH=. python -m accelfn launch --nproc-per-node 2 benchmarks/sharded_checkpoint.py
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import accelfn as af


def build_state(total_mb: float, sharded: bool) -> af.TrainState:
    """Layers of 1024 x 1024 whose parameters and AdamW moments total about ``total_mb`` MiB."""
    layers = max(1, round(total_mb * 2**20 / 3 / (1024 * 1024 * 4)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(1024, 1024) for _ in range(layers)]))
    if sharded:
        for layer in model[0]:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 1024)
    for layer in model[0]:
        x = layer(x)
    x.square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return af.TrainState.create(model, optimizer)


def _timed(backend: af.backends.Backend, fn) -> float:  # type: ignore[no-untyped-def]
    backend.barrier()
    start = time.perf_counter()
    fn()
    backend.barrier()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    backend = af.backends.auto()
    sharded = backend.world_size > 1
    state = build_state(args.mb, sharded)
    root = Path(tempfile.gettempdir()) / "accelfn-bench-sharded"
    if backend.is_main_process:
        shutil.rmtree(root, ignore_errors=True)
    backend.barrier()
    af.save(state, root / "source", backend=backend)
    saves = [_timed(backend, lambda i=i: af.save(state, root / f"save{i}", backend=backend))
             for i in range(args.repeats)]
    loads = [_timed(backend, lambda: af.load(root / "source", into=build_state(args.mb, sharded), backend=backend))
             for _ in range(args.repeats)]
    builds = [_timed(backend, lambda: build_state(args.mb, sharded)) for _ in range(args.repeats)]
    if backend.is_main_process:
        nbytes = sum(f.stat().st_size for f in (root / "source").rglob("*") if f.is_file())
        kind = f"sharded over {backend.world_size} processes" if sharded else "unsharded, 1 process"
        print(f"{kind}: checkpoint {nbytes / 2**20:.0f} MiB")
        print(f"af.save  {statistics.median(saves):.3f} s")
        print(f"af.load  {statistics.median(loads) - statistics.median(builds):.3f} s (building the fresh state, "
              f"{statistics.median(builds):.3f} s, not counted)")
        shutil.rmtree(root, ignore_errors=True)
    if dist.is_initialized():
        backend.barrier()


if __name__ == "__main__":
    main()
