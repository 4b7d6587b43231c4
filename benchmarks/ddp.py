"""Two-process data parallel over gloo: accelfn against hand-written DDP with ``no_sync``.

    PYTHONPATH=$PWD python benchmarks/ddp.py                 # starts 2 processes itself
    PYTHONPATH=$PWD python -m torch.distributed.run --nproc-per-node 2 benchmarks/ddp.py --rounds 30

Both contestants train their own copy of the same MLP (AdamW) with ``accumulate(4)``: the
hand-written loop wraps the model in ``DistributedDataParallel`` and runs the first three
micro-batches of every window inside ``model.no_sync()``, so there is one gradient
all-reduce per optimizer update; accelfn runs ``compose(replicate(), accumulate(4))`` through
``af.run``, which does the same. Each rank reads its own in-memory batches; the processes
use one thread each.

Rounds are interleaved as in ``overhead.py`` (rotating order, timing from inside the data
iterator). The first two updates of a round are untimed: accelfn's ``run`` wraps the model
in a new DDP each time it is called (once per round here, once per job in real use), and
DDP rebuilds its gradient buckets after its first synchronized backward. A round's time is the slower rank's, since
a synchronous job moves at the pace of its slowest process. The primary clock is CPU time
(``time.process_time``, which includes gloo's communication threads but not time spent
waiting); elapsed-time ratios are printed too.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import accelfn as af
from overhead import Batch, Timed, make_batches, mlp, optimizer, print_table, summarize

WIDTHS = (128, 512, 512, 10)
BATCH_SIZE = 16
ACCUMULATE = 4
WARMUP_UPDATES = 2  # untimed per round: DDP rebuilds its buckets after its first synced backward


def loss_fn(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def raw_ddp():
    model = DistributedDataParallel(mlp(WIDTHS))
    opt = optimizer(model)

    def one_round(batches: Timed) -> None:
        loss = None
        for i, (x, y) in enumerate(batches):
            last = (i + 1) % ACCUMULATE == 0
            with model.no_sync() if not last else contextlib.nullcontext():
                loss = F.cross_entropy(model(x), y) / ACCUMULATE
                loss.backward()
            if last:
                opt.step()
                opt.zero_grad()
        loss.item()

    return one_round


def accelfn(backend: af.backends.Backend):
    model = mlp(WIDTHS)
    holder = {"state": af.TrainState.create(model, optimizer(model))}
    step = af.compose(af.replicate(), af.accumulate(ACCUMULATE))(af.train_step(loss_fn))

    def one_round(batches: Timed) -> None:
        state = holder["state"]
        holder["state"] = af.run(step, state, batches, backend=backend, epochs=state.epoch + 1,
                                 progress=False, log_every=len(batches) // ACCUMULATE)

    return one_round


def interleaved_rounds(backend: af.backends.Backend, runners: dict, batches: list[Batch], rounds: int,
                       updates: int, untimed: int) -> dict[str, list[tuple[float, float]]]:
    """Each runner's (CPU s, wall s) per update in each round, on the slower rank: the
    runners' order rotates from round to round, all ranks start each run together, and the
    first ``untimed`` micro-batches of a run are not timed."""
    names = list(runners)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            gc.collect()
            dist.barrier()
            timed = Timed(batches, untimed)
            runners[name](timed)
            times[name].append((timed.cpu_s / updates, timed.wall_s / updates))
    everyone = backend.gather_object(times)
    return {name: [tuple(max(rank_times[name][r][k] for rank_times in everyone) for k in (0, 1))
                   for r in range(rounds)] for name in names}


def worker(rounds: int, updates: int) -> None:
    torch.set_num_threads(1)
    backend = af.backends.CPU()  # joins the gloo group torchrun describes
    rank = backend.rank
    batches = make_batches(WIDTHS, BATCH_SIZE, (updates + WARMUP_UPDATES) * ACCUMULATE, seed=1 + rank)
    runners = {"raw": raw_ddp(), "accelfn": accelfn(backend)}
    for fn in runners.values():
        fn(Timed(batches, WARMUP_UPDATES * ACCUMULATE))
    slowest = interleaved_rounds(backend, runners, batches, rounds, updates, WARMUP_UPDATES * ACCUMULATE)
    if backend.is_main_process:
        print(f"torch {torch.__version__}, accelfn {af.__version__}, {backend.world_size} processes (gloo), "
              f"1 thread each")
        print_table(f"MLP {'-'.join(map(str, WIDTHS))}, micro-batch {BATCH_SIZE} per rank, "
                    f"accumulate({ACCUMULATE}), {updates} updates x {rounds} rounds; time per update, slower rank",
                    summarize(slowest))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds (default 30)")
    parser.add_argument("--updates", type=int, default=25, help="timed optimizer updates per round (default 25)")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:  # started by hand: become the launcher of 2 processes
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:])]
        sys.exit(subprocess.call(command))
    worker(args.rounds, args.updates)


if __name__ == "__main__":
    main()
