"""Worker for tests/distributed/test_shard_params.py: one launch of 2 processes runs every check.

Usage: accelfn launch --nproc-per-node 2 shard_checks.py --out DIR
Each rank writes DIR/rank{r}.json (metrics, byte counts, types) and DIR/rank{r}.safetensors
(gathered parameters, optimizer state, evaluate outputs); the test compares them with
single-process references.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils.data import DataLoader

import accelfn as af
from tests.helpers import fsdp_dtypes as D
from tests.helpers import programs as P
from tests.helpers import sharded as S


class Record:
    """A tracker that keeps every logged point (the loop logs on the main process)."""

    def __init__(self) -> None:
        self.points: list[dict[str, float]] = []

    def log(self, metrics: Any, step: int) -> None:
        self.points.append({k: float(v) for k, v in metrics.items()})

    def close(self) -> None:
        pass


def train(backend: af.backends.Backend, results: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Acceptance 1: SGD and AdamW, accumulate(2) + clip(1.0), batch 3 per rank, 2 epochs."""
    for name in S.OPTIMIZERS:
        record = Record()
        state = af.run(S.train_program(), S.make_state(name), S.loader(P.PER_RANK_BATCH), backend=backend,
                       epochs=S.EPOCHS, progress=False, trackers=[record])
        tensors.update(S.full_parameters(state.model, f"train.{name}."))
        params = [p for group in state.optimizer.param_groups for p in group["params"]]
        results[f"train.{name}"] = {
            "grad_norms": [p["grad_norm"] for p in record.points],
            "step": state.step,
            "model_type": type(state.model).__name__,
            "model_params_are_optimizer_params": [id(p) for p in state.model.parameters()] == [id(p) for p in params],
            "param_types": sorted({type(p.data).__name__ for p in params}),
            "optimizer_state_types": sorted({type(v).__name__ for s in state.optimizer.state.values()
                                             for k, v in s.items() if k != "step"}),
            "local_numel": sum(p.to_local().numel() for p in params),
            "full_numel": sum(p.numel() for p in params),
        }
        if name == "adamw":
            loader = DataLoader(P.IndexDataset(9), batch_size=2)
            outputs = af.evaluate(P.eval_outputs, state, loader, backend=backend)
            tensors["evaluate.prediction"] = outputs["prediction"]
            tensors["evaluate.index"] = outputs["index"]
            # fewer batches than ranks: rank 1 has none and runs a copy of rank 0's first batch
            one = af.evaluate(P.eval_outputs, state, DataLoader(P.IndexDataset(1), batch_size=4), backend=backend)
            tensors["evaluate_one.prediction"], tensors["evaluate_one.index"] = one["prediction"], one["index"]
            x3 = P.IndexDataset(3).x
            tensors["evaluate_list.prediction"] = af.evaluate(lambda m, b: m(b[0]), state, [(x3,)], backend=backend)
    # a loop of one's own in step: rank 0 has two items, rank 1 none
    own = [(torch.tensor([1.0, 2.0]), "a"), (torch.tensor([3.0, 4.0]), "b")] if backend.rank == 0 else []
    results["lockstep_empty_rank"] = [(t.tolist(), tag, replayed)
                                      for (t, tag), replayed in backend.lockstep(iter(own), replays=True)]
    # the other options change how, not what: every Linear a unit, parameters kept gathered
    # from forward to backward, a reduce-scatter after every micro-batch
    options = af.shard_params(units=torch.nn.Linear, reshard_after_forward=False, reduce_every_micro_batch=True)
    state = af.run(S.train_program(options), S.make_state("adamw"), S.loader(P.PER_RANK_BATCH), backend=backend,
                   epochs=S.EPOCHS, progress=False)
    tensors.update(S.full_parameters(state.model, "options."))
    results["options_units"] = sorted({type(m).__name__ for m in state.model.modules()
                                       if type(m).__name__.startswith("FSDP")})
    state = af.run(S.train_program(clip=af.clip_value(S.CLIP_VALUE)), S.make_state("sgd"), S.loader(P.PER_RANK_BATCH),
                   backend=backend, epochs=S.EPOCHS, progress=False)
    tensors.update(S.full_parameters(state.model, "clip_value."))
    # run() twice on one state: the second prepare finds the model sharded and goes on
    state = af.run(S.train_program(), S.make_state("adamw"), S.loader(P.PER_RANK_BATCH), backend=backend,
                   epochs=1, progress=False)
    state = af.run(S.train_program(), state, S.loader(P.PER_RANK_BATCH), backend=backend, epochs=S.EPOCHS,
                   progress=False)
    tensors.update(S.full_parameters(state.model, "twice."))
    try:
        backend.prepare(af.train_step(P.mse), state)
    except ValueError as e:
        results["unsharded_step_on_sharded_state"] = str(e)


