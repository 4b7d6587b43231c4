"""Checkpoint costs for ~96 MiB and ~1 GiB TrainStates: synchronous, verified and asynchronous.

The state is an MLP of 1024 x 1024 layers with AdamW moments after one update (parameters
plus two moments: 3 x the model's bytes). Saves and loads run in ``--repeats`` rounds, the
contestants' order rotating; each row gives the median wall time and the median over rounds
of the ratio to the first row of its group in the same round (saves each into a fresh path;
loads of one checkpoint written once before, its pages in the page cache, as when resuming
soon after a save):

* save: ``safetensors.save_file`` of the same tensors in one file; ``+ fsync``: the same
  with the fsyncs ``af.save`` makes (the file, and the directory it is in); ``af.save``:
  snapshot view, files written and hashed in one pass (xxh3-128), fsynced, the manifest,
  the atomic rename.
* load: ``safetensors.load_file`` + copying every tensor into the live state, unverified;
  ``af.load``: every file's checksum verified while it is read, the manifest's values and
  the fit to the state checked, every tensor copied into the live state.
* asynchronous saves (``Checkpoints(asynchronous=True)``): the time ``run`` is blocked per
  checkpoint (after the first, which also allocates the host buffers) against the time of
  copying the state's tensors into existing host buffers alone; and the time of one
  training update (a batch of 16 through the MLP, AdamW) while a checkpoint is written in
  the background, against the same update without.

Run: ``PYTHONPATH=. python benchmarks/checkpoint.py [--mb 96 1024] [--repeats 5] [--dir DIR]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import safetensors.torch
import torch

import accelfn as af
from accelfn.checkpoint.checkpoints import HostBuffers
from accelfn.checkpoint.snapshot import capture


def build_state(total_mb: float) -> af.TrainState:
    """An MLP whose parameters and AdamW moments total about ``total_mb`` MiB."""
    layers = max(1, round(total_mb * 2**20 / 3 / (1024 * 1024 * 4)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    update(model, optimizer)
    return af.TrainState.create(model, optimizer)


def update(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One training update on a batch of 16."""
    model(torch.randn(16, 1024)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def flat_tensors(state: af.TrainState) -> dict[str, torch.Tensor]:
    """The same tensors af.save writes, as one flat dict (what a bare safetensors user writes)."""
    tensors = {f"model.{k}": v for k, v in state.model.state_dict().items()}
    for i, entry in state.optimizer.state_dict()["state"].items():
        for key, value in entry.items():
            tensors[f"optimizer.{i}.{key}"] = value
    return tensors


def copy_into(state: af.TrainState, loaded: dict[str, torch.Tensor]) -> None:
    """Copies bare-loaded tensors into the live state, as a load must."""
    with torch.no_grad():
        for key, value in state.model.state_dict().items():
            value.copy_(loaded[f"model.{key}"])
        for i, entry in state.optimizer.state_dict()["state"].items():
            for key, value in entry.items():
                value.copy_(loaded[f"optimizer.{i}.{key}"])


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def paired(contestants: dict[str, Callable[[Path], None]], root: Path, rounds: int, *,
           prepare: dict[str, Callable[[Path], None]] | None = None) -> dict[str, tuple[float, float]]:
    """Each contestant's median wall time (ms) and median ratio to the first contestant's
    time in the same round (the order rotates from round to round, so a busy moment of the
    shared machine hits all of them alike). Saves go each into a fresh path; a load reads
    the path its ``prepare`` wrote once before the rounds (its pages in the page cache, as
    when resuming soon after a save)."""
    names = list(contestants)
    paths = {name: root / f"prepared-{i}" for i, name in enumerate(names)}
    for name, make in (prepare or {}).items():
        make(paths[name])
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            path = paths[name] if prepare else root / f"run-{r}-{names.index(name)}"
            start = time.perf_counter()
            contestants[name](path)
            times[name].append(time.perf_counter() - start)
            if not prepare:
                _remove(path)
    for path in paths.values():
        _remove(path)
    base = times[names[0]]
    return {name: (statistics.median(t) * 1e3, statistics.median(x / b for x, b in zip(t, base)))
            for name, t in times.items()}


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def host_copy_ms(state: af.TrainState, repeats: int) -> float:
    """Copying every tensor of the state into host buffers that already exist."""
    buffers = HostBuffers()
    tensors = list(flat_tensors(state).values())
    for t in tensors:
        buffers(t)
    times = []
    for _ in range(repeats):
        buffers.begin()
        start = time.perf_counter()
        for t in tensors:
            buffers(t)
        buffers.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def asynchronous_ms(state: af.TrainState, root: Path, repeats: int) -> tuple[float, float, float, float]:
    """Blocked time of the first and of later background saves; one update's time without
    and with a background save in flight (medians, ms)."""
    schedule = af.Checkpoints(root / "async", every_steps=1, keep=1, asynchronous=True).schedule(
        af.backends.CPU(), program=None, timeout_s=60)
    blocked, during, alone = [], [], []
    for i in range(repeats + 1):
        state = state.replace(step=i + 1)
        start = time.perf_counter()
        schedule.maybe_save(state)
        blocked.append(time.perf_counter() - start)
        while schedule.in_flight():
            start = time.perf_counter()
            update(state.model, state.optimizer)
            during.append(time.perf_counter() - start)
        schedule.close(ok=True)
        for _ in range(3):
            start = time.perf_counter()
            update(state.model, state.optimizer)
            alone.append(time.perf_counter() - start)
    shutil.rmtree(root / "async", ignore_errors=True)
    return (blocked[0] * 1e3, statistics.median(blocked[1:]) * 1e3, statistics.median(alone) * 1e3,
            statistics.median(during) * 1e3 if during else float("nan"))


def report(total_mb: float, root: Path, repeats: int) -> None:
    state = build_state(total_mb)
    tensors = flat_tensors(state)
    total = sum(t.numel() * t.element_size() for t in tensors.values())

    def bare_save(p: Path) -> None:
        safetensors.torch.save_file(tensors, p)

    def bare_save_fsync(p: Path) -> None:
        safetensors.torch.save_file(tensors, p)
        fsync(p)
        fsync(p.parent)

    saves = paired({"save  safetensors.save_file + fsync (file, directory)": bare_save_fsync,
                    "save  safetensors.save_file (no fsync)": bare_save,
                    "save  af.save": lambda p: af.save(state, p)}, root, repeats)
    loads = paired({"load  safetensors.load_file + copy": lambda p: copy_into(state, safetensors.torch.load_file(p)),
                    "load  af.load (verified)": lambda p: af.load(p, into=state)}, root, repeats,
                   prepare={"load  safetensors.load_file + copy": bare_save,
                            "load  af.load (verified)": lambda p: af.save(state, p)})
    copy_ms = host_copy_ms(state, repeats)
    first, blocked, alone, during = asynchronous_ms(state, root, repeats)
    print(f"\nstate: {total / 2**20:.1f} MiB in {len(tensors)} tensors; {os.cpu_count()} CPUs; median of {repeats}")
    print(f"{'':56s} {'ms':>9s} {'ratio':>7s}")
    for name, (ms, ratio) in (saves | loads).items():
        print(f"{name:56s} {ms:9.1f} {ratio:7.2f}")
    print(f"{'async host copy alone (existing buffers)':56s} {copy_ms:9.1f} {1.0:7.2f}")
    print(f"{'async run blocked per checkpoint (after the first)':56s} {blocked:9.1f} {blocked / copy_ms:7.2f}")
    print(f"{'async run blocked, first checkpoint (allocates)':56s} {first:9.1f} {first / copy_ms:7.2f}")
    print(f"{'update alone':56s} {alone:9.1f} {1.0:7.2f}")
    print(f"{'update while a checkpoint is written in the background':56s} {during:9.1f} {during / alone:7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, nargs="+", default=[96.0, 1024.0], help="state sizes in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        for mb in args.mb:
            report(mb, root, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
