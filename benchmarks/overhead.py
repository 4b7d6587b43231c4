"""Per-update time of accelfn against a hand-written PyTorch loop, Accelerate and Lightning Fabric.

    PYTHONPATH=$PWD python benchmarks/overhead.py                         # all cases, 40 rounds
    PYTHONPATH=$PWD python benchmarks/overhead.py --cases tiny --rounds 80 --contestants raw,accelfn

Every contestant trains its own copy of the same MLP (same initial weights, AdamW) on the
same in-memory list of batches, in one process on one thread. A round runs the same
number of optimizer updates of each contestant back to back, in an order that rotates from
round to round, so the slow phases of a shared machine hit every contestant alike. The
first update of a round is a warm-up; the others are timed from inside the data iterator,
so accelfn's time includes ``run``'s loop but not its one-off set-up.

The primary clock is this process's CPU time (``time.process_time``), which other
processes on a shared machine disturb far less than elapsed time; elapsed-time ratios are
printed too. A contestant's time is the median over rounds of its seconds per update; its
ratio is the median over rounds of ``its time / the hand-written loop's time in the same
round`` (paired, which cancels drift), with the 25th-75th percentile spread of those ratios.

Every contestant reads the loss to the host once per round (accelfn: ``log_every`` = the
round), so none pays a per-step host sync the others skip. Accelerate and Fabric run only
when installed (``pip install -c constraints.txt accelerate lightning``).

``accelfn_compile`` (accelfn with ``af.compile()``) runs only when named in ``--contestants``;
it compiles in the warm-up round.

Cases: ``tiny`` (framework overhead dominates), ``medium`` (compute dominates),
``composed``: the tiny model with ``accumulate(2)`` and ``clip(1.0)`` in each framework's
own form (``accelerator.accumulate`` + ``clip_grad_norm_``; Fabric's ``no_backward_sync`` +
``clip_gradients``), and ``logged``: the tiny model logging at ``run``'s default cadence,
every update, to a JSONL tracker (accelfn: ``log_every=1``, ``trackers=[af.JSONL(...)]``,
which logs the loss, lr, updates/s, samples/s and peak RSS; the hand-written loop:
``tracker.log({"loss": loss.item()}, step)`` with the same tracker class) — only the
hand-written loop and accelfn run it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import accelfn as af

Batch = tuple[torch.Tensor, torch.Tensor]

# name -> (layer widths, batch size, optimizer updates per round)
MODELS: dict[str, tuple[tuple[int, ...], int, int]] = {
    "tiny": ((32, 64, 64, 10), 32, 400),
    "medium": ((256, 1024, 1024, 10), 128, 20),
}


def mlp(widths: tuple[int, ...], seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def make_batches(widths: tuple[int, ...], batch_size: int, count: int, seed: int = 1) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch_size, widths[0], generator=g), torch.randint(0, widths[-1], (batch_size,), generator=g))
            for _ in range(count)]


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def loss_fn(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


# -- contestants: each builds its state once and returns a function running one round ----
# A round function takes the round's micro-batches and the accumulation and clip settings.

Round = Callable[["Timed"], None]


def raw(widths: tuple[int, ...], accumulate: int, max_norm: float | None, logged: str | None = None) -> Round:
    model = mlp(widths)
    opt = optimizer(model)
    tracker = af.JSONL(logged) if logged is not None else None
    step = [0]

    def one_round(batches: Timed) -> None:
        loss = None
        for i, (x, y) in enumerate(batches):
            loss = F.cross_entropy(model(x), y)
            if accumulate > 1:
                loss = loss / accumulate
            loss.backward()
            if (i + 1) % accumulate:
                continue
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()
            opt.zero_grad()
            if tracker is not None:
                step[0] += 1
                tracker.log({"loss": loss.item()}, step[0])
        loss.item()

    return one_round


def accelfn(widths: tuple[int, ...], accumulate: int, max_norm: float | None, logged: str | None = None, *,
            compiled: bool = False) -> Round:
    model = mlp(widths)
    holder = {"state": af.TrainState.create(model, optimizer(model))}
    transforms = []
    if accumulate > 1:
        transforms.append(af.accumulate(accumulate))
    if max_norm is not None:
        transforms.append(af.clip(max_norm))
    if compiled:
        transforms.append(af.compile())
    step = af.compose(*transforms)(af.train_step(loss_fn))
    backend = af.backends.CPU()
    trackers = [af.JSONL(logged)] if logged is not None else []

    def one_round(batches: Timed) -> None:
        state = holder["state"]
        log_every = len(batches) // accumulate if logged is None else 1
        holder["state"] = af.run(step, state, batches, backend=backend, epochs=state.epoch + 1,
                                 progress=False, log_every=log_every, trackers=trackers)

    return one_round


def accelfn_compile(widths: tuple[int, ...], accumulate: int, max_norm: float | None) -> Round:
    """accelfn with ``af.compile()`` (inductor); compiling happens in the warm-up round."""
    return accelfn(widths, accumulate, max_norm, compiled=True)


def accelerate(widths: tuple[int, ...], accumulate: int, max_norm: float | None) -> Round:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    model = mlp(widths)
    model, opt = accelerator.prepare(model, optimizer(model))

    def one_round(batches: Timed) -> None:
        loss = None
        for x, y in batches:
            with accelerator.accumulate(model) if accumulate > 1 else contextlib.nullcontext():
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if max_norm is not None and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), max_norm)
                opt.step()
                opt.zero_grad()
        loss.item()

    return one_round


def fabric(widths: tuple[int, ...], accumulate: int, max_norm: float | None) -> Round:
    from lightning.fabric import Fabric

    runner = Fabric(accelerator="cpu", devices=1, precision="32-true")
    model = mlp(widths)
    model, opt = runner.setup(model, optimizer(model))

    def one_round(batches: Timed) -> None:
        loss = None
        for i, (x, y) in enumerate(batches):
            last = (i + 1) % accumulate == 0
            with runner.no_backward_sync(model, enabled=not last) if accumulate > 1 else contextlib.nullcontext():
                loss = F.cross_entropy(model(x), y)
                runner.backward(loss / accumulate if accumulate > 1 else loss)
            if not last:
                continue
            if max_norm is not None:
                runner.clip_gradients(model, opt, max_norm=max_norm)
            opt.step()
            opt.zero_grad()
        loss.item()

    return one_round


def contestants() -> dict[str, Callable[..., Round]]:
    found: dict[str, Callable[..., Round]] = {"raw": raw, "accelfn": accelfn, "accelfn_compile": accelfn_compile}
    if importlib.util.find_spec("accelerate") is not None:
        found["accelerate"] = accelerate
    if importlib.util.find_spec("lightning") is not None:
        found["fabric"] = fabric
    return found


# -- measurement ----------------------------------------------------------------------------


class Timed:
    """A round's batches, timing their own consumption on two clocks.

    The clocks start when the batch that opens the second optimizer update is fetched and
    stop when the consumer asks for a batch after the last: the round's first update (a
    warm-up, and for accelfn the end of ``run``'s set-up) is not timed, every later update
    is, including the loop's own per-step work.
    """

    def __init__(self, batches: list[Batch], warmup: int):
        self.batches, self.warmup = batches, warmup
        self.cpu_s = self.wall_s = 0.0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        cpu = wall = 0.0
        for i, batch in enumerate(self.batches):
            if i == self.warmup:
                cpu, wall = time.process_time(), time.perf_counter()
            yield batch
        self.cpu_s, self.wall_s = time.process_time() - cpu, time.perf_counter() - wall


def quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1] if len(values) > 1 else values[0]


def summarize(times: dict[str, list[tuple[float, float]]]) -> dict[str, dict[str, float]]:
    """Median time per update and median paired ratios to ``raw``, per contestant."""
    result = {}
    for name, pairs in times.items():
        cpu = [c / b[0] for (c, _), b in zip(pairs, times["raw"])]
        wall = [w / b[1] for (_, w), b in zip(pairs, times["raw"])]
        result[name] = {
            "us": statistics.median(c for c, _ in pairs) * 1e6,
            "ratio": statistics.median(cpu), "p25": quantile(cpu, 0.25), "p75": quantile(cpu, 0.75),
            "wall_ratio": statistics.median(wall),
        }
    return result


def print_table(title: str, result: dict[str, dict[str, float]]) -> None:
    print(f"\n{title}")
    print(f"{'':16} {'us/update':>10} {'x raw':>7} {'p25-p75':>13} {'x raw (wall)':>13}")
    for name, row in result.items():
        print(f"{name:16} {row['us']:10.1f} {row['ratio']:7.3f} {row['p25']:6.3f}-{row['p75']:.3f} "
              f"{row['wall_ratio']:13.3f}")


def measure(case: str, widths: tuple[int, ...], batch_size: int, updates: int, rounds: int,
            names: list[str], accumulate: int = 1, max_norm: float | None = None,
            logged: bool = False) -> dict[str, dict[str, float]]:
    """Per-update CPU and wall time of every contestant, interleaved over ``rounds`` rounds."""
    batches = make_batches(widths, batch_size, (updates + 1) * accumulate)
    with tempfile.TemporaryDirectory() as logs:
        if logged:
            names = [name for name in names if name in ("raw", "accelfn")]
            runners = {name: contestants()[name](widths, accumulate, max_norm, f"{logs}/{name}.jsonl")
                       for name in names}
        else:
            runners = {name: contestants()[name](widths, accumulate, max_norm) for name in names}
        return _rounds(case, widths, batch_size, updates, rounds, names, accumulate, max_norm, batches, runners)


def _rounds(case: str, widths: tuple[int, ...], batch_size: int, updates: int, rounds: int, names: list[str],
            accumulate: int, max_norm: float | None, batches: list[Batch],
            runners: dict[str, Round]) -> dict[str, dict[str, float]]:
    for fn in runners.values():  # warm-up: allocator, optimizer state, lazy imports
        fn(Timed(batches, accumulate))
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            gc.collect()
            timed = Timed(batches, accumulate)
            runners[name](timed)
            times[name].append((timed.cpu_s / updates, timed.wall_s / updates))
    result = summarize(times)
    print_table(f"{case}: MLP {'-'.join(map(str, widths))}, batch {batch_size}, {updates} updates x {rounds} rounds"
                + (f", accumulate({accumulate})" if accumulate > 1 else "")
                + (f", clip({max_norm})" if max_norm is not None else "")
                + (", logging every update to JSONL" if case == "logged" else ""), result)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds (default 40)")
    parser.add_argument("--cases", default="tiny,medium,composed",
                        help="comma-separated from tiny, medium, composed, logged")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the updates per round")
    parser.add_argument("--contestants", default=None,
                        help="comma-separated from raw, accelfn, accelfn_compile (af.compile(): only when named), "
                        "accelerate, fabric (default: all installed)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    names = args.contestants.split(",") if args.contestants else [n for n in contestants() if n != "accelfn_compile"]
    if names[0] != "raw" or not set(names) <= set(contestants()):
        parser.error(f"--contestants must start with raw and name installed ones: {', '.join(contestants())}")
    print(f"torch {torch.__version__}, accelfn {af.__version__}, Python {platform.python_version()}, "
          f"{platform.machine()}, 1 thread; {', '.join(names)}")
    for case in args.cases.split(","):
        model = "tiny" if case in ("composed", "logged") else case
        widths, batch_size, updates = MODELS[model]
        updates = max(1, round(updates * args.scale))
        if case == "composed":
            measure(case, widths, batch_size, updates // 2, args.rounds, names, accumulate=2, max_norm=1.0)
        elif case == "logged":
            measure(case, widths, batch_size, updates, args.rounds, names, logged=True)
        else:
            measure(case, widths, batch_size, updates, args.rounds, names)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
