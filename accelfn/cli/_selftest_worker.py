"""The checks ``accelfn test`` runs in every launched process.

``python -m accelfn.cli._selftest_worker OUT [--fault F]``, started by ``accelfn launch``:
each rank runs the checks of its world, rank 0 writes ``OUT/results-<world size>.json``
(a list of ``{"name", "status", "detail"}``, a check failing if it failed on any rank).
The data, model and optimizer are tiny and built here, so the checks compare exact values.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from accelfn.backends import CPU, CUDA, Backend, LaunchEnv, auto
from accelfn.checkpoint import load, save
from accelfn.cli._selftest import FAULTS
from accelfn.distributed import float8
from accelfn.loop import run
from accelfn.state import TrainState
from accelfn.step import Step, output_loss, train_step
from accelfn.transforms import (
    Transform,
    accumulate,
    clip,
    compose,
    deepspeed,
    parse_policy,
    pipeline,
    replicate,
    shard_data,
    shard_params,
    tensor_parallel,
    with_precision,
)

FEATURES, HIDDEN, CLASSES, BATCH, WINDOW, UPDATES, MAX_NORM, LR = 8, 16, 3, 4, 2, 3, 0.1, 0.5
#: parameters may differ from the 1-process reference by float32 rounding of the all-reduce
TOLERANCE = 1e-5

Check = tuple[str, str, str]  # name, PASS/FAIL/SKIP, detail


def _model(seed: int = 0, *, stages: int = 1, width: int = HIDDEN) -> torch.nn.Module:
    """``FEATURES -> width -> tanh -> CLASSES``; with ``stages`` > 1, ``stages - 1`` hidden
    ``width -> width -> tanh`` layers in between (module names "2", "4", ...: where a
    pipeline's stages begin)."""
    torch.manual_seed(seed)
    hidden = [layer for _ in range(stages - 1) for layer in (torch.nn.Linear(width, width), torch.nn.Tanh())]
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, width), torch.nn.Tanh(), *hidden,
                               torch.nn.Linear(width, CLASSES))


def _data(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``UPDATES`` global batches of ``BATCH * WINDOW * world_size`` samples."""
    g = torch.Generator().manual_seed(1)
    n = UPDATES * BATCH * WINDOW * world_size
    return torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).float(), y)


def _pipeline_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``_loss`` in ``pipeline``'s form: the last stage's output and the targets."""
    return F.cross_entropy(output.float(), targets)


def _state(seed: int = 0, *, stages: int = 1, width: int = HIDDEN) -> TrainState:
    model = _model(seed, stages=stages, width=width)
    return TrainState.create(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))


def _reference(world_size: int, *, stages: int = 1, width: int = HIDDEN) -> list[torch.Tensor]:
    """The hand-written 1-process loop: each update on the whole global batch (of
    ``world_size`` ranks' micro-batches), clipped."""
    x, y = _data(world_size)
    model = _model(stages=stages, width=width)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    size = BATCH * WINDOW * world_size
    for u in range(UPDATES):
        F.cross_entropy(model(x[u * size:(u + 1) * size]), y[u * size:(u + 1) * size]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach() for p in model.parameters()]


def _program(fault: str | None, *transforms: Any) -> Step:
    data_parallel = () if fault == "no-allreduce" else (replicate(),)  # a broken gradient all-reduce
    return compose(shard_data(), *data_parallel, accumulate(WINDOW), clip(MAX_NORM), *transforms)(train_step(_loss))


def _train(backend: Backend, state: TrainState, step: Step, epochs: int = 1,
           data_world: int | None = None) -> TrainState:
    """``step`` over ``_data(data_world)`` (by default the world size: the ranks read shards of it)."""
    x, y = _data(backend.world_size if data_world is None else data_world)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH)
    return run(step, state, loader, backend=backend, epochs=epochs, progress=False)


def _params(state: TrainState) -> list[torch.Tensor]:
    """The parameters, whole (a sharded one gathered from every rank: call on every rank)."""
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu()
            for p in state.model.parameters()]


def _max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a, b))


def _processes(backend: Backend) -> str:
    n = backend.world_size
    group = {"cpu": "gloo", "cuda": "nccl", "xla": "xla"}[backend.name]
    return f"{n} process" if n == 1 else f"{n} processes ({group})"


# -- the checks ---------------------------------------------------------------------------------

def check_training(backend: Backend, fault: str | None) -> tuple[str, TrainState]:
    """Data-parallel training with accumulation and clipping equals the 1-process reference."""
    state = _train(backend, _state(), _program(fault))
    difference = _max_difference(_params(state), _reference(backend.world_size))
    detail = f"max |difference| {difference:.1e} after {state.step} updates (tolerance {TOLERANCE:g})"
    if state.step != UPDATES or not difference <= TOLERANCE:
        raise AssertionError(detail)
    return detail, state


