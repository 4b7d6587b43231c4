"""Worker for tests/cli/test_deepspeed_launch.py: a plain data-parallel script that knows
nothing of DeepSpeed (shard_data + replicate, AdamW, no accumulate), run by
``accelfn launch --deepspeed CFG``.

Usage: accelfn launch --nproc-per-node 2 --deepspeed ds.json deepspeed_script.py OUT EPOCHS
Rank 0 writes OUT (JSON): the whole parameters, the step count and the engine's type.
"""

from __future__ import annotations

import json
import sys

import accelfn as af
from tests.helpers import deepspeed_programs as D
from tests.helpers import programs as P
from tests.workers.deepspeed_checks import full_parameters

out, epochs = sys.argv[1], int(sys.argv[2])
model = D.make_model()
state = af.TrainState.create(model, D.make_optimizer(model))
backend = af.backends.auto()
step = af.compose(af.shard_data(), af.replicate())(af.train_step(P.mse))
state = af.run(step, state, D.loader(), backend=backend, epochs=epochs, progress=False)
params = full_parameters(state.model)
if backend.is_main_process:
    engine = getattr(state.model, "_accelfn_deepspeed_engine", None)
    with open(out, "w") as f:
        json.dump({"params": D.to_json(params), "step": state.step, "engine": type(engine).__name__,
                   "stage": engine.zero_optimization_stage() if engine is not None else None}, f)
