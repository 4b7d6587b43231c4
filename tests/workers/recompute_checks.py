"""Scenarios of tests/distributed/test_recompute.py, run on every rank by the worker pool.

``compositions``: for each composition of ``checkpoint_activations`` with another transform
(``CASES``), the same program trained twice from the same state and RNG, with and without
recomputation, on the model of ``tests.helpers.recompute`` (dropout in every block); returns,
per case, whether this rank's parameters came out bitwise equal, which blocks recomputed,
and how often the blocks' first layers ran. ``hybrid``: the same under
``shard_params(shard_size=2)`` (HSDP), for a world of 4.
"""

from __future__ import annotations

from typing import Any

import torch

import accelfn as af
from tests.helpers import recompute as R

SEED = 3
#: case -> (the transforms besides shard_data and checkpoint_activations, the loss, checkpoint_activations'
#: arguments, whether the program runs eagerly: hooks on its blocks' layers count their forwards)
CASES: dict[str, tuple[tuple[Any, ...], Any, dict[str, Any], bool]] = {
    "replicate_loss": ((af.replicate(), af.accumulate(2), af.clip(1.0)), R.summed, {}, True),
    "shard_params": ((af.shard_params(),), R.loss, {}, True),
    "shard_params_ops": ((af.shard_params(), af.accumulate(2)), R.loss, {"policy": "ops"}, True),
    "tensor_parallel": ((af.tensor_parallel(R.TP_PLAN, size=2),), R.loss, {}, True),
    "tensor_parallel_ops": ((af.tensor_parallel(R.TP_PLAN, size=2),), R.loss, {"policy": "ops"}, True),
    "pipeline": ((af.pipeline(["blocks.2"], size=2), af.accumulate(2)), R.pipelined, {}, True),
    "compile": ((af.replicate(), af.compile(backend="aot_eager")), R.loss, {}, False),
    "regional_compile_shard_params": ((af.shard_params(), af.compile(backend="aot_eager", regions=True)), R.loss,
                                      {}, False),
    "invariant": ((af.invariant(), af.replicate()), R.loss, {}, True),
    "fp16": ((af.replicate(), af.with_precision("fp16")), R.loss, {}, True),
    "bf16": ((af.replicate(), af.with_precision("bf16")), R.loss, {"every": 2}, True),
}


def _train(transforms: tuple[Any, ...], loss: Any, recompute: dict[str, Any] | None, eager: bool,
           backend: af.backends.Backend) -> tuple[af.TrainState, int | None]:
    extra = (af.checkpoint_activations(**recompute),) if recompute is not None else ()
    step = af.compose(af.shard_data(seed=SEED), *transforms, *extra)(af.train_step(loss))
    state = R.make_state()
    calls = R.Calls(state.model) if eager else None  # hooks TorchDynamo would have to run too
    torch.manual_seed(SEED + backend.rank)  # the same dropout draws in both runs, other ones on each rank
    state = af.run(step, state, R.loader(), backend=backend, epochs=1, progress=False)
    return state, None if calls is None else calls.count


def _compare(name: str, backend: af.backends.Backend) -> dict[str, Any]:
    transforms, loss, recompute, eager = CASES[name]
    plain, plain_calls = _train(transforms, loss, None, eager, backend)
    checkpointed, calls = _train(transforms, loss, recompute, eager, backend)
    plain_params = dict(plain.model.named_parameters())
    differ = [n for n, p in checkpointed.model.named_parameters()
              if not torch.equal(R.local(p), R.local(plain_params[n]))]
    return {
        "step": checkpointed.step, "plain_step": plain.step,
        "names_equal": list(checkpointed.model.state_dict()) == list(plain.model.state_dict()),
        "num_params": len(plain_params), "differ": differ,
        "recomputed": R.recomputed_blocks(checkpointed.model), "plain_recomputed": R.recomputed_blocks(plain.model),
        "calls": calls, "plain_calls": plain_calls,
    }


def compositions(names: list[str] | None = None) -> dict[str, Any]:
    """Every case of ``CASES`` (or those named), with and without recomputation, on this rank."""
    backend = af.backends.auto()
    return {name: _compare(name, backend) for name in (names or list(CASES))}


def hybrid() -> dict[str, Any]:
    """``shard_params(shard_size=2)`` on 4 ranks (2 copies sharded over 2), with and without
    recomputation, on this rank."""
    CASES["hybrid"] = ((af.shard_params(shard_size=2),), R.loss, {}, True)
    return compositions(["hybrid"])
