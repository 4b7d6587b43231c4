"""Worker for tests/distributed/test_fp8.py: one launch of 2 processes runs every check.

Usage: accelfn launch --nproc-per-node 2 fp8_checks.py --out DIR
Under shard_params on 2 gloo processes: 50 updates in bf16, in fp8 with float8 all-gathers
(loss curves recorded), the fp8 run again stopped at update 25, saved, loaded into a fresh
state and resumed to 50, and the fp8 model exported with save_model. Each rank writes
DIR/rank{r}.json and DIR/rank{r}.safetensors (gathered parameters); rank 0 exports to DIR/export.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.distributed.fsdp._fully_shard import _fsdp_collectives

import accelfn as af
from tests.helpers import fp8 as H
from tests.helpers import sharded as S

GATHERED: set[str] = set()


def _spy_on_all_gather_inputs() -> None:
    """Records the dtypes FSDP2 all-gathers (its private ``_get_param_all_gather_inputs``)."""
    inner = _fsdp_collectives._get_param_all_gather_inputs

    def spy(fsdp_params: Any) -> Any:
        inputs = inner(fsdp_params)
        GATHERED.update(str(t.dtype).removeprefix("torch.") for ts in inputs for t in ts)
        return inputs

    _fsdp_collectives._get_param_all_gather_inputs = spy


class Record:
    """A tracker that keeps each logged loss (the loop logs on the main process)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def log(self, metrics: Any, step: int) -> None:
        self.losses.append(float(metrics["loss"]))

    def close(self) -> None:
        pass


def train(backend: af.backends.Backend, precision: af.Transform, *, max_steps: int | None = None,
          state: af.TrainState | None = None) -> tuple[af.TrainState, list[float]]:
    record = Record()
    state = af.run(H.program(precision), state or H.make_state(), H.loader(), backend=backend, epochs=1,
                   max_steps=max_steps, progress=False, trackers=[record])
    return state, record.losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    backend = af.backends.auto()
    results: dict[str, Any] = {"world_size": backend.world_size}
    tensors: dict[str, torch.Tensor] = {}
    _spy_on_all_gather_inputs()

    state, results["bf16_losses"] = train(backend, af.with_precision("bf16"))
    results["bf16_gathered"] = sorted(GATHERED)
    GATHERED.clear()

    state, results["fp8_losses"] = train(backend, H.fp8(float8_all_gather=True))
    results["fp8_gathered"] = sorted(GATHERED)
    results["fp8_step"] = state.step
    results["fp8_layers"] = {n: type(m).__name__ for n, m in state.model.named_modules() if "Linear" in type(m).__name__}
    results["fp8_local_weight_types"] = {n: type(p.to_local()).__name__ for n, p in state.model.named_parameters()}
    results["fp8_param_dtypes"] = sorted({str(p.dtype) for p in state.model.parameters()})
    tensors.update(S.full_parameters(state.model, "fp8."))
    af.save_model(state, args.out / "export")

    half, _ = train(backend, H.fp8(float8_all_gather=True), max_steps=H.RESUME_AT)
    af.save(half, args.out / "half")
    resumed = af.load(args.out / "half", into=H.make_state(seed=99))  # a fresh state: other weights
    results["resumed_from"] = resumed.step
    resumed, results["resumed_losses"] = train(backend, H.fp8(float8_all_gather=True), state=resumed)
    results["resumed_step"] = resumed.step
    tensors.update(S.full_parameters(resumed.model, "resumed."))
    results["resumed_optimizer_equal"] = all(
        torch.equal(_full(a), _full(b))
        for sa, sb in zip(state.optimizer.state.values(), resumed.optimizer.state.values())
        for a, b in zip(sa.values(), sb.values()))

    # the same checkpoint loaded into the trained state (its float8 scales computed from other weights)
    again = af.load(args.out / "half", into=state)
    again, results["reloaded_losses"] = train(backend, H.fp8(float8_all_gather=True), state=again)
    tensors.update(S.full_parameters(again.model, "reloaded."))

    (args.out / f"rank{backend.rank}.json").write_text(json.dumps(results))
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, args.out / f"rank{backend.rank}.safetensors")


def _full(t: Any) -> torch.Tensor:
    t = af_plain(t)
    return t.full_tensor() if hasattr(t, "full_tensor") else torch.as_tensor(t)


def af_plain(t: Any) -> Any:
    from accelfn.distributed import plain

    return plain(t) if isinstance(t, torch.Tensor) else t


if __name__ == "__main__":
    main()
