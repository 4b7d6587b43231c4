"""Worker for tests/distributed/test_hybrid_sharding.py: hybrid sharding on 4 processes.

Usage: accelfn launch --nproc-per-node 4 hybrid_checks.py --out DIR

``shard_params(shard_size=2)`` (2 copies of the model, each sharded over 2 ranks) with
SGD, ``accumulate(2)`` and ``clip(1.0)``, batch 3 per rank, 2 epochs: run whole; run for 3
updates saving a checkpoint to ``DIR/checkpoints`` and resumed from it by a fresh state.
Then: preparing the trained state with another ``shard_params(...)`` (the error), and a run with
``reshard_after_forward=False`` followed by ``af.evaluate`` and ``af.save`` (what the parameters
are after evaluate, and the saved files).
Each rank writes DIR/rank{r}.json (the logged grad norms, the mesh, the parameters it holds)
and DIR/rank{r}.safetensors (``whole.*``: gathered parameters of the whole run;
``stopped.*``: after 3 updates; ``resumed.*``: of the resumed run).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch.utils.data import DataLoader

import accelfn as af
from tests.helpers import programs as P
from tests.helpers import sharded as S
from tests.helpers.tracking import Recorder

PROGRAM = S.train_program(af.shard_params(shard_size=2))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    backend = af.backends.auto()
    recorder = Recorder()
    whole = af.run(PROGRAM, S.make_state("sgd"), S.loader(P.PER_RANK_BATCH), backend=backend, epochs=S.EPOCHS,
                   progress=False, trackers=[recorder])
    params = [p for group in whole.optimizer.param_groups for p in group["params"]]
    result: dict[str, Any] = {
        "grad_norms": [point["grad_norm"] for _, point in recorder.points],
        "mesh": list(params[0].device_mesh.shape),
        "local_numel": sum(p.to_local().numel() for p in params),
        "full_numel": sum(p.numel() for p in params),
    }
    checkpoints = af.Checkpoints(out / "checkpoints", every_steps=3)
    stopped = af.run(PROGRAM, S.make_state("sgd"), S.loader(P.PER_RANK_BATCH), backend=backend, epochs=S.EPOCHS,
                     max_steps=3, checkpoints=checkpoints, progress=False)
    tensors = S.full_parameters(whole.model, "whole.") | S.full_parameters(stopped.model, "stopped.")
    resumed = af.run(PROGRAM, S.make_state("sgd", seed=1), S.loader(P.PER_RANK_BATCH), backend=backend,
                     epochs=S.EPOCHS, checkpoints=checkpoints, resume="auto", progress=False)
    tensors |= S.full_parameters(resumed.model, "resumed.")
    result["resumed_step"] = resumed.step
    try:
        backend.prepare(S.train_program(af.shard_params()), whole)
    except ValueError as e:
        result["reshard_error"] = str(e)
    kept = S.train_program(af.shard_params(shard_size=2, reshard_after_forward=False))
    kept_state = af.run(kept, S.make_state("adamw"), S.loader(P.PER_RANK_BATCH), backend=backend, epochs=1,
                        progress=False)
    outputs = af.evaluate(P.eval_outputs, kept_state, DataLoader(P.IndexDataset(9), batch_size=2), backend=backend)
    model_params = list(kept_state.model.parameters())
    result["after_evaluate"] = {
        "param_types": sorted({type(p).__name__ for p in model_params}),
        "local_numel": sum(p.to_local().numel() for p in model_params),
        "optimizer_params_are_model_params": [id(p) for p in model_params] == [
            id(p) for group in kept_state.optimizer.param_groups for p in group["params"]],
        "evaluated": outputs["prediction"].shape[0],
    }
    af.save(kept_state, out / "after_evaluate")
    (out / f"rank{backend.rank}.json").write_text(json.dumps(result))
    save_file(tensors, out / f"rank{backend.rank}.safetensors")


if __name__ == "__main__":
    main()
