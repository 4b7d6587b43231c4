"""Worker for tests/backends/test_deepspeed.py: one 2-process scenario runs every training check.

``train_all`` trains each case of ``tests.helpers.deepspeed_programs.CASES`` (ZeRO stages 1,
2, 3 and 3 with CPU offload, with and without ``accumulate(2)`` + ``clip(1.0)``) and one bf16
run, and returns (as JSON) each case's full parameters, logged metrics and counters;
``checkpoints`` saves and resumes at each stage.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import accelfn as af
from tests.helpers import deepspeed_programs as D
from tests.helpers import programs as P


class Record:
    """A tracker that keeps every logged point (the loop logs on the main process)."""

    def __init__(self) -> None:
        self.points: list[dict[str, float]] = []

    def log(self, metrics: Any, step: int) -> None:
        self.points.append({k: float(v) for k, v in metrics.items()})

    def close(self) -> None:
        pass


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole parameters on every rank (gathered from the partitions at stage 3)."""
    import deepspeed

    params = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: p.detach().float().clone() for name, p in params.items()}


def _run(zero: dict[str, Any], n: int, clip: float | None, *, bf16: bool = False,
         cpu_adam: bool = False) -> dict[str, Any]:
    model = D.make_model()
    if cpu_adam:  # DeepSpeed's fused CPU AdamW (a C++ op, JIT-built on first use), torch AdamW's defaults
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(model.parameters(), lr=D.LR, weight_decay=0.01, adamw_mode=True)
    else:
        optimizer = D.make_optimizer(model)
    state = af.TrainState.create(model, optimizer)
    transforms: list[Any] = [af.shard_data(), af.deepspeed({"zero_optimization": zero})]
    if n > 1:
        transforms.append(af.accumulate(n))
    if clip is not None:
        transforms.append(af.clip(clip))
    if bf16:
        transforms.append(af.with_precision("bf16"))
    record = Record()
    state = af.run(af.compose(*transforms)(af.train_step(P.mse)), state, D.loader(), backend=af.backends.CPU(),
                   epochs=D.epochs(n), progress=False, trackers=[record], log_every=1)
    return {"params": D.to_json(full_parameters(state.model)), "points": record.points, "step": state.step,
            "micro_step": state.micro_step}


