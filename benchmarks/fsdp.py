"""Two-process sharded data parallel over gloo: accelfn's ``shard_params()`` against a hand-written FSDP2 loop.

    PYTHONPATH=$PWD python benchmarks/fsdp.py                 # starts 2 processes itself
    PYTHONPATH=$PWD python benchmarks/fsdp.py --rounds 40 --updates 25
    PYTHONPATH=$PWD python benchmarks/fsdp.py --profile both      # cProfile of rank 0: calls, collectives

Both contestants train their own copy of the same model (a stack of equal residual MLP
blocks, AdamW) with ``accumulate(2)`` and ``clip(1.0)``. The hand-written loop applies
``fully_shard`` to each block and then to the root, calls
``model.set_requires_gradient_sync(is_last_micro_batch)`` before every micro-batch (one
reduce-scatter per optimizer update), clips with ``torch.nn.utils.clip_grad_norm_`` over the
DTensor parameters and steps AdamW; accelfn runs ``compose(shard_params(), accumulate(2),
clip(1.0))`` through ``af.run``, which shards the same units. Each rank reads its own
in-memory batches; the processes use one thread each.

Rounds are interleaved as in ``ddp.py`` (rotating order, timing from inside the data
iterator, the first updates of a round untimed: ``run`` prepares the state again each time it
is called). A round's time is the slower rank's, since a synchronous job moves at the pace
of its slowest process. The primary clock is CPU time (``time.process_time``, which includes
gloo's communication threads but not time spent waiting); elapsed-time ratios are printed too.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

import accelfn as af
from ddp import interleaved_rounds
from overhead import Batch, Timed, print_table, summarize
from shard import Block  # x + W2 gelu(W1 x)

WIDTH = 128
DEPTH = 4
BATCH_SIZE = 16
ACCUMULATE = 2
MAX_NORM = 1.0
WARMUP_UPDATES = 2  # untimed per round: run's prepare, FSDP2's lazy initialization in the first round


class Stack(torch.nn.Module):
    """``DEPTH`` blocks in an ``nn.ModuleList`` (FSDP2's units) and an output layer."""

    def __init__(self, width: int = WIDTH, depth: int = DEPTH):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.out = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def make_model(width: int, depth: int) -> Stack:
    torch.manual_seed(0)
    return Stack(width, depth)


def make_batches(width: int, count: int, seed: int) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH_SIZE, width, generator=g), torch.randn(BATCH_SIZE, width, generator=g))
            for _ in range(count)]