def narrow_clip(backend: af.backends.Backend, results: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """clip with the inf-norm (and the 2-norm) over parameters with fewer rows than ranks:
    rank 1's shards of ``Linear(4, 1)`` are all empty, of ``Blocks``' output layer some."""
    for model in ("narrow", "blocks"):
        for norm in ("inf", "2"):
            clip = af.clip(S.CLIP, norm_type=float(norm))
            step = af.compose(af.shard_data(seed=P.SHARD_SEED), af.shard_params(), af.accumulate(2),
                              clip)(af.train_step(P.mse))
            record = Record()
            state = af.run(step, S.make_state("sgd", narrow=model == "narrow"), S.loader(P.PER_RANK_BATCH),
                           backend=backend, epochs=S.EPOCHS, progress=False, trackers=[record])
            norms = [p["grad_norm"] for p in record.points]  # logged on rank 0
            results[f"narrow_clip.{model}.{norm}"] = {
                "grad_norms": norms,
                "empty_shards": sum(p.to_local().numel() == 0 for p in state.model.parameters()),
            }
            tensors.update(S.full_parameters(state.model, f"narrow_clip.{model}.{norm}."))


def memory(backend: af.backends.Backend, results: dict[str, Any]) -> None:
    """Acceptance 2: this rank's parameter + AdamW-state bytes after one update, 4 equal blocks."""
    step = af.compose(af.shard_params())(af.train_step(P.mse))
    state, step_fn = backend.prepare(step, S.make_state("adamw", depth=4))
    state, _ = step_fn(state, P.token_batches((4,), seed=backend.rank)[0])
    results["memory"] = S.state_bytes(state)


def optimizer_state_before_prepare(backend: af.backends.Backend, tensors: dict[str, torch.Tensor]) -> None:
    """An optimizer that already has state (restored before training) is sharded with it."""
    state = S.make_state("adamw")
    x, y = P.regression_data().tensors
    P.mse(state.model, (x, y)).backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    state, step_fn = backend.prepare(af.shard_params()(af.train_step(P.mse)), state)
    for i, param in enumerate(p for group in state.optimizer.param_groups for p in group["params"]):
        for key in ("exp_avg", "exp_avg_sq"):
            tensors[f"restate.{i}.{key}"] = state.optimizer.state[param][key].full_tensor()
    half = len(x) // 2
    rows = slice(backend.rank * half, (backend.rank + 1) * half)
    state, _ = step_fn(state, (x[rows], y[rows]))
    tensors.update(S.full_parameters(state.model, "restate."))


def precision(backend: af.backends.Backend, results: dict[str, Any]) -> None:
    """Acceptance 3: bf16 and fp16 under shard_params lower the loss (metrics of every rank)."""
    for policy in ("bf16", "fp16", "bf16-true"):
        step = af.compose(af.shard_params(), af.with_precision(policy))(af.train_step(P.mse))
        state, step_fn = backend.prepare(step, S.make_state("adamw"))
        losses = []
        for epoch in range(3):
            for batch in S.learnable(seed=5 + backend.rank):
                state, metrics = step_fn(state, batch)
                losses.append(float(metrics["loss"]))
        results[f"precision.{policy}"] = {"losses": losses, "param_dtype": str(state.model.inp.weight.dtype)}


def overflow_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def fp16_skip(backend: af.backends.Backend, results: dict[str, Any]) -> None:
    """Acceptance 3: an fp16 overflow confined to rank 0's shard makes both ranks skip.

    The model is one Linear(8, 4), sharded by rows: rank 0 holds output rows 0-1, rank 1
    rows 2-3. A target of 1e4 in column 0 overflows the fp16 gradient of row 0 only.
    """
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.compose(af.shard_params(), af.with_precision("fp16", init_scale=2.0**10))(af.train_step(overflow_loss))
    state, step_fn = backend.prepare(step, state)
    g = torch.Generator().manual_seed(backend.rank)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(3)]
    batches[1][1][:, 0] = 1e4
    local_finite, skipped, scales, moved = [], [], [], []
    for batch in batches:
        # which rank's own gradient shards overflow, from the same scaled backward
        with torch.autocast("cpu", dtype=torch.float16):
            loss = overflow_loss(state.model, batch)
        (loss * 2.0**10).backward()
        local_finite.append(all(bool(p.grad.to_local().isfinite().all()) for p in state.model.parameters()))
        state.optimizer.zero_grad(set_to_none=True)
        before = [p.to_local().clone() for p in state.model.parameters()]
        state, metrics = step_fn(state, batch)
        skipped.append(int(metrics["skipped"]))
        scales.append(float(metrics["loss_scale"]))
        moved.append(any(not torch.equal(b, p.to_local()) for b, p in zip(before, state.model.parameters())))
    results["fp16_skip"] = {"local_finite": local_finite, "skipped": skipped, "loss_scales": scales,
                            "moved": moved, "step": state.step,
                            "skips": state.transforms_state["skips"].num_skipped}


