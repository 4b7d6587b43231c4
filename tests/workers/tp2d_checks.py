"""Worker for tests/distributed/test_tp2d.py: 2-D FSDP2 x TP on 4 processes.

Usage: accelfn launch --nproc-per-node 4 tp2d_checks.py --out DIR

Runs ``tp_checks.checkpoints(DIR, shard=True)`` (the byte LM under shard_data +
tensor_parallel(size=2) + shard_params() + accumulate(2) + clip(0.3): whole, stopped after 2
updates with a checkpoint, resumed, exported, evaluated) and a tied transformers Llama under
``tensor_parallel("auto", size=2) + shard_params()`` for 2 updates, recording every warning
they give, and writes DIR/rank{r}.json.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch

import accelfn as af
from tests.workers import tp_checks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = tp_checks.checkpoints(str(out), shard=True, max_norm=tp_checks.T.CLIP_2D, stop=2)
        model = tp_checks.T.tied_model("llama")
        step = af.compose(af.shard_data(), af.tensor_parallel("auto", size=2), af.shard_params())(
            af.train_step(tp_checks.T.tied_loss("llama")))
        llama = af.run(step, af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-3)),
                       tp_checks.T.tied_loader(), backend=af.backends.auto(), max_steps=2, progress=False)
    result["llama_step"] = llama.step
    result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    try:  # the world of 4 cannot be split into tensor-parallel groups of 3
        af.backends.auto().prepare(af.tensor_parallel({"blocks.*.mlp.0": "colwise"}, size=3)(
            af.train_step(tp_checks.T.loss("lm"))), tp_checks.T.make_state("lm"))
    except ValueError as e:
        result["size_error"] = str(e)
    (out / f"rank{af.backends.auto().rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
