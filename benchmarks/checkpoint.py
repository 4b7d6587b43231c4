"""Save and load a ~100 MB TrainState: ``af.save``/``af.load`` against bare safetensors and torch.save.

The state is an MLP of 1024 x 1024 layers with AdamW moments after one update (parameters
plus two moments: 3 x the model's bytes). Each row is the median wall time of ``--repeats``
runs, each into a fresh path, with its ratio to bare safetensors on the same tensors:

* ``af.save``: snapshot view, safetensors files, fsync of every file and directory, sha256
  of every file, manifest, atomic rename. ``safetensors.save_file``: the same tensors in
  one file, no fsync, no hash; ``+ fsync``: the same with the file fsynced.
* ``af.load``: sha256 verification of every file, then every tensor copied into the live
  state (the model, the optimizer moments, the RNG). ``load_file + copy``: the same tensors
  read (memory-mapped) and copied into the live tensors, unverified. Loads read a file
  written once before the timed repeats (warm page cache).

Run: ``PYTHONPATH=. python benchmarks/checkpoint.py [--mb 100] [--repeats 5] [--dir DIR]``
"""

from __future__ import annotations

import argparse
import hashlib
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


def build_state(total_mb: float) -> af.TrainState:
    """An MLP whose parameters and AdamW moments total about ``total_mb`` MiB."""
    layers = max(1, round(total_mb * 2**20 / 3 / (1024 * 1024 * 4)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 1024)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return af.TrainState.create(model, optimizer)


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


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def median_ms(fn: Callable[[Path], None], root: Path, repeats: int, *,
              prepare: Callable[[Path], None] | None = None) -> float:
    """Median wall time of ``fn(path)``: each save into a fresh path; each load of one file
    written once by ``prepare`` (its pages in the page cache, as when resuming soon after a save)."""
    times = []
    path = root / "prepared"
    if prepare is not None:
        prepare(path)
    for i in range(repeats):
        if prepare is None:
            path = root / f"run{i}"
        start = time.perf_counter()
        fn(path)
        times.append(time.perf_counter() - start)
        if prepare is None:
            _remove(path)
    _remove(root / "prepared")
    return statistics.median(times) * 1e3


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100.0, help="state size in MiB (default 100)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(dir=args.dir))
    state = build_state(args.mb)
    tensors = flat_tensors(state)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    sample = safetensors.torch.save(tensors)
    start = time.perf_counter()
    hashlib.sha256(sample).hexdigest()
    sha_gb_s = len(sample) / (time.perf_counter() - start) / 1e9
    del sample

    rows: list[tuple[str, float, float | None]] = []

    def bare_save(p: Path) -> None:
        safetensors.torch.save_file(tensors, p)

    def bare_save_fsync(p: Path) -> None:
        safetensors.torch.save_file(tensors, p)
        fsync_file(p)

    base_save = median_ms(bare_save, root, args.repeats)
    rows.append(("save  safetensors.save_file", base_save, 1.0))
    rows.append(("save  safetensors.save_file + fsync", median_ms(bare_save_fsync, root, args.repeats), None))
    rows.append(("save  torch.save (state dicts)", median_ms(lambda p: _torch_save(state, p), root, args.repeats), None))
    rows.append(("save  af.save", median_ms(lambda p: af.save(state, p), root, args.repeats), None))

    base_load = median_ms(lambda p: copy_into(state, safetensors.torch.load_file(p)), root, args.repeats,
                          prepare=bare_save)
    rows.append(("load  safetensors.load_file + copy", base_load, 1.0))
    rows.append(("load  torch.load(weights_only=True) + load_state_dict",
                 median_ms(lambda p: _torch_load(state, p), root, args.repeats,
                           prepare=lambda p: _torch_save(state, p)), None))
    rows.append(("load  af.load", median_ms(lambda p: af.load(p, into=state), root, args.repeats,
                                            prepare=lambda p: af.save(state, p)), None))
    shutil.rmtree(root, ignore_errors=True)

    print(f"state: {total / 2**20:.1f} MiB in {len(tensors)} tensors; {os.cpu_count()} CPUs; median of "
          f"{args.repeats}; sha256 of those bytes on one core: {total / sha_gb_s / 1e6:.1f} ms ({sha_gb_s:.2f} GB/s)")
    print(f"{'':54s} {'ms':>9s} {'x safetensors':>14s}")
    for name, ms, _ in rows:
        base = base_save if name.startswith("save") else base_load
        print(f"{name:54s} {ms:9.1f} {ms / base:14.2f}")


def _torch_save(state: af.TrainState, path: Path) -> None:
    torch.save({"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict()}, path)


def _torch_load(state: af.TrainState, path: Path) -> None:
    loaded = torch.load(path, weights_only=True)
    state.model.load_state_dict(loaded["model"])
    state.optimizer.load_state_dict(loaded["optimizer"])


if __name__ == "__main__":
    main()