def loss_fn(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def raw_fsdp2(model: Stack):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def one_round(batches: Timed) -> None:
        loss = None
        for i, (x, y) in enumerate(batches):
            last = (i + 1) % ACCUMULATE == 0
            model.set_requires_gradient_sync(last)
            loss = F.mse_loss(model(x), y) / ACCUMULATE
            loss.backward()
            if last:
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                opt.step()
                opt.zero_grad()
        loss.item()

    return one_round


def accelfn(backend: af.backends.Backend, model: Stack):
    holder = {"state": af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-3))}
    step = af.compose(af.shard_params(), af.accumulate(ACCUMULATE), af.clip(MAX_NORM))(af.train_step(loss_fn))

    def one_round(batches: Timed) -> None:
        state = holder["state"]
        holder["state"] = af.run(step, state, batches, backend=backend, epochs=state.epoch + 1,
                                 progress=False, log_every=len(batches) // ACCUMULATE)

    return one_round


class Profiled(Timed):
    """A round's batches that run ``profiler`` over the timed updates (from the batch opening
    the first timed update to the request after the last)."""

    def __init__(self, batches: list[Batch], warmup: int, profiler: cProfile.Profile | None):
        super().__init__(batches, warmup)
        self.profiler = profiler

    def __iter__(self):
        for i, batch in enumerate(self.batches):
            if i == self.warmup and self.profiler is not None:
                self.profiler.enable()
            yield batch
        if self.profiler is not None:
            self.profiler.disable()


#: what the call counts per update are reported of: (label, the built-in's name in cProfile)
COUNTED = (("all-gathers", "torch._C._distributed_c10d.all_gather_single"),
           ("reduce-scatters", "torch._C._distributed_c10d.reduce_scatter_single"),
           ("all-reduces", "torch._C._distributed_c10d.allreduce"),
           ("functional all-reduces", "torch._ops._c10d_functional.all_reduce"),
           ("waits on a collective", "torch._C._distributed_c10d.wait"))


def profile_rounds(runners: dict, batches: list[Batch], rounds: int, updates: int, names: list[str],
                   rank: int) -> None:
    """Each contestant in ``names`` under cProfile on rank 0 over its timed updates (rank 1
    runs them unprofiled): the top of each profile, and per update its Python function calls
    and collectives, which the machine's other jobs do not change."""
    counts = {}
    for name in names:
        profiler = cProfile.Profile() if rank == 0 else None
        for _ in range(rounds):
            dist.barrier()
            runners[name](Profiled(batches, WARMUP_UPDATES * ACCUMULATE, profiler))
        if profiler is None:
            continue
        stats = pstats.Stats(profiler)
        path = os.path.join(tempfile.gettempdir(), f"fsdp.{name}.prof")
        stats.dump_stats(path)
        print(f"\n== {name}: the whole profile is {path} (read it with pstats)")
        stats.sort_stats("tottime").print_stats(25)
        per_update = rounds * updates
        row = {"Python function calls": stats.total_calls / per_update}  # type: ignore[attr-defined]
        for label, function in COUNTED:
            calls = sum(nc for (_, _, fn), (_, nc, _, _, _) in stats.stats.items()  # type: ignore[attr-defined]
                        if fn == f"<built-in method {function}>")
            row[label] = calls / per_update
        counts[name] = row
    if rank == 0:
        print(f"\nper optimizer update, rank 0 ({rounds} rounds x {updates} updates):")
        print(f"{'':24}" + "".join(f"{name:>12}" for name in counts))
        for label in next(iter(counts.values())):
            print(f"{label:24}" + "".join(f"{row[label]:12.1f}" for row in counts.values()))


def worker(rounds: int, updates: int, profile: str | None, width: int, depth: int) -> None:
    torch.set_num_threads(1)
    backend = af.backends.CPU()  # joins the gloo group torchrun describes
    rank = backend.rank
    batches = make_batches(width, (updates + WARMUP_UPDATES) * ACCUMULATE, seed=1 + rank)
    runners = {"raw": raw_fsdp2(make_model(width, depth)), "accelfn": accelfn(backend, make_model(width, depth))}
    names = list(runners)
    for fn in runners.values():
        fn(Timed(batches, WARMUP_UPDATES * ACCUMULATE))
    if profile is not None:
        profile_rounds(runners, batches, rounds, updates, names if profile == "both" else [profile], rank)
        return
    slowest = interleaved_rounds(backend, runners, batches, rounds, updates, WARMUP_UPDATES * ACCUMULATE)
    if backend.is_main_process:
        num_params = sum(p.numel() for p in make_model(width, depth).parameters())
        print(f"torch {torch.__version__}, accelfn {af.__version__}, {backend.world_size} processes (gloo), "
              f"1 thread each")
        print_table(f"{depth} residual blocks {width}-{4 * width}-{width} + Linear({width}, {width}) "
                    f"({num_params / 1e6:.2f}M parameters), micro-batch {BATCH_SIZE} per rank, "
                    f"accumulate({ACCUMULATE}), clip({MAX_NORM}), {updates} updates x {rounds} rounds; "
                    "time per update, slower rank", summarize(slowest))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds (default 30)")
    parser.add_argument("--updates", type=int, default=25, help="timed optimizer updates per round (default 25)")
    parser.add_argument("--profile", choices=("raw", "accelfn", "both"),
                        help="instead of timing, profile the timed updates of this contestant (or both) on rank 0: "
                             "the top of the profile, Python calls and collectives per update")
    parser.add_argument("--width", type=int, default=WIDTH, help=f"block width (default {WIDTH})")
    parser.add_argument("--depth", type=int, default=DEPTH, help=f"blocks (default {DEPTH})")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:  # started by hand: become the launcher of 2 processes
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:])]
        sys.exit(subprocess.call(command))
    worker(args.rounds, args.updates, args.profile, args.width, args.depth)


if __name__ == "__main__":
    main()
