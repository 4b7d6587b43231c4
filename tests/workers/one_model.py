"""Worker for tests/backends/test_one_model.py: what "the model" is across 2 ranks.

Usage: accelfn launch --nproc-per-node 2 one_model.py --out DIR
One launch checks every claim: forwards outside training run in the parameters' precision
under ``shard_params`` + bf16 (``af.evaluate``, an ``eval_batches`` loop, a plain forward,
``backend.autocast``, hooks); replicas whose buffers drifted apart are one model to
``evaluate``, ``save``, ``save_model`` and hooks (``replicate`` and ``shard_params``); and
per-rank ``extra`` state comes back per rank from a checkpoint (plain tensors).
Each rank writes DIR/rank{r}.json and DIR/rank{r}.safetensors; the test compares them with
references written by hand in PyTorch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

import accelfn as af
from tests.helpers import programs as P
from tests.helpers import sharded as S

#: the evaluation inputs of the precision checks (the same on every rank), scaled so that
#: bf16 rounding shows (about 3e-3 on the outputs)
EVAL_X = torch.randn(10, 4, generator=torch.Generator().manual_seed(7)) * 3


def bf16_program(shard: af.ShardParams | None = None) -> af.Step:
    return af.compose(af.shard_data(), shard or af.shard_params(), af.with_precision("bf16"))(
        af.train_step(lambda m, b: F.mse_loss(m(b[0]).float(), b[1])))


def precision(backend: af.backends.Backend, results: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Item 3: shard_params + bf16 trains 2 epochs; then every forward outside training runs
    in fp32 unless asked for the training policy; evaluating in a hook between updates
    leaves training bitwise as without it."""
    data = S.loader(4)
    seen: list[torch.Tensor] = []

    def evaluate_in_hook(state: af.TrainState, b: af.backends.Backend) -> None:
        seen.append(af.evaluate(lambda m, x: m(x[0]), state, DataLoader(TensorDataset(EVAL_X), batch_size=5),
                                backend=b))

    for name, shard in (("root", af.shard_params()), ("units", af.shard_params(units=torch.nn.Linear,
                                                                                reshard_after_forward=False))):
        step = bf16_program(shard)
        plain = af.run(step, S.make_state(), data, backend=backend, epochs=2, progress=False)
        hooked = af.run(step, S.make_state(), data, backend=backend, epochs=2, progress=False,
                        hooks=[af.Hook(evaluate_in_hook, every_steps=1)])
        tensors.update(S.full_parameters(plain.model, f"precision.{name}.plain."))
        tensors.update(S.full_parameters(hooked.model, f"precision.{name}.hooked."))
        tensors[f"precision.{name}.hook_eval"] = seen[-1]
        loader = DataLoader(TensorDataset(EVAL_X), batch_size=5)
        out = af.evaluate(lambda m, b: m(b[0]), plain, loader, backend=backend)
        tensors[f"precision.{name}.evaluate"] = out
        tensors[f"precision.{name}.evaluate_training"] = af.evaluate(lambda m, b: m(b[0]), plain, loader,
                                                                     backend=backend, precision=step).float()
        with torch.no_grad():  # a loop of one's own over eval_batches, a plain forward (generation)
            own = [plain.model(b[0]) for b in backend.eval_batches(loader)]
            tensors[f"precision.{name}.eval_batches"] = backend.gather_for_metrics(torch.cat(own))
            tensors[f"precision.{name}.forward"] = plain.model(EVAL_X)
            with backend.autocast(step):
                tensors[f"precision.{name}.autocast"] = plain.model(EVAL_X).float()
            tensors[f"precision.{name}.forward_after"] = plain.model(EVAL_X)
        results[f"precision.{name}"] = {"dtypes": [str(t.dtype) for t in (out, own[0])]}


