"""Worker for tests/distributed/test_context_parallel.py: ``context_parallel(size=2)`` on 2 or
4 real gloo processes.

Usage: accelfn launch --nproc-per-node N cp_checks.py --out DIR

For each scenario (the loss, load balancing, the data-parallel transform the context ranks
fold into, tensor parallelism) the small causal transformer of ``tests.helpers.context_parallel``
takes ``UPDATES`` SGD updates, each over this rank's data shard of the update's ``BATCH``
sequences, through ``backend.prepare``'s step function; it records the losses (averaged over
every rank, as ``run`` reduces them), the first update's gradient ((before - after) / LR) and
the final parameters, gathered whole, in DIR/rank{r}.safetensors, and what it saw in
DIR/rank{r}.json. Then a sequence length that does not divide, refused with the state unchanged;
and (on 4 processes) ``af.run`` under shard_data + CP x FSDP over 2 epochs, whole, stopped after
3 updates with a checkpoint, and resumed from it into a fresh state.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

import accelfn as af
from accelfn.distributed.phases import layout
from tests.helpers import context_parallel as C


def scenarios(world: int) -> dict[str, Any]:
    both = {f"{loss}_{'lb' if lb else 'nolb'}_{fold}": (loss, lb, fold, None)
            for loss in ("mean", "counted") for lb in (True, False) for fold in ("shard", "replicate")}
    if world == 4:
        both = {k: v for k, v in both.items() if k.endswith("shard") and "nolb" not in k}
        both["mean_lb_shard_tp"] = ("mean", True, "shard", {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"})
    return both


def program(loss: str, load_balance: bool, fold: str, plan: Any) -> af.Step:
    transforms = [af.context_parallel(size=2, load_balance=load_balance),
                  af.shard_params() if fold == "shard" else af.replicate()]
    if plan is not None:
        transforms.append(af.tensor_parallel(plan, size=2))
    return af.compose(*transforms)(af.train_step(C.LOSSES[loss]))


def train(backend: af.backends.Backend, step: af.Step) -> tuple[af.TrainState, Any, list[float], dict[str, Any]]:
    state, step_fn = backend.prepare(step, C.make_state())
    data_rank, data_world, _, _ = layout(state.model, backend.rank, backend.world_size)
    data = C.sequences()
    losses, grads = [], {}
    for u in range(C.UPDATES):
        whole = [t[u * C.BATCH:(u + 1) * C.BATCH] for t in data]
        batch = tuple(t[data_rank::data_world] for t in whole)
        before = C.full_parameters(state.model)
        state, metrics = step_fn(state, batch)
        loss = torch.as_tensor(metrics["loss"], dtype=torch.float64).clone()
        dist.all_reduce(loss)
        losses.append(float(loss) / backend.world_size)
        if u == 0:
            after = C.full_parameters(state.model)
            grads = {n: (before[n] - after[n]) / C.LR for n in before}
    return state, step_fn, losses, grads


def checkpointed(out: Path) -> dict[str, torch.Tensor]:
    """The whole run's, the stopped run's and the resumed run's parameters, gathered whole."""
    backend = af.backends.auto()
    step = af.compose(af.shard_data(), af.context_parallel(size=2), af.shard_params())(af.train_step(C.counted_loss))
    loader = DataLoader(TensorDataset(*C.sequences()), batch_size=C.BATCH // 2, shuffle=True)
    runs = {"whole": af.run(step, C.make_state(), loader, backend=backend, epochs=2, progress=False)}
    keep = af.Checkpoints(out / "ckpt", every_steps=3)
    runs["stopped"] = af.run(step, C.make_state(), loader, backend=backend, epochs=2, max_steps=3, checkpoints=keep,
                             progress=False)
    torch.manual_seed(123)  # another start: the checkpoint decides
    runs["resumed"] = af.run(step, C.make_state(), loader, backend=backend, epochs=2, checkpoints=keep, resume="auto",
                             progress=False)
    return {f"run.{name}.{n}": p for name, state in runs.items() for n, p in C.full_parameters(state.model).items()} | {
        f"run.{name}.step": torch.tensor(state.step) for name, state in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    backend = af.backends.auto()
    result: dict[str, Any] = {"losses": {}}
    tensors: dict[str, torch.Tensor] = {}
    state: Any = None
    for name, (loss, lb, fold, plan) in scenarios(backend.world_size).items():
        state, step_fn, losses, grads = train(backend, program(loss, lb, fold, plan))
        result["losses"][name] = losses
        tensors |= {f"{name}.grad.{n}": g for n, g in grads.items()}
        tensors |= {f"{name}.param.{n}": p for n, p in C.full_parameters(state.model).items()}
    # a length of 9 divides into neither 2 nor 4 parts: refused before the forward, nothing changed
    before, step = C.full_parameters(state.model), state.step
    short = tuple(t[:C.BATCH // 2, :9] for t in C.sequences())
    try:
        step_fn(state, short)
    except ValueError as e:
        result["length_error"] = str(e)
    result["unchanged_after_error"] = state.step == step and all(
        torch.equal(before[n], p) for n, p in C.full_parameters(state.model).items())
    fresh = C.make_state()
    try:  # the context ranks' gradients would never be summed
        backend.prepare(af.context_parallel(size=2)(af.train_step(C.mean_loss)), fresh)
    except ValueError as e:
        result["no_reduction_error"] = str(e)
    result["fresh_untouched"] = type(fresh.model).__name__ == "Transformer"
    if backend.world_size == 4:
        tensors |= checkpointed(out)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / f"rank{backend.rank}.safetensors")
    (out / f"rank{backend.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
