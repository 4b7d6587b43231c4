"""Worker for tests/loop/test_rank_mismatches.py: what differs across ranks, and calls some rank misses.

Usage: accelfn launch --nproc-per-node 2 --timeout-s 30 rank_mismatches.py --out DIR
Each rank writes DIR/rank{r}.json with the error each case raised on it: metric names that
differ across ranks, an af.Loss on rank 0 and a mean loss on rank 1 (under replicate and
shard_params, with and without invariant()), evaluate outputs of another structure, af.save, af.evaluate, af.save_model
and af.load called on rank 0 alone, af.run on rank 0 while rank 1 calls af.save_model; and
the files of a save on every rank afterwards. Rank 0 logs the same
metric names in another order to DIR/reordered.jsonl.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import accelfn as af
from accelfn.distributed import is_dtensor


def run(backend: af.backends.Backend, loss_fn: Any, jsonl: Path, parallel: Any = af.replicate,
        invariant: bool = False) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data: Any = [(torch.randn(2, 4), torch.randn(2, 1)) for _ in range(3)]
    transforms = [af.shard_data(), parallel()]
    if invariant:  # a DataLoader of micro-batches of 2, an update of 2 x accumulate(2)
        data = torch.utils.data.DataLoader([(torch.randn(4), torch.randn(1)) for _ in range(16)], batch_size=2)
        transforms = [af.invariant(), *transforms, af.accumulate(2)]
    initial = [p.detach().clone() for p in model.parameters()]
    try:
        af.run(af.compose(*transforms)(af.train_step(loss_fn)), state, data, backend=backend,
               trackers=[af.JSONL(jsonl)], progress=False)
    finally:
        if invariant:  # refused before the first update
            assert all(torch.equal(a, b.full_tensor() if is_dtensor(b) else b)
                       for a, b in zip(initial, model.parameters()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    backend = af.backends.auto()
    rank = backend.rank
    result: dict[str, Any] = {}

    def extra_on_rank_one(m: torch.nn.Module, b: Any) -> Any:  # the case: a metric on rank 1 only
        loss = F.mse_loss(m(b[0]), b[1])
        return (loss, {"extra": loss.detach()}) if rank == 1 else loss

    try:
        run(backend, extra_on_rank_one, out / "extra.jsonl")
    except ValueError as e:
        result["names"] = str(e)

    def sum_on_rank_zero(m: torch.nn.Module, b: Any) -> Any:  # af.Loss on rank 0, a mean loss on rank 1
        errors = (m(b[0]) - b[1]) ** 2
        return af.Loss(total=errors.sum(), count=errors.numel()) if rank == 0 else errors.mean()

    try:
        run(backend, sum_on_rank_zero, out / "kinds.jsonl")
    except ValueError as e:
        result["kinds"] = str(e)
    try:  # shard_params alone runs the plain step function
        run(backend, sum_on_rank_zero, out / "kinds_sharded.jsonl", af.shard_params)
    except ValueError as e:
        result["kinds_sharded"] = str(e)
    for parallel in (af.replicate, af.shard_params):  # invariant(): checked where the first window closes
        try:
            run(backend, sum_on_rank_zero, out / f"kinds_invariant_{parallel.__name__}.jsonl", parallel, invariant=True)
        except ValueError as e:
            result[f"kinds_invariant_{parallel.__name__}"] = str(e)

    def reordered(m: torch.nn.Module, b: Any) -> Any:  # the same names, in another order on rank 1
        metrics = {"a": 1.0 + 9 * rank, "b": 2.0 + 18 * rank}
        return F.mse_loss(m(b[0]), b[1]), metrics if rank == 0 else dict(reversed(metrics.items()))

    run(backend, reordered, out / "reordered.jsonl")

    model = torch.nn.Linear(4, 1)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:  # evaluate outputs whose keys differ across ranks
        af.evaluate(lambda m, x: {f"out{rank}": m(x)}, state, [torch.randn(2, 4), torch.randn(3, 4)],
                    backend=backend)
    except ValueError as e:
        result["evaluate_structure"] = str(e)

    alone: dict[str, str] = {}  # calls inside `if backend.is_main_process:`, as with Accelerate
    if backend.is_main_process:
        try:
            af.save(state, out / "main_only")
        except af.CheckpointError as e:
            alone["af.save"] = str(e)
    backend.barrier()
    if backend.is_main_process:
        try:
            af.evaluate(lambda m, x: m(x), state, [torch.randn(2, 4)], backend=backend)
        except RuntimeError as e:
            alone["af.evaluate"] = str(e)
    backend.barrier()
    if backend.is_main_process:
        try:
            af.save_model(state, out / "model_main_only")
        except af.CheckpointError as e:
            alone["af.save_model"] = str(e)
    backend.barrier()
    result["alone"] = alone
    crossed: dict[str, str] = {}  # every rank arrives, but at another call
    try:
        af.save(state, out / ("one" if backend.is_main_process else "all"), backend=backend)
    except af.CheckpointError as e:
        crossed["paths"] = str(e)
    try:
        if backend.is_main_process:
            af.save(state, out / "two", backend=backend)
        else:
            af.evaluate(lambda m, x: m(x), state, [torch.randn(2, 4)], backend=backend)
    except RuntimeError as e:  # CheckpointError on rank 0, ArrivalError on rank 1
        crossed["calls"] = str(e)
    try:  # af.run on rank 0 while rank 1 exports
        if backend.is_main_process:
            af.run(af.compose(af.shard_data(), af.replicate())(af.train_step(lambda m, b: m(b).sum())), state,
                   [torch.randn(2, 4)], backend=backend, progress=False)
        else:
            af.save_model(state, out / "model_crossed", backend=backend)
    except RuntimeError as e:  # ArrivalError on rank 0, CheckpointError on rank 1
        crossed["run"] = str(e)
    result["crossed"] = crossed
    result["saved"] = sorted(p.name for p in af.save(state, out / "every_rank", backend=backend).iterdir())
    if backend.is_main_process:
        try:
            af.load(out / "every_rank", into=state)
        except af.CheckpointError as e:
            alone["af.load"] = str(e)
    backend.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
