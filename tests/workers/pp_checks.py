"""Scenarios of tests/distributed/test_pipeline.py, run by the worker pool.

``train``: the residual MLP of ``tests.helpers.pipeline`` cut into 2 stages, trained under
GPipe and under 1F1B with ``accumulate(4)`` and ``clip(1.0)`` (on 4 processes also
``replicate()`` over the data dimension), each rank's own parameters and AdamW moments
written to ``OUT/{schedule}-rank{r}.safetensors`` with ``evaluated``, af.evaluate's outputs
of the trained state over the data in order, the logged metrics returned.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import accelfn as af
from tests.helpers import pipeline as H
from tests.helpers import programs as P
from tests.helpers.tracking import Recorder


def _tensors(state: af.TrainState) -> dict[str, torch.Tensor]:
    """This rank's parameters and AdamW moments by name."""
    out = {f"param.{k}": v.detach().clone().contiguous() for k, v in state.model.named_parameters()}
    names = {id(p): n for n, p in state.model.named_parameters()}
    for p, moments in state.optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}.{names[id(p)]}"] = moments[key].detach().clone().contiguous()
    return out


def train(out: str, schedules: list[str]) -> dict[str, Any]:
    """Each schedule's run from the same initial model; its metrics and this rank's stage;
    the 1F1B run's state saved to ``OUT/ckpt`` and resumed from it by a fresh pipelined state
    (the run already over), its tensors to ``OUT/reloaded-rank{r}.safetensors``."""
    backend = af.backends.auto()
    data_world = backend.world_size // 2
    result: dict[str, Any] = {}
    for schedule in schedules:
        recorder = Recorder()
        state = af.run(H.step(schedule, data_world), H.make_state(), H.loader(), backend=backend, epochs=H.EPOCHS,
                       progress=False, trackers=[recorder])
        result[schedule] = {
            "step": state.step,
            "grad_norms": [float(p["grad_norm"]) for _, p in recorder.points],
            "losses": [float(p["loss"]) for _, p in recorder.points],
            "lrs": [float(p["lr"]) for _, p in recorder.points],
            "lr_now": state.optimizer.param_groups[0]["lr"],
            "names": [n for n, _ in state.model.named_parameters()],
        }
        evaluated = af.evaluate(lambda m, b: m(b[0]), state, torch.utils.data.DataLoader(H.data(), batch_size=5),
                                backend=backend)
        save_file(_tensors(state) | {"evaluated": evaluated.contiguous()},
                  Path(out) / f"{schedule}-rank{backend.rank}.safetensors")
        if schedule == "1f1b":  # a checkpoint each rank writes its stage of (replicas: once), read back
            af.save(state, Path(out) / "ckpt", backend=backend)
            reloaded = af.run(H.step(schedule, data_world), H.make_state(), H.loader(), backend=backend,
                              epochs=H.EPOCHS, resume=Path(out) / "ckpt", progress=False)
            result["reloaded_step"] = reloaded.step
            save_file(_tensors(reloaded), Path(out) / f"reloaded-rank{backend.rank}.safetensors")
    recorder = Recorder()  # an af.Loss: ragged item counts, on 4 processes other ones on each replica
    program = af.compose(af.shard_data(seed=P.SHARD_SEED), af.pipeline(H.SPLIT, size=2),
                         *([af.replicate()] if data_world > 1 else []), af.accumulate(H.ACCUMULATE),
                         af.clip(H.CLIP))(af.train_step(af.output_loss(H.items)))
    state = af.run(program, H.make_state(), H.loader(), backend=backend, epochs=1, progress=False, trackers=[recorder])
    result["items"] = {"losses": [float(p["loss"]) for _, p in recorder.points],
                       "maes": [float(p["mae"]) for _, p in recorder.points]}
    save_file(_tensors(state), Path(out) / f"items-rank{backend.rank}.safetensors")
    return result