def loss_counts(backend: af.backends.Backend, tensors: dict[str, torch.Tensor]) -> None:
    """af.Loss under shard_params: 2 and 10 counted tokens equal one process with all 12."""
    step = af.shard_params()(af.train_step(P.summed_mse))
    state = af.run(step, P.make_state(), P.rank_token_batches(backend.rank), backend=backend, progress=False)
    tensors.update(S.full_parameters(state.model, "tokens."))


def dtype_workarounds(backend: af.backends.Backend, results: dict[str, Any],
                      tensors: dict[str, torch.Tensor]) -> None:
    """FSDP2's dtype decisions under bf16: blocks unfrozen for a second run, and an auxiliary
    head first used on a window's last micro-batch (tests/helpers/fsdp_dtypes.py)."""
    for kind in ("unfreeze", "aux"):
        model = D.build(kind)
        state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.2))
        transforms = [af.shard_params(), af.with_precision("bf16")] + ([af.accumulate(2)] if kind == "aux" else [])
        step = af.compose(*transforms)(af.train_step(D.loss_fn))
        data = D.rank_batches(kind, backend.rank, backend.world_size)
        try:
            state = af.run(step, state, data, backend=backend, epochs=1, progress=False)
            if kind == "unfreeze":
                state.model.blocks.requires_grad_(True)
                state = af.run(step, state, data, backend=backend, epochs=2, progress=False)
        except Exception as e:  # noqa: BLE001  # recorded: the other checks go on
            results[f"dtypes.{kind}"] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        results[f"dtypes.{kind}"] = "trained"
        tensors.update(S.full_parameters(state.model, f"dtypes.{kind}."))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    backend = af.backends.auto()
    results: dict[str, Any] = {"world_size": backend.world_size}
    tensors: dict[str, torch.Tensor] = {}
    train(backend, results, tensors)
    narrow_clip(backend, results, tensors)
    memory(backend, results)
    optimizer_state_before_prepare(backend, tensors)
    precision(backend, results)
    fp16_skip(backend, results)
    loss_counts(backend, tensors)
    dtype_workarounds(backend, results, tensors)
    (args.out / f"rank{backend.rank}.json").write_text(json.dumps(results))
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
              args.out / f"rank{backend.rank}.safetensors")


if __name__ == "__main__":
    main()
