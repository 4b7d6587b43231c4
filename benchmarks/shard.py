"""Memory and time per update of a ~100M-parameter model on 2 processes: ``replicate()`` vs ``shard_params()``.

    PYTHONPATH=$PWD python benchmarks/shard.py                 # both modes, 2 processes each
    PYTHONPATH=$PWD python benchmarks/shard.py --depth 4       # a smaller model (34M), quicker

The model is a stack of ``--depth`` equal residual MLP blocks (``width -> 4 width -> width``;
width 1024, depth 12: 100.7M parameters, 403 MB in fp32) trained with AdamW on random data,
one micro-batch of ``--batch`` rows per process and update. Each mode runs in its own 2-process
launch over gloo (one thread per process), so its peak RSS is its own. Per rank it reports:

* tensor bytes, counted from the tensors themselves after the last update: the rank's
  parameters (a DTensor's local shard under ``shard_params``), gradients (of one more
  forward and backward after the last update, which zeroed them), and optimizer state;
* the process's RSS after the last update, and its peak RSS (``ru_maxrss``), which also
  counts the full model each rank builds before sharding, the gathered unit of the moment,
  and DDP's gradient buckets. The processes run with ``MALLOC_MMAP_THRESHOLD_=65536``:
  with glibc's default (a threshold that grows to 32 MiB), freed 16 MiB blocks stay in the
  heap and the sharded run's RSS at the end also holds the freed full model and all-gather
  buffers (measured: 1,054 MiB instead of 605 MiB per rank for a 34M-parameter stack);
* median wall time per update over ``--updates`` updates after ``--warmup`` untimed ones,
  the slower rank's (a synchronous job moves at its slowest process's pace).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import accelfn as af

MODES = ("replicate", "shard_params")


class Block(torch.nn.Module):
    """``x + W2 gelu(W1 x)``: (batch, width) -> (batch, width)."""

    def __init__(self, width: int):
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Stack(torch.nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def current_rss() -> int:
    """The process's resident set size now, in bytes (Linux ``/proc/self/statm``)."""
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(args: argparse.Namespace) -> None:
    backend = af.backends.auto()
    torch.manual_seed(0)
    model = Stack(args.width, args.depth)
    num_params = sum(p.numel() for p in model.parameters())
    state = af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    transform = af.replicate() if args.mode == "replicate" else af.shard_params()
    step = af.compose(transform)(af.train_step(loss_fn))
    state, step_fn = backend.prepare(step, state)
    g = torch.Generator().manual_seed(backend.rank)
    batch = (torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, args.width, generator=g))
    times = []
    for i in range(args.warmup + args.updates):
        start = time.perf_counter()
        state, _ = step_fn(state, batch)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    # one more forward/backward, so the gradients exist when counted
    loss_fn(model, batch).backward()
    params = [p for group in state.optimizer.param_groups for p in group["params"]]
    moments = [v for s in state.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    result = {
        "rank": backend.rank, "num_params": num_params,
        "param_bytes": sum(local_bytes(p) for p in params),
        "grad_bytes": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer_bytes": sum(local_bytes(v) for v in moments),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_bytes": current_rss(),
        "update_s": statistics.median(times),
    }
    Path(args.out, f"{args.mode}.rank{backend.rank}.json").write_text(json.dumps(result))


def launch(mode: str, args: argparse.Namespace, out: str) -> None:
    command = [sys.executable, "-m", "accelfn", "launch", "--backend", "cpu", "--nproc-per-node", "2",
               __file__, "--worker", "--mode", mode, "--out", out, "--width", str(args.width),
               "--depth", str(args.depth), "--batch", str(args.batch), "--updates", str(args.updates),
               "--warmup", str(args.warmup)]
    # glibc keeps freed blocks below its (growing) mmap threshold in the heap, so RSS would
    # also count the full model freed after sharding and FSDP's freed all-gather buffers; a
    # fixed threshold returns large blocks to the OS, and RSS then follows the live tensors
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", **os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, check=True, env=env)


def mb(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def report(out: str) -> None:
    rows = {}
    for mode in MODES:
        ranks = [json.loads(Path(out, f"{mode}.rank{r}.json").read_text()) for r in range(2)]
        worst = max(ranks, key=lambda r: r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"])
        rows[mode] = {**worst, "update_s": max(r["update_s"] for r in ranks),
                      "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
                      "rss_bytes": max(r["rss_bytes"] for r in ranks)}
    print(f"model: {rows['replicate']['num_params'] / 1e6:.1f}M parameters, 2 processes (gloo), AdamW\n")
    print("| per rank | params MiB | grads MiB | optimizer MiB | total MiB | RSS at end MiB | peak RSS MiB "
          "| s/update |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for mode, r in rows.items():
        total = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
        print(f"| {mode} | {mb(r['param_bytes'])} | {mb(r['grad_bytes'])} | {mb(r['optimizer_bytes'])} | "
              f"{mb(total)} | {mb(r['rss_bytes'])} | {mb(r['peak_rss_bytes'])} | {r['update_s']:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--mode", choices=MODES)
    parser.add_argument("--out")
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        torch.set_num_threads(1)
        worker(args)
        return
    with tempfile.TemporaryDirectory() as out:
        for mode in MODES:
            launch(mode, args, out)
        report(out)


if __name__ == "__main__":
    main()