def checkpoints(out: str, stop: int = 7) -> dict[str, Any]:
    """2 stages, 1F1B: a whole run of 3 epochs; a run stopped after ``stop`` updates (mid-epoch)
    with a checkpoint; a fresh state resumed from it; af.save_model of the whole run (one
    file, and files of at most 1 KiB). This rank's tensors of each to
    ``OUT/ckpt-rank{r}.safetensors``; af.evaluate of the whole run to
    ``OUT/evaluated-rank{r}.safetensors``; runs with an af.Loss and with (loss, metrics)
    (``OUT/{items,mean_metrics}-rank{r}.safetensors``, their logged points returned)."""
    backend = af.backends.auto()
    step = H.step("1f1b", backend.world_size // 2)
    whole = af.run(step, H.make_state(), H.loader(), backend=backend, epochs=H.EPOCHS, progress=False)
    keep = af.Checkpoints(Path(out) / "ckpt", every_steps=stop)
    stopped = af.run(step, H.make_state(), H.loader(), backend=backend, epochs=H.EPOCHS, max_steps=stop,
                     checkpoints=keep, progress=False)
    torch.manual_seed(123)  # another start: the checkpoint decides
    resumed = af.run(step, H.make_state(), H.loader(), backend=backend, epochs=H.EPOCHS, checkpoints=keep,
                     resume="auto", progress=False)
    af.save_model(whole, Path(out) / "export", backend=backend)
    af.save_model(whole, Path(out) / "export-files", backend=backend, max_shard_size=1024)  # several files
    tensors = {f"{what}.{k}": v for what, state in (("whole", whole), ("stopped", stopped), ("resumed", resumed))
               for k, v in _tensors(state).items()}
    save_file(tensors, Path(out) / f"ckpt-rank{backend.rank}.safetensors")
    ordered = torch.utils.data.DataLoader(H.data(), batch_size=5)  # 14 batches of 5 and one of 2
    outputs = af.evaluate(lambda m, b: {"out": m(b[0]), "error": (m(b[0]) - b[1]).abs()}, whole, ordered,
                          backend=backend)
    save_file({k: v.contiguous() for k, v in outputs.items()}, Path(out) / f"evaluated-rank{backend.rank}.safetensors")
    calls = []

    def poisoned(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # window 1's losses are NaN
        calls.append(1)
        return H.loss(output, targets) * (float("nan") if 5 <= len(calls) <= 8 else 1.0)

    skipping = af.compose(af.shard_data(seed=P.SHARD_SEED), af.pipeline(H.SPLIT, size=2), af.accumulate(H.ACCUMULATE),
                          af.clip(H.CLIP), af.skip_nonfinite())(af.train_step(af.output_loss(poisoned)))
    skipped = af.run(skipping, H.make_state(), H.loader(), backend=backend, epochs=1, progress=False)
    save_file(_tensors(skipped), Path(out) / f"skip-rank{backend.rank}.safetensors")
    logged = {}
    for name, loss_fn in (("items", H.items), ("mean_metrics", H.mean_with_metrics)):  # af.Loss; (loss, metrics)
        recorder = Recorder()
        recorder.every_rank = True  # type: ignore[attr-defined]  # the loop logs to it on every rank
        program = af.compose(af.shard_data(seed=P.SHARD_SEED), af.pipeline(H.SPLIT, size=2),
                             af.accumulate(H.ACCUMULATE), af.clip(H.CLIP))(af.train_step(af.output_loss(loss_fn)))
        trained = af.run(program, H.make_state(), H.loader(), backend=backend, epochs=1, progress=False,
                         trackers=[recorder])
        save_file(_tensors(trained), Path(out) / f"{name}-rank{backend.rank}.safetensors")
        logged[name] = {"step": trained.step, "losses": [float(p["loss"]) for _, p in recorder.points],
                        "maes": [float(p["mae"]) for _, p in recorder.points]}
    return {"steps": [whole.step, stopped.step, resumed.step], "stopped_epoch_micro_step": stopped.epoch_micro_step,
            "lr": [whole.optimizer.param_groups[0]["lr"], resumed.optimizer.param_groups[0]["lr"]],
            "logged": logged,
            "skips": [skipped.step, skipped.transforms_state["skips"].num_skipped]}


def fp16(out: str) -> dict[str, Any]:
    """2 stages, 1F1B, with_precision("fp16") (its loss scale 2**16 at first: the first
    updates overflow and are skipped), accumulate(4), clip(1.0), one epoch; this rank's
    tensors to ``OUT/fp16-rank{r}.safetensors``, the logged loss scales and grad norms returned."""
    backend = af.backends.auto()
    step = af.compose(af.shard_data(seed=P.SHARD_SEED), af.pipeline(H.SPLIT, size=2), af.accumulate(H.ACCUMULATE),
                      af.clip(H.CLIP), af.with_precision("fp16"))(af.train_step(af.output_loss(H.loss)))
    recorder = Recorder()
    state = af.run(step, H.make_state(), H.loader(), backend=backend, epochs=2, progress=False, trackers=[recorder])
    save_file(_tensors(state), Path(out) / f"fp16-rank{backend.rank}.safetensors")
    return {"step": state.step, "scales": [float(p["loss_scale"]) for _, p in recorder.points],
            "skipped": [int(p["skipped"]) for _, p in recorder.points],
            "grad_norms": [float(p["grad_norm"]) for _, p in recorder.points if "grad_norm" in p]}


def misuse() -> dict[str, Any]:
    """af.run of pipelines whose split points cannot cut ``H.Net`` (one that is no module, one at
    the first module the forward runs, three out of the forward's order under interleaved 1F1B):
    what each raised on this rank and how many updates it applied."""
    backend = af.backends.auto()
    result: dict[str, Any] = {}
    for variant, split, schedule in (("nosuch", ["blocks.7"], "gpipe"), ("first", ["inp"], "gpipe"),
                                     ("order", ["blocks.3", "blocks.1", "blocks.2"], "interleaved_1f1b")):
        updates: list[int] = []
        step = af.compose(af.shard_data(), af.pipeline(split, size=2, schedule=schedule))(
            af.train_step(af.output_loss(H.loss)))
        try:
            af.run(step, H.make_state(), H.loader(), backend=backend, max_steps=2, progress=False,
                   hooks=[af.Hook(lambda s, b: updates.append(s.step), every_steps=1)])
            raised = None
        except Exception as e:  # noqa: BLE001  # what it raised is the result
            raised = f"{type(e).__name__}: {e}"
        result[variant] = {"raised": raised, "updates": len(updates)}
    return result
