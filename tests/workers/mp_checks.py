"""Worker for tests/test_multiprocess.py: one launch of 2 processes runs every check.

Usage: accelfn launch --nproc-per-node 2 mp_checks.py --out DIR
Each rank writes DIR/rank{r}.json (indices, counts, metadata) and DIR/rank{r}.safetensors
(parameters and outputs); the test compares them with single-process references.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils.data import DataLoader

import accelfn as af
from tests.helpers import programs as P


class CountingCPU(af.backends.CPU):
    """The CPU backend with a DDP communication hook that counts gradient all-reduces."""

    def __init__(self) -> None:
        super().__init__()
        self.allreduces = 0

    def wrap_model(self, model: torch.nn.Module, replicate: af.Replicate) -> torch.nn.Module:
        wrapped = super().wrap_model(model, replicate)

        def counting_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads real annotations, or none
            self.allreduces += 1
            return allreduce_hook(None, bucket)  # type: ignore[arg-type]

        wrapped.register_comm_hook(None, counting_hook)
        return wrapped


def train_cases(backend: af.backends.Backend, tensors: dict[str, torch.Tensor]) -> None:
    """Acceptance 1: every case of TRAIN_CASES with per-rank batch PER_RANK_BATCH."""
    for name in P.TRAIN_CASES:
        state = P.train_case(name, backend, P.PER_RANK_BATCH)
        tensors.update(P.parameters(state, f"train.{name}."))


def shard_orders(backend: af.backends.Backend, results: dict[str, Any]) -> None:
    """Acceptance 2: the indices each rank reads per epoch and seed, read twice."""
    loader = DataLoader(P.IndexDataset(P.NUM_SAMPLES), batch_size=P.PER_RANK_BATCH, shuffle=True)
    orders: dict[str, list[int]] = {}
    for seed in (P.SHARD_SEED, P.SHARD_SEED + 10):
        step = af.shard_data(seed=seed)(af.train_step(P.mse))
        for epoch in (0, 1):
            for attempt in (0, 1):
                seen = [int(i) for (_, index), _ in backend.batches(loader, step, epoch) for i in index]
                orders[f"seed{seed}.epoch{epoch}.read{attempt}"] = seen
    results["orders"] = orders

    stream = DataLoader(P.CountingStream(22), batch_size=3, num_workers=2)
    step = af.shard_data()(af.train_step(P.mse))
    results["stream_items"] = [int(i) for batch, _ in backend.batches(stream, step, 0) for i in batch]


def uneven(backend: af.backends.Backend, results: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Acceptance 3: 5 samples on 2 ranks, batch 1, map-style and streamed; gather_for_metrics."""
    step = af.compose(af.shard_data(seed=1), af.replicate())(af.train_step(P.mse))
    data = P.regression_data(5)
    state = af.run(step, P.make_state(), DataLoader(data, batch_size=1, shuffle=True), backend=backend,
                   epochs=2, progress=False)
    results["uneven_map_steps"] = state.step
    tensors.update(P.parameters(state, "uneven.map."))

    stream = DataLoader(_Samples(data), batch_size=1)  # ranks read 3 and 2 batches: even_out pads
    state = af.run(step, P.make_state(), stream, backend=backend, epochs=2, progress=False)
    results["uneven_stream_steps"] = state.step
    tensors.update(P.parameters(state, "uneven.stream."))

    loader = DataLoader(P.IndexDataset(5), batch_size=1)
    index_step = af.shard_data()(af.train_step(P.mse))
    gathered = [backend.gather_for_metrics(index) for (_, index), _ in backend.batches(loader, index_step, 0)]
    results["uneven_gathered"] = torch.cat(gathered).tolist()


