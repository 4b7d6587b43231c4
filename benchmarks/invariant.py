"""``invariant()`` against the default ``replicate()`` + ``accumulate(A)``: step time and memory.

    PYTHONPATH=$PWD python benchmarks/invariant.py --processes 2 # starts the processes itself
    PYTHONPATH=$PWD python benchmarks/invariant.py --processes 4
    PYTHONPATH=$PWD python benchmarks/invariant.py --processes 2 --shard  # shard_params() in both

Both contestants train their own copy of the same MLP (AdamW, ``clip(1.0)``) on the same
DataLoader (micro-batch ``b = 16``, ``L = 8`` micro-batches per update, so ``accumulate(8 // W)``):
``default`` is ``compose(shard_data(), replicate(), accumulate(A), clip(1.0))`` (DDP, one
all-reduce per update); ``invariant`` adds ``invariant()`` (keyed RNG per micro-batch, the
gradients flattened into a binary counter of partial sums, one butterfly exchange per
``log2 W`` round). Rounds are interleaved with a rotating order; a round is one epoch through
``af.run`` and its time the slower rank's; the primary clock is CPU time
(``time.process_time``), elapsed-time ratios beside it. The table gives the median paired
ratio ``invariant / default`` and its 25th-75th percentile spread.

Memory: the most bytes of partial sums the stack held between micro-batches over one epoch,
in units of one gradient (all parameters), next to the bound ``log2(A) + 1``.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import accelfn as af
from overhead import mlp, quantile

WIDTHS = (128, 512, 512, 10)
B, L = 16, 8


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def program(invariant: bool, a: int, shard: bool = False) -> af.Step:
    parallel = af.shard_params() if shard else af.replicate()
    transforms = [af.shard_data(), parallel, af.accumulate(a), af.clip(1.0)]
    if invariant:
        transforms.append(af.invariant())
    return af.compose(*transforms)(af.train_step(loss_fn))


def fresh() -> af.TrainState:
    model = mlp(WIDTHS)
    return af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-3))


def stack_peak(backend: af.backends.Backend, loader: DataLoader, a: int, shard: bool) -> float:
    """The most bytes of partial sums held between micro-batches of one epoch, in (whole) gradients."""
    state, step_fn = backend.prepare(program(True, a, shard), fresh())
    grad_bytes = sum(p.numel() * p.element_size() for p in state.model.parameters())
    peak = 0
    for batch, last in backend.batches(loader, step_fn.step, 0):
        state, _ = step_fn(state, batch, flush=last)
        window = state.transforms_state.get("tree_window")
        if window is not None:
            held = sum(n.grads.numel() * n.grads.element_size() for n in window.nodes)
            peak = max(peak, held)
    return peak / grad_bytes


def worker(rounds: int, updates: int, shard: bool) -> None:
    torch.set_num_threads(1)
    backend = af.backends.CPU()
    w = backend.world_size
    a = L // w
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(updates * L * B, WIDTHS[0], generator=g),
                         torch.randint(0, WIDTHS[-1], (updates * L * B,), generator=g))
    loader = DataLoader(data, batch_size=B)
    states = {"default": fresh(), "invariant": fresh()}
    steps = {"default": program(False, a, shard), "invariant": program(True, a, shard)}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in states}
    names = list(states)
    for r in range(rounds + 1):
        for name in names[r % 2:] + names[:r % 2]:
            gc.collect()
            dist.barrier()
            cpu, wall = time.process_time(), time.perf_counter()
            states[name] = af.run(steps[name], states[name], loader, backend=backend,
                                  epochs=states[name].epoch + 1, progress=False)
            if r:  # the first round warms up
                times[name].append((time.process_time() - cpu, time.perf_counter() - wall))
    everyone = backend.gather_object(times)
    slowest = {name: [tuple(max(t[name][i][k] for t in everyone) for k in (0, 1)) for i in range(rounds)]
               for name in names}
    peak = stack_peak(backend, loader, a, shard)
    if backend.is_main_process:
        cpu_ratio = [i[0] / d[0] for i, d in zip(slowest["invariant"], slowest["default"])]
        wall_ratio = [i[1] / d[1] for i, d in zip(slowest["invariant"], slowest["default"])]
        per_update = {name: statistics.median(c for c, _ in slowest[name]) / updates * 1e6 for name in names}
        print(f"torch {torch.__version__}, accelfn {af.__version__}, {w} processes (gloo), 1 thread each; "
              f"MLP {'-'.join(map(str, WIDTHS))}, b={B}, {w} x accumulate({a}), {updates} updates x {rounds} rounds, "
              f"{'shard_params()' if shard else 'replicate()'}")
        print(f"default   {per_update['default']:9.1f} us/update (CPU, slower rank)")
        print(f"invariant {per_update['invariant']:9.1f} us/update; x default {statistics.median(cpu_ratio):.3f} "
              f"(p25-p75 {quantile(cpu_ratio, 0.25):.3f}-{quantile(cpu_ratio, 0.75):.3f}), "
              f"wall {statistics.median(wall_ratio):.3f}")
        print(f"partial sums held: at most {peak:.2f} gradients (bound log2(A)+1 = {math.log2(a) + 1:.0f})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    parser.add_argument("--updates", type=int, default=20, help="optimizer updates per round (default 20)")
    parser.add_argument("--shard", action="store_true", help="shard_params() in place of replicate() in both")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:  # started by hand: become the launcher
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(args.processes), os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:])]
        sys.exit(subprocess.call(command))
    worker(args.rounds, args.updates, args.shard)


if __name__ == "__main__":
    main()
