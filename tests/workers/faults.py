"""Worker for the fault tests (tests/cli/test_elastic.py, tests/distributed/test_fault_tolerance.py)
and benchmarks/recovery.py: one small job that elastic launches and replica groups run.

Usage: [accelfn launch ...] faults.py --out DIR [--ft] [--plain] [--checkpoints]

The program: ``invariant(micro_batches_per_update=4)`` (or, with ``--plain``, ``accumulate(4)``
without invariant), ``shard_data``, ``replicate``, and with ``--ft`` ``tolerate_faults(2)``,
over 96 samples in micro-batches of 2: 12 updates an epoch, 3 epochs. After every update the
main process of each group (or of an elastic job) appends one JSON line to
``DIR/progress-{group}.jsonl``: the step, world size, process id, time and the update's
fault-tolerance metrics. While ``DIR/tick`` holds a number, every update waits that many
seconds (the tests slow a job down while another node starts). With ``--ft`` the first
micro-batch a group reads waits until both groups have come that far (``DIR/ready-{group}``),
their Managers heartbeating: the first quorum holds both, whichever launch started faster
(a group started again passes at once). A micro-batch waits
``DIR/hang-{group}``'s number of seconds, once, if the file exists (a hung rank). At the end
the main process writes ``DIR/final-{group}.json``: the counters and a SHA-256 of every
tensor of the model and optimizer. ``--checkpoints`` checkpoints every update to
``DIR/ckpt`` and resumes from it (``resume="auto"``). Run with no launcher and no ``--ft``,
it is the uninterrupted one-process reference (``accumulate(4)`` on one process).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import accelfn as af

NUM_SAMPLES, BATCH_SIZE, EPOCHS = 96, 2, 3
UPDATES = NUM_SAMPLES // (BATCH_SIZE * 4) * EPOCHS  # 36


def _number(path: Path) -> float:
    try:
        return float(path.read_text())
    except (OSError, ValueError):
        return 0.0


class _Gate(torch.utils.data.Dataset):
    """``dataset``, whose first item read waits until every replica group has read one (the
    same items, in the same order: the sampler draws the order, not the dataset)."""

    def __init__(self, dataset: TensorDataset, out: Path, group: int, groups: int):
        self.dataset, self.out, self.group, self.groups, self.open = dataset, out, group, groups, False

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        if not self.open:
            (self.out / f"ready-{self.group}").touch()
            deadline = time.monotonic() + 300
            while not all((self.out / f"ready-{g}").exists() for g in range(self.groups)):
                if time.monotonic() > deadline:
                    raise TimeoutError("the other replica group never started")
                time.sleep(0.1)
            self.open = True
        return self.dataset[index]


def job(out: Path, *, ft: bool, plain: bool) -> tuple[af.Step, af.TrainState, DataLoader]:
    """The program, a fresh state (the same on every process) and the data."""
    group = af.backends.LaunchEnv.from_env().replica_group
    hang = out / f"hang-{group}"

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if hang.exists():  # a rank stuck in its computation, its collectives unanswered
            seconds = _number(hang)
            hang.unlink()
            time.sleep(seconds)
        x, y = batch
        return F.cross_entropy(model(x), y)

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(NUM_SAMPLES, 8, generator=generator),
                         torch.randint(0, 3, (NUM_SAMPLES,), generator=generator))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 3))
    state = af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    transforms: list[Any] = [af.shard_data(seed=7), af.replicate(),
                             af.accumulate(4) if plain else af.invariant(micro_batches_per_update=4)]
    if ft:
        transforms.append(af.tolerate_faults(2, timeout_s=10, quorum_timeout_s=120))
        assert group is not None, "--ft runs as a replica group (accelfn launch --replica-group I)"
        data = _Gate(data, out, group, 2)  # type: ignore[assignment]  # a dataset of the same items
    return af.compose(*transforms)(af.train_step(loss_fn)), state, DataLoader(data, batch_size=BATCH_SIZE,
                                                                                shuffle=True)


def digest(state: af.TrainState) -> str:
    """SHA-256 of every tensor of the model and the optimizer state, in order."""
    h = hashlib.sha256()
    for t in [*state.model.state_dict().values(), *(t for s in state.optimizer.state.values() for t in s.values())]:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Progress:
    """A tracker writing each update's line (main process of the group) and pacing the job."""

    def __init__(self, out: Path, backend: af.backends.Backend):
        self.out, self.backend = out, backend
        self.path = out / f"progress-{backend.env.replica_group}.jsonl"

    def log(self, metrics: dict[str, Any], step: int) -> None:
        keep = ("replicas", "replays", "healed", "micro_batches", "loss")
        line = {"step": step, "world": self.backend.world_size, "pid": os.getpid(), "time": time.time(),
                **{k: float(v) for k, v in metrics.items() if k in keep}}
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        time.sleep(_number(self.out / "tick"))

    def close(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ft", action="store_true")
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--checkpoints", action="store_true")
    args = parser.parse_args()
    backend = af.backends.auto()
    step, state, data = job(args.out, ft=args.ft, plain=args.plain)
    checkpoints = af.Checkpoints(args.out / "ckpt", every_steps=1, keep=2) if args.checkpoints else None
    tracker = Progress(args.out, backend)
    pace = af.Hook(lambda s, b: time.sleep(_number(args.out / "tick")) if not b.is_main_process else None,
                   every_steps=1)  # the other processes keep the main one's pace
    state = af.run(step, state, data, backend=backend, epochs=EPOCHS, progress=False, trackers=[tracker],
                   hooks=[pace], checkpoints=checkpoints, resume="auto" if checkpoints else None)
    if backend.is_main_process:
        final = {"step": state.step, "micro_step": state.micro_step, "epoch": state.epoch,
                 "epoch_micro_step": state.epoch_micro_step, "sha256": digest(state), "pid": os.getpid()}
        (args.out / f"final-{backend.env.replica_group}.json").write_text(json.dumps(final))


if __name__ == "__main__":
    main()