class _Samples(torch.utils.data.IterableDataset):
    """A map-style dataset's samples as a stream (no length)."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __iter__(self) -> Any:
        return (self.dataset[i] for i in range(len(self.dataset)))


def collectives_and_evaluate(backend: af.backends.Backend, results: dict[str, Any],
                             tensors: dict[str, torch.Tensor]) -> None:
    """Acceptance 4: gather of lengths 2 and 3; evaluate on 9 samples, batch 5."""
    r = backend.rank
    mine = torch.stack([torch.arange(2 + r, dtype=torch.float32) + 10 * r, torch.full((2 + r,), float(r))], dim=1)
    tensors["gather"] = backend.gather(mine)
    results["reduce_sum"] = backend.reduce(torch.tensor([1.0 + r]), "sum").item()
    results["reduce_mean"] = backend.reduce(torch.tensor([1.0 + r]), "mean").item()
    results["broadcast"] = backend.broadcast(torch.tensor([5.0 + r]), src=1).item()
    results["gather_object"] = backend.gather_object({"rank": r})
    for name, tensor in (("dims", torch.zeros(2, 3 + r)), ("dtype", torch.zeros(2, 3, dtype=(torch.float32, torch.int64)[r]))):
        try:
            backend.gather(tensor)
            results[f"gather_{name}_error"] = None
        except ValueError as e:
            results[f"gather_{name}_error"] = str(e)

    state = P.make_state(seed=7)
    loader = DataLoader(P.IndexDataset(9), batch_size=5)
    outputs = af.evaluate(P.eval_outputs, state, loader, backend=backend)
    tensors["evaluate.prediction"] = outputs["prediction"]
    tensors["evaluate.index"] = outputs["index"]
    results["evaluate_local_batches"] = len(list(af.data.keyed_batches(loader, rank=r, world_size=2)))
    one = af.evaluate(P.eval_outputs, state, DataLoader(P.IndexDataset(1), batch_size=5), backend=backend)
    tensors["evaluate_one.prediction"] = one["prediction"]  # rank 1 has no sample at all


def count_allreduces(results: dict[str, Any]) -> None:
    """Acceptance 5: one gradient all-reduce per optimizer update under accumulate(3)."""
    backend = CountingCPU()
    step = af.compose(af.shard_data(), af.replicate(), af.accumulate(3))(af.train_step(P.mse))
    state, step_fn = backend.prepare(step, P.make_state())
    loader = DataLoader(P.regression_data(16), batch_size=1)  # 8 micro-batches per rank: windows 3, 3, 2
    per_micro_batch = []
    for epoch in (0, 1):
        for batch, last in backend.batches(loader, step, epoch):
            before = backend.allreduces
            state, metrics = step_fn(state, batch, flush=last)
            per_micro_batch.append({"allreduces": backend.allreduces - before, "updated": bool(metrics)})
        state = state.replace(epoch=state.epoch + 1, epoch_micro_step=0)
    results["allreduces"] = per_micro_batch
    results["allreduce_steps"] = state.step
    results["state_model_type"] = type(state.model).__name__

    options = af.replicate(bucket_cap_mb=1, find_unused_parameters=True, gradient_as_bucket_view=True)
    ddp = backend.wrap_model(P.make_state().model, options)
    results["ddp_options"] = [type(ddp).__name__, ddp.bucket_bytes_cap, ddp.find_unused_parameters,
                              ddp.gradient_as_bucket_view, ddp.static_graph]


def loss_counts(backend: af.backends.Backend, tensors: dict[str, torch.Tensor], out: Path) -> None:
    """af.Loss under replicate: 2 and 10 counted tokens equal one process with all 12; the
    logged losses go to OUT/tokens.jsonl. Then the 3 batches as one accumulate(3) window,
    with a metric, logged to OUT/tokens_window.jsonl."""
    step = af.replicate()(af.train_step(P.summed_mse))
    state = af.run(step, P.make_state(), P.rank_token_batches(backend.rank), backend=backend, progress=False,
                   trackers=[af.JSONL(out / "tokens.jsonl")])
    tensors.update(P.parameters(state, "tokens."))

    def with_error(model: torch.nn.Module, batch: Any) -> tuple[af.Loss, dict[str, torch.Tensor]]:
        x, y = batch
        return P.summed_mse(model, batch), {"abs_error": (model(x) - y).abs().mean()}

    step = af.compose(af.replicate(), af.accumulate(3))(af.train_step(with_error))
    af.run(step, P.make_state(), P.rank_token_batches(backend.rank), backend=backend, progress=False,
           trackers=[af.JSONL(out / "tokens_window.jsonl")])


def independent_skips(backend: af.backends.Backend, out: Path) -> None:
    """skip_nonfinite + clip without replicate: rank 1's 2nd update (an inf target) is
    skipped on rank 1 only; the points go to OUT/independent.jsonl."""
    step = af.compose(af.skip_nonfinite(), af.clip(1.0))(af.train_step(P.mse))
    data = [batch for batch in DataLoader(P.regression_data(12), batch_size=4)]
    if backend.rank == 1:
        data[1] = (data[1][0], torch.full_like(data[1][1], float("inf")))
    af.run(step, P.make_state(), data, backend=backend, progress=False,
           trackers=[af.JSONL(out / "independent.jsonl")])


def unequal_lengths(backend: af.backends.Backend, results: dict[str, Any]) -> None:
    """replicate() without shard_data over per-rank lists of 3 and 5 batches is refused up front."""
    step = af.replicate()(af.train_step(P.mse))
    data = [batch for batch in DataLoader(P.regression_data(4 * (3 + 2 * backend.rank)), batch_size=4)]
    state = P.make_state()
    before = [p.detach().clone() for p in state.model.parameters()]
    try:
        af.run(step, state, data, backend=backend, progress=False)
        results["unequal_error"] = None
    except ValueError as e:
        results["unequal_error"] = str(e)
    results["unequal_untouched"] = all(torch.equal(a, b) for a, b in zip(before, state.model.parameters()))


def unknown_lengths(backend: af.backends.Backend, tensors: dict[str, torch.Tensor]) -> None:
    """replicate() without shard_data over generators of 3 and 5 batches (lengths unknown):
    the ranks stay in step (rank 0 replays its first batch) instead of hanging."""
    step = af.replicate()(af.train_step(P.mse))
    state = af.run(step, P.make_state(), (b for b in P.rank_stream(backend.rank)), backend=backend, progress=False)
    tensors.update(P.parameters(state, "stream."))
    tensors["stream_step"] = torch.tensor(state.step)


def fp16_loss_counts(backend: af.backends.Backend, results: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """fp16 from a loss scale of 2**24 under shard_data + replicate + accumulate(4), micro-batches
    of 16 per rank, with a mean loss and with the same loss as af.Loss(sum, count)."""
    for name, loss_fn in (("mean", P.mse), ("summed", P.summed_mse)):
        step = af.compose(af.shard_data(seed=P.SHARD_SEED), af.replicate(), af.accumulate(4),
                          af.with_precision("fp16", init_scale=2.0**24))(af.train_step(loss_fn))
        data = DataLoader(P.regression_data(2 * 4 * 16 * 4), batch_size=16, shuffle=True)
        state = af.run(step, P.make_state(), data, backend=backend, epochs=4, progress=False)
        results[f"fp16_{name}"] = [state.step, state.transforms_state["skips"].num_skipped,
                                   state.transforms_state["loss_scale"].scale]
        tensors.update(P.parameters(state, f"fp16_{name}."))


def split_batches(backend: af.backends.Backend, results: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """shard_data(split_batches=True): the loader's batch of 6 is the global batch; each rank's
    indices per micro-batch, and training under replicate + accumulate(2) for 2 epochs."""
    step = af.compose(af.shard_data(seed=P.SHARD_SEED, split_batches=True), af.replicate(),
                      af.accumulate(2))(af.train_step(P.mse))
    loader = DataLoader(P.IndexDataset(P.NUM_SAMPLES), batch_size=2 * P.PER_RANK_BATCH, shuffle=True)
    results["split_indices"] = [[index.tolist() for (_, index), _ in backend.batches(loader, step, epoch)]
                                for epoch in (0, 1)]
    state = af.run(step, P.make_state(), DataLoader(P.regression_data(), batch_size=2 * P.PER_RANK_BATCH, shuffle=True),
                   backend=backend, epochs=2, progress=False)
    results["split_steps"] = state.step
    tensors.update(P.parameters(state, "split."))


def tensorboard(backend: af.backends.Backend, out: Path) -> None:
    """Acceptance 7: a run with a TensorBoard tracker on every rank."""
    P.train_case("e2_acc2_clip", backend, P.PER_RANK_BATCH, trackers=(af.TensorBoard(out / "tb"),))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    backend = af.backends.auto()
    results: dict[str, Any] = {"rank": backend.rank, "world_size": backend.world_size, "backend": backend.name}
    tensors: dict[str, torch.Tensor] = {}
    train_cases(backend, tensors)
    shard_orders(backend, results)
    uneven(backend, results, tensors)
    collectives_and_evaluate(backend, results, tensors)
    count_allreduces(results)
    loss_counts(backend, tensors, args.out)
    independent_skips(backend, args.out)
    unequal_lengths(backend, results)
    unknown_lengths(backend, tensors)
    fp16_loss_counts(backend, results, tensors)
    split_batches(backend, results, tensors)
    tensorboard(backend, args.out)
    save_file({k: v.contiguous() for k, v in tensors.items()}, args.out / f"rank{backend.rank}.safetensors")
    (args.out / f"rank{backend.rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