class Normed(torch.nn.Module):
    """``Linear(4, 6)``, ``BatchNorm1d(6)``, tanh, ``Linear(6, 1)``: running statistics that
    each rank's training forward updates from its own batch."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 6)
        self.norm = torch.nn.BatchNorm1d(6)
        self.out = torch.nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.inp(x))))


def buffers(backend: af.backends.Backend, results: dict[str, Any], tensors: dict[str, torch.Tensor],
            out: Path) -> None:
    """Item 2: replicas whose BatchNorm statistics drift apart (each rank's batches differ) are
    one model to hooks, af.evaluate, af.save and af.save_model: rank 0's buffers."""
    for name, parallel in (("replicate", af.replicate()), ("shard_params", af.shard_params())):
        torch.manual_seed(0)
        model = Normed()
        state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        step = af.compose(af.shard_data(), parallel)(af.train_step(lambda m, b: F.mse_loss(m(b[0]), b[1])))
        means: list[torch.Tensor] = []
        hook = af.Hook(lambda s, b: means.append(s.model.norm.running_mean.detach().clone()), every_steps=1)
        state = af.run(step, state, S.loader(4), backend=backend, epochs=2, progress=False, hooks=[hook])
        tensors[f"buffers.{name}.hook_means"] = torch.stack(means)
        af.save(state, out / f"ckpt_{name}", backend=backend)
        af.save_model(state, out / f"export_{name}", backend=backend)
        tensors[f"buffers.{name}.evaluate"] = af.evaluate(
            lambda m, b: m(b[0]), state, DataLoader(TensorDataset(EVAL_X), batch_size=5), backend=backend)
        tensors[f"buffers.{name}.final_mean"] = state.model.norm.running_mean.detach().clone()


class Offset:
    """A per-rank stream position (rank r reads 10 + 1000 r items per update), as a
    resumable iterable dataset keeps it: a tensor and a Python int."""

    def __init__(self) -> None:
        self.position, self.updates = torch.zeros((), dtype=torch.int64), 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position, self.updates = state["position"].clone(), state["updates"]


class Shards:
    """An EMA of this rank's parameter shards (``to_local()`` clones), or of the DTensors
    themselves with ``local=False`` (tests/workers/extra_dtensors.py checks those)."""

    def __init__(self, model: torch.nn.Module, local: bool = True) -> None:
        self.model, self.local, self.shadow = model, local, []

    def update(self) -> None:
        with torch.no_grad():
            current = [p.detach().to_local().clone() if self.local else p.detach().clone()
                       for p in self.model.parameters()]
            if not self.shadow:
                self.shadow = current
            else:
                for s, c in zip(self.shadow, current):
                    s.mul_(0.5).add_(c, alpha=0.5)

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": self.shadow}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shadow = [t.clone() for t in state["shadow"]]


class Shared:
    """A state equal on every rank (a best score)."""

    def __init__(self) -> None:
        self.best = 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state["best"]


def per_rank_extra(backend: af.backends.Backend, results: dict[str, Any], tensors: dict[str, torch.Tensor],
                   out: Path) -> None:
    """Item 1: extra states that differ between ranks come back per rank from a checkpoint
    (replicate with background checkpoints, shard_params with shard EMAs); a shared one stays
    shared."""
    r = backend.rank

    def replicate_state() -> af.TrainState:
        state = P.make_state()
        return state.replace(extra={"offset": Offset(), "shared": Shared()})

    def advance(s: af.TrainState, b: af.backends.Backend) -> None:
        s.extra["offset"].position += 10 + 1000 * b.rank
        s.extra["offset"].updates += 1
        s.extra["shared"].best = float(s.step)

    step = af.compose(af.shard_data(), af.replicate())(af.train_step(P.mse))
    hooks = [af.Hook(advance, every_steps=1)]
    checkpoints = af.Checkpoints(out / "extra_replicate", every_steps=4, asynchronous=True)
    first = af.run(step, replicate_state(), S.loader(2), backend=backend, max_steps=4, epochs=None,
                   progress=False, hooks=hooks, checkpoints=checkpoints)
    resumed = af.run(step, replicate_state(), S.loader(2), backend=backend, max_steps=4, epochs=None,
                     progress=False, hooks=hooks, checkpoints=checkpoints, resume="auto")
    results["extra.replicate"] = {
        "before": [int(first.extra["offset"].position), first.extra["offset"].updates, first.extra["shared"].best],
        "after": [int(resumed.extra["offset"].position), resumed.extra["offset"].updates,
                  resumed.extra["shared"].best], "resumed_step": resumed.step}

    def sharded_state(local: bool = True) -> af.TrainState:
        state = S.make_state("sgd")
        return state.replace(extra={"ema": Shards(state.model, local)})

    program = af.shard_params()(af.train_step(P.mse))
    ema_hook = [af.Hook(lambda s, b: s.extra["ema"].update(), every_steps=1)]
    checkpoints = af.Checkpoints(out / "extra_sharded", every_steps=4)
    data = S.learnable(32)
    local = [(x[r::2], y[r::2]) for x, y in data]
    first = af.run(program, sharded_state(), local, backend=backend, progress=False, hooks=ema_hook,
                   checkpoints=checkpoints)
    resumed = af.run(program, sharded_state(), local, backend=backend, progress=False, hooks=ema_hook,
                     checkpoints=checkpoints, resume="auto")
    for i, (a, b) in enumerate(zip(first.extra["ema"].shadow, resumed.extra["ema"].shadow)):
        tensors[f"extra.sharded.before.{i}"], tensors[f"extra.sharded.after.{i}"] = a, b
    results["extra.sharded"] = {"resumed_step": resumed.step, "num": len(first.extra["ema"].shadow)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    backend = af.backends.auto()
    results: dict[str, Any] = {"world_size": backend.world_size}
    tensors: dict[str, torch.Tensor] = {}
    precision(backend, results, tensors)
    buffers(backend, results, tensors, args.out)
    per_rank_extra(backend, results, tensors, args.out)
    (args.out / f"rank{backend.rank}.json").write_text(json.dumps(results))
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
              args.out / f"rank{backend.rank}.safetensors")


if __name__ == "__main__":
    main()