def bf16_by_hand(zero: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed driven by hand (no accelfn in the loop) with the config ``af.deepspeed`` gives
    the engine under ``with_precision("bf16")``: ``D.UPDATES`` updates of this rank's 3 samples
    (r, r + 2, r + 4 of each consecutive 6, as shard_data reads them), inputs cast to bf16."""
    import deepspeed
    import torch.distributed as dist
    import torch.nn.functional as F

    from accelfn.transforms.deepspeed import engine_config

    config = engine_config(af.deepspeed({"zero_optimization": zero}), num_micro_batches=1, clip=None,
                           precision="bf16", micro_batch_size=1, world_size=D.WORLD_SIZE)
    model = D.make_model()
    engine, *_ = deepspeed.initialize(model=model, optimizer=D.make_optimizer(model), config=config)
    x, y = P.regression_data(D.NUM_SAMPLES).tensors
    size = D.WORLD_SIZE * D.PER_RANK_BATCH
    for update in range(D.UPDATES):
        rows = slice(update * size + dist.get_rank(), (update + 1) * size, D.WORLD_SIZE)
        loss = F.mse_loss(engine(x[rows].bfloat16()), y[rows].bfloat16())
        engine.backward(loss)
        engine.step()
    return D.to_json(full_parameters(model))


def train_all() -> dict[str, Any]:
    """Every case of ``D.CASES``, then ZeRO-2 under ``with_precision("bf16")`` (no accumulation)
    through accelfn and by hand."""
    results = {name: _run(D.ZERO[zero], n, clip) for name, (zero, n, clip) in D.CASES.items()}
    results["s3_offload_cpu_adam_acc2_clip"] = _run(D.ZERO["s3_offload"], 2, D.CLIP, cpu_adam=True)
    results["s2_bf16"] = _run(D.ZERO["s2"], 1, None, bf16=True)
    results["s2_bf16"]["by_hand"] = bf16_by_hand(D.ZERO["s2"])
    return results


def _program(zero: dict[str, Any], *precision: str) -> af.Step:
    return af.compose(af.shard_data(), af.deepspeed({"zero_optimization": zero}), af.accumulate(2),
                      af.clip(D.CLIP), *map(af.with_precision, precision))(af.train_step(P.mse))


def _fresh() -> af.TrainState:
    model = D.make_model()
    return af.TrainState.create(model, D.make_optimizer(model))


def _magic(path: Path) -> str:
    with path.open("rb") as f:
        return f.read(2).hex()


def checkpoints() -> dict[str, Any]:
    """For ZeRO stages 1, 2 and 3 (accumulate(2) + clip), and 3 in bf16 (its optimizer states
    fp32 masters' while the parameters are bf16 partitions): 2 epochs uninterrupted, and 3 updates
    (mid-epoch), ``af.save``, then a fresh state resumed from it with ``pickle.load`` and
    ``torch.load`` made to raise; every file's first bytes; at stage 3 also ``af.save_model``
    and the parameters at the save (for the unsharded load in the test process)."""
    backend = af.backends.CPU()
    results: dict[str, Any] = {}
    for name in ("s1", "s2", "s3", "s3_bf16"):
        zero, precision = D.ZERO[name.removesuffix("_bf16")], ("bf16",) if name.endswith("_bf16") else ()
        program = _program(zero, *precision)
        whole = af.run(program, _fresh(), D.loader(), backend=backend, epochs=2, progress=False)
        part = af.run(program, _fresh(), D.loader(), backend=backend, epochs=2, max_steps=3, progress=False)
        path = af.save(part, f"ckpt_{name}", backend=backend)
        saved = D.to_json(full_parameters(part.model))
        if name == "s3":
            af.save_model(part, "export_s3", backend=backend)
        with _no_unpickling():
            resumed = af.run(program, _fresh(), D.loader(), backend=backend, epochs=2, resume=path, progress=False)
        results[name] = {
            "whole": D.to_json(full_parameters(whole.model)), "resumed": D.to_json(full_parameters(resumed.model)),
            "steps": [part.step, resumed.step], "saved": saved, "path": str(path.resolve()),
            "files": {str(p.relative_to(path)): _magic(p) for p in sorted(path.rglob("*")) if p.is_file()},
        }
    return results


@contextlib.contextmanager
def _no_unpickling() -> Iterator[None]:
    """``pickle.load`` and ``torch.load`` raise while in this block."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a checkpoint load unpickled")

    saved = pickle.load, torch.load
    pickle.load, torch.load = refuse, refuse
    try:
        yield
    finally:
        pickle.load, torch.load = saved


def _sgd_warmup_state() -> af.TrainState:
    model = D.make_model()
    optimizer = D.make_sgd(model)
    return af.TrainState.create(model, optimizer, scheduler=D.make_warmup(optimizer))


def sgd_warmup() -> dict[str, Any]:
    """ZeRO-2 with SGD (momentum, weight decay: not on DeepSpeed's tested list) and DeepSpeed's
    WarmupLR as the TrainState's scheduler: the whole run (parameters, lr per update), and 3
    updates + ``af.save`` + a resume from it (the lr of each resumed update, the parameters)."""
    backend = af.backends.CPU()
    program = af.compose(af.shard_data(), af.deepspeed({"zero_optimization": D.ZERO["s2"]}))(af.train_step(P.mse))
    whole_points, resumed_points = Record(), Record()
    whole = af.run(program, _sgd_warmup_state(), D.loader(), backend=backend, epochs=D.epochs(1), progress=False,
                   trackers=[whole_points], log_every=1)
    part = af.run(program, _sgd_warmup_state(), D.loader(), backend=backend, epochs=D.epochs(1), max_steps=3,
                  progress=False)
    path = af.save(part, "ckpt_sgd_warmup", backend=backend)
    with _no_unpickling():
        resumed = af.run(program, _sgd_warmup_state(), D.loader(), backend=backend, epochs=D.epochs(1), resume=path,
                         progress=False, trackers=[resumed_points], log_every=1)
    return {"params": D.to_json(full_parameters(whole.model)), "lrs": [p["lr"] for p in whole_points.points],
            "resumed": D.to_json(full_parameters(resumed.model)),
            "resumed_lrs": [p["lr"] for p in resumed_points.points], "steps": [part.step, resumed.step]}


def all_checks() -> dict[str, Any]:
    """``train_all``, ``checkpoints`` and ``sgd_warmup`` in one scenario: DeepSpeed keeps its
    process groups for the life of the process, so a second scenario (in a new default group)
    cannot use it."""
    return {"train": train_all(), "checkpoints": checkpoints(), "sgd_warmup": sgd_warmup()}
