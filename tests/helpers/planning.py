"""Programs for the plan tests, and what ``run`` really did with them, shared by the
single-process tests and the 2-process worker ``tests/workers/plan_checks.py``.

A case's dataset carries each sample's index, so the loss function records, per rank and
epoch, exactly which samples the run read; a hook marks each epoch's end; a constant
LambdaLR counts the scheduler's steps.
"""

from __future__ import annotations

import warnings
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import accelfn as af

EPOCHS = 2


@attrs.frozen
class Case:
    """One combination: data size, batch size, DataLoader drop_last, sharding, accumulation, limits."""

    size: int
    batch: int = 4
    loader_drop: bool = False
    shard: str | None = "pad"  # None | "pad" | "drop_last" | "uneven" | "split"
    n: int = 1
    max_steps: int | None = None
    epochs: int = EPOCHS
    resume_at: int = 0  # micro-batches trained by hand before run (a state part-way through)

    @property
    def id(self) -> str:
        drop = "droplast" if self.loader_drop else "keeplast"
        stop = f"-max{self.max_steps}" if self.max_steps else ""
        resume = f"-resume{self.resume_at}" if self.resume_at else ""
        return f"n{self.size}-b{self.batch}-{drop}-{self.shard or 'noshard'}-acc{self.n}{stop}{resume}"


def program(case: Case, world_size: int) -> tuple[af.Step, DataLoader]:
    """The case's program and DataLoader (indices as the third tensor of each batch)."""
    g = torch.Generator().manual_seed(case.size)
    data = TensorDataset(torch.randn(case.size, 2, generator=g), torch.randn(case.size, 1, generator=g),
                         torch.arange(case.size))
    transforms: list[Any] = [af.accumulate(case.n)] if case.n > 1 else []
    if case.shard is not None:
        transforms.append(af.shard_data(drop_last=case.shard == "drop_last", even_batches=case.shard != "uneven",
                                        split_batches=case.shard == "split"))
        if case.shard != "uneven":
            transforms.append(af.replicate())
    seen: list[list[int]] = [[]]

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        seen[-1].extend(batch[2].tolist())
        return F.mse_loss(model(batch[0]), batch[1])

    step = af.compose(*transforms)(af.train_step(loss_fn))
    loader = DataLoader(data, batch_size=case.batch, shuffle=case.shard is not None, drop_last=case.loader_drop)
    loader.seen = seen  # type: ignore[attr-defined]  # what loss_fn read, one list per epoch
    return step, loader


def fresh_state() -> af.TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return af.TrainState.create(model, optimizer, scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0))


def planned_and_run(case: Case, backend: af.backends.Backend) -> dict[str, Any]:
    """The plan's counts for this rank and the job, and what ``run`` did on this rank."""
    step, loader = program(case, backend.world_size)
    state = fresh_state()
    if case.resume_at:  # train by hand to a position part-way through the first epoch
        state, step_fn = backend.prepare(step, state)
        for batch, last in backend.batches(loader, step, 0):
            state, _ = step_fn(state, batch, flush=last)
            if state.micro_step == case.resume_at:
                break
        loader.seen[:] = [[]]  # type: ignore[attr-defined]
    plan = af.plan(step, state, loader, backend=backend, epochs=case.epochs, max_steps=case.max_steps, trace=False)
    ends: list[int] = []

    def epoch_end(s: af.TrainState, b: Any) -> None:
        ends.append(s.step)
        loader.seen.append([])  # type: ignore[attr-defined]

    start = state.step
    with warnings.catch_warnings():  # the plan's own warnings (padding, ...) are not this test's subject
        warnings.simplefilter("ignore")
        state = af.run(step, state, loader, backend=backend, epochs=case.epochs, max_steps=case.max_steps,
                       progress=False, hooks=[af.Hook(epoch_end, at_epoch_end=True)])
    seen = [s for s in loader.seen if s]  # type: ignore[attr-defined]
    updates = [b - a for a, b in zip([start, *ends], ends)]
    if state.step != (ends[-1] if ends else start):
        updates.append(state.step - (ends[-1] if ends else start))  # an epoch that max_steps cut
    r = backend.rank
    return {
        "planned": {
            "updates": [u for e in plan.epochs for u in [e.updates[r]] * e.num_epochs],
            "samples": [s for e in plan.epochs for s in [e.samples[r]] * e.num_epochs],
            "padded_job": [p for e in plan.epochs for p in [sum(e.padded)] * e.num_epochs],
            "dropped": [d for e in plan.epochs for d in [e.dropped] * e.num_epochs],
            "total": plan.total_updates, "scheduler": plan.scheduler_steps,
        },
        "run": {"updates": updates, "samples": [len(s) for s in seen], "indices": seen,
                "total": state.step, "scheduler": state.scheduler.last_epoch},
    }


def unique_dropped_padded(results: list[dict[str, Any]], size: int) -> tuple[list[int], list[int]]:
    """Per epoch over all ranks' results: (samples no rank read, samples read more than once)."""
    epochs = len(results[0]["run"]["indices"])
    dropped, padded = [], []
    for e in range(epochs):
        read = [i for r in results for i in r["run"]["indices"][e]]
        dropped.append(size - len(set(read)))
        padded.append(len(read) - len(set(read)))
    return dropped, padded


#: one-process cases (23, 25 and 8 samples; every sharding; accumulate 1 to 5; max_steps; resumed)
ONE_PROCESS = [
    Case(23), Case(23, loader_drop=True), Case(25, shard=None, n=3), Case(25, shard="drop_last", n=2),
    Case(23, n=3), Case(23, n=5, loader_drop=True), Case(25, n=4, max_steps=5), Case(8, n=5),
    Case(23, shard="split", n=2), Case(23, shard="uneven", n=3), Case(25, shard=None, loader_drop=True, n=2),
    Case(23, n=3, resume_at=4), Case(25, n=2, resume_at=3, max_steps=9), Case(23, batch=5, n=4, max_steps=3),
]
#: two-process cases (odd sizes leave padding, drop_last tails and partial windows)
TWO_PROCESSES = [
    Case(23), Case(23, loader_drop=True, n=3), Case(25, shard="drop_last", n=2), Case(25, shard="drop_last",
                                                                                      loader_drop=True),
    Case(23, shard="uneven", n=3), Case(25, shard="uneven", loader_drop=True), Case(23, shard="split", batch=6, n=2),
    Case(25, shard="split", batch=4, loader_drop=True), Case(21, n=5), Case(25, n=4, max_steps=3),
    Case(23, n=2, max_steps=6), Case(23, n=3, resume_at=2), Case(25, shard="drop_last", n=3, resume_at=2),
    Case(7, batch=2, n=2),
]
#: sharding cases checked on 3 and 4 ranks against the data path ``run`` reads (epoch_batches)
MANY_RANKS = [Case(23), Case(23, loader_drop=True), Case(25, shard="drop_last"), Case(26, shard="uneven"),
              Case(23, shard="split", batch=12), Case(26, shard="split", batch=12, loader_drop=True), Case(5, batch=2),
              Case(10, shard="drop_last", batch=3, loader_drop=True)]