def check_parallel(backend: Backend, kind: str) -> str:
    """Training under ``kind`` (``"shard_params"``, ``"tensor_parallel"``, ``"pipeline"`` or
    ``"deepspeed"``, over every rank) with accumulation and clipping equals the 1-process
    reference on the same global batches: shard_params and deepspeed shard the data over the
    ranks; tensor_parallel and pipeline split one model over them, every rank reading the
    whole batch."""
    n = backend.world_size
    stages = n if kind == "pipeline" else 1
    width = -(-HIDDEN // n) * n if kind == "tensor_parallel" else HIDDEN  # split evenly over the ranks
    builders: dict[str, Callable[[], Transform]] = {
        "shard_params": shard_params,
        "tensor_parallel": lambda: tensor_parallel({"0": "colwise", "2": "rowwise"}, size=n),
        "pipeline": lambda: pipeline([str(2 * i) for i in range(1, n)], size=n, schedule="gpipe"),
        # SGD is not one of the optimizers DeepSpeed's ZeRO was tested with: allowed by name
        "deepspeed": lambda: deepspeed({"zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}),
    }
    parallel = builders[kind]()
    loss: Any = output_loss(_pipeline_loss) if kind == "pipeline" else _loss  # pipeline's form: (output, targets)
    step = compose(shard_data(), parallel, accumulate(WINDOW), clip(MAX_NORM))(train_step(loss))
    data_world = n if kind in ("shard_params", "deepspeed") else 1
    state = _train(backend, _state(stages=stages, width=width), step, data_world=data_world)
    difference = _max_difference(_whole(backend, state, kind), _reference(data_world, stages=stages, width=width))
    detail = f"max |difference| {difference:.1e} after {state.step} updates (tolerance {TOLERANCE:g})"
    if state.step != UPDATES or not difference <= TOLERANCE:
        raise AssertionError(detail)
    return detail


def _whole(backend: Backend, state: TrainState, kind: str) -> list[torch.Tensor]:
    """The whole model's parameters on every rank: a pipeline's stages hold theirs alone (by
    name), gathered from every rank; a sharded one's are gathered by ``_params``."""
    if kind != "pipeline":
        return _params(state)
    mine = {name: p.detach().float().cpu() for name, p in state.model.named_parameters()}
    whole = {name: p for part in backend.gather_object(mine) for name, p in part.items()}
    return [whole[name] for name, _ in _model(stages=backend.world_size).named_parameters()]


def check_checkpoint(backend: Backend, state: TrainState, directory: Path, fault: str | None) -> str:
    """A saved state loads into a fresh one bitwise, and both train on identically (which
    also needs the optimizer's momentum and the RNG states back)."""
    save(state, directory, backend=backend)
    if fault == "corrupt-checkpoint" and backend.is_main_process:
        _flip_a_byte(directory)
    backend.barrier()
    loaded = load(directory, into=_state(seed=1), backend=backend)
    differing = [name for (name, p), q in zip(state.model.named_parameters(), loaded.model.parameters())
                 if not torch.equal(p.detach().cpu(), q.detach().cpu())]
    counters = [(s.step, s.micro_step, s.epoch) for s in (loaded, state)]
    if differing or counters[0] != counters[1]:
        raise AssertionError(f"the loaded state differs: parameters {differing}, counters {counters[0]} != "
                             f"{counters[1]}")
    step = _program(None)
    a, b = _train(backend, state, step, epochs=2), _train(backend, loaded, step, epochs=2)
    if _max_difference(_params(a), _params(b)) != 0:
        raise AssertionError("training on from the loaded state differs from training on from the saved one")
    size = sum(p.numel() for p in state.model.parameters())
    return f"{size} parameters and counters bitwise equal, then 1 more epoch"


def _flip_a_byte(directory: Path) -> None:
    """The fault ``corrupt-checkpoint``: one byte of the largest tensor file changes on disk."""
    largest = max(directory.rglob("*.safetensors"), key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[-1] ^= 0xFF
    largest.write_bytes(bytes(data))


def check_gather(backend: Backend) -> str:
    """``gather`` concatenates tensors whose first dimensions differ across ranks."""
    rank, n = backend.rank, backend.world_size
    mine = torch.full((rank + 1, 2), float(rank), device=backend.device)
    got = backend.gather(mine).cpu()
    expected = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(n)])
    if not torch.equal(got, expected):
        raise AssertionError(f"got {got.tolist()}, expected {expected.tolist()}")
    return f"rows {list(range(1, n + 1))} from ranks 0..{n - 1} gathered in rank order"


def precision_backends(launched: Backend) -> Iterator[Backend]:
    """This machine's backends for a 1-process world: CPU, CUDA where torch sees a GPU, and
    the launched one (XLA, when ``--backend xla`` asked for it)."""
    env = LaunchEnv()
    yield launched if launched.name == "cpu" else CPU(env)
    if torch.cuda.is_available():
        yield launched if launched.name == "cuda" else CUDA(env)
    if launched.name == "xla":
        yield launched


def check_precision(backend: Backend, precision: str) -> str:
    """Training under ``precision`` lowers the loss, and every parameter stays finite (fp8: on
    the model with a hidden ``HIDDEN x HIDDEN`` layer, the one that suits float8)."""
    x, y = _data(1)
    stages = 2 if parse_policy(precision).float8 is not None else 1
    state = _state(stages=stages)
    before = float(F.cross_entropy(state.model(x), y))
    state = _train(backend, state, compose(accumulate(WINDOW), clip(1.0), with_precision(precision))(
        train_step(_loss)), epochs=10)
    params = _params(state)
    model = _model(stages=stages)
    with torch.no_grad():
        for p, q in zip(model.parameters(), params):
            p.copy_(q)
        after = float(F.cross_entropy(model(x), y))
    if not all(bool(torch.isfinite(p).all()) for p in params) or not after < before:
        raise AssertionError(f"loss {before:.4f} -> {after:.4f} after {state.step} updates")
    return f"loss {before:.4f} -> {after:.4f} in {state.step} updates"


# -- running them -------------------------------------------------------------------------------

def _attempt(name: str, check: Callable[[], str]) -> Check:
    try:
        return name, "PASS", check()
    except Exception as e:  # noqa: BLE001 (a failed check is reported, whatever failed)
        last = str(e) if isinstance(e, AssertionError) else traceback.format_exception_only(type(e), e)[-1].strip()
        return name, "FAIL", last


def checks(backend: Backend, out: Path, fault: str | None) -> list[Check]:
    """Every check of this world, in order."""
    where = _processes(backend)
    results = []
    trained: list[TrainState] = []

    def training() -> str:
        detail, state = check_training(backend, fault)
        trained.append(state)
        return detail

    results.append(_attempt(f"{where}: shard_data + replicate + accumulate({WINDOW}) + clip({MAX_NORM}) equals "
                            "1 process on the whole batch", training))
    results.append(_attempt(f"{where}: checkpoint save/load round trip", lambda: check_checkpoint(
        backend, trained[0] if trained else _train(backend, _state(), _program(None)),
        out / f"checkpoint-{backend.world_size}", fault)))
    results.append(_attempt(f"{where}: gather of unequal sizes", lambda: check_gather(backend)))
    if backend.world_size > 1 and backend.name != "xla":
        n = backend.world_size
        names = {"shard_params": "shard_data + shard_params",
                 "tensor_parallel": f"tensor_parallel(size={n})",
                 "pipeline": f"pipeline(size={n}, schedule='gpipe')",
                 "deepspeed": "shard_data + deepspeed(ZeRO-1)"}
        for kind, name in names.items():
            if kind == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
                continue  # `accelfn test` prints why it skips it
            results.append(_attempt(f"{where}: {name} + accumulate({WINDOW}) + clip({MAX_NORM}) equals 1 process "
                                    f"on the whole batch", lambda: check_parallel(backend, kind)))  # noqa: B023
    if backend.world_size == 1:
        for each in precision_backends(backend):
            for precision in each.supported_precisions:
                name = f"{each.name} {precision}: training lowers the loss"
                why = float8.why_unsupported(each.device) if parse_policy(precision).float8 is not None else None
                if why is not None:
                    results.append((name, "SKIP", why))
                    continue
                results.append(_attempt(name, lambda: check_precision(each, precision)))  # noqa: B023 (called at once)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m accelfn.cli._selftest_worker")
    parser.add_argument("out", type=Path)
    parser.add_argument("--fault", choices=FAULTS)
    args = parser.parse_args(argv)
    backend = auto()
    mine = checks(backend, args.out, args.fault)
    everyone = backend.gather_object(mine)
    if backend.is_main_process:
        merged = []
        for i, (name, status, detail) in enumerate(mine):
            failed = [(r, ranks[i]) for r, ranks in enumerate(everyone) if ranks[i][1] == "FAIL"]
            if failed:
                rank, (_, _, why) = failed[0]
                status, detail = "FAIL", why if backend.world_size == 1 else f"rank {rank}: {why}"
            merged.append({"name": name, "status": status, "detail": detail})
        (args.out / f"results-{backend.world_size}.json").write_bytes(orjson.dumps(merged))
    backend.barrier()
    return 0


if __name__ == "__main__":
    status = main()
    gc.freeze()  # the collections at exit skip torch's objects (as in ``commands.console``)
    raise SystemExit(status)
