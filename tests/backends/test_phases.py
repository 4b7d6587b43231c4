"""``prepare`` checks every model phase, then applies them in one fixed order (backends/_phases.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import accelfn as af
from accelfn.backends import _phases
from tests.helpers import programs as P

#: the phases in the order prepare applies them (docs/04-backends-and-launching.md lists them)
ORDER = ["deepspeed", "place", "pipeline", "tensor_parallel", "context_parallel", "fp8", "checkpoint_activations",
         "shard_params", "materialize", "fp8 scales", "invariant", "tolerate_faults", "replicate", "compile"]


def test_the_phase_table_lists_the_phases_in_their_order() -> None:
    """One row per phase, in the documented order: an engine, placement, the pipeline's cut,
    tensor parallelism, context parallelism, fp8's conversion, activation checkpointing, sharding,
    materialization, fp8's sharded scales, invariant's replicas, the replica groups of
    tolerate_faults, DDP, compilation."""
    assert [row.name for row in _phases.PHASES] == ORDER


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    applied: list[str] = []
    for row in _phases.PHASES:
        original = row.apply

        def apply(self: Any, prep: Any, _original: Any = original) -> None:
            applied.append(self.name)
            _original(self, prep)

        monkeypatch.setattr(row, "apply", apply)
    return applied


def test_prepare_applies_the_acting_phases_in_the_table_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """A program with shard_params, invariant and compile on one process applies place, then
    shard_params, then invariant, then compile (the phases of other transforms do not act), and
    each transform's state entry is there."""
    applied = _recording(monkeypatch)
    state = P.make_state()
    step = af.compose(af.compile(backend="eager"), af.invariant(), af.shard_params())(af.train_step(P.mse))
    af.backends.CPU(af.backends.LaunchEnv()).prepare(step, state)
    assert applied == ["place", "shard_params", "invariant", "compile"]


def test_a_refused_phase_leaves_the_model_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every phase is checked before any applies: a tensor-parallel plan whose pattern matches no
    module is refused after placement would have cast the model to bf16, and the model is still
    fp32, its parameters the same objects, its optimizer untouched; nothing was applied."""
    applied = _recording(monkeypatch)
    state = P.make_state()
    model = state.model
    params = list(model.parameters())
    step = af.compose(af.with_precision("bf16-true"), af.tensor_parallel({"nowhere": "colwise"}, size=1))(
        af.train_step(P.mse))
    with pytest.raises(ValueError, match="'nowhere' matches no module"):
        af.backends.CPU(af.backends.LaunchEnv()).prepare(step, state)
    assert applied == []
    assert list(model.parameters()) == params and all(p.dtype == torch.float32 for p in params)
    assert state.optimizer.param_groups[0]["params"] == params

