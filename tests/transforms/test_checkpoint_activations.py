"""``af.checkpoint_activations`` on one process: the record's checks, which blocks it picks,
training bitwise as without it (with dropout), a second forward only in training, and names:
the state dict, checkpoints and exports are the model's own, with or without it."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from safetensors import safe_open

import accelfn as af
from accelfn.distributed import pipeline as pipeline_module
from accelfn.distributed.recompute import RecomputedForward
from tests.helpers import recompute as R
from tests.helpers.models import make_mlp


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"policy": "some"}, ValueError, r"checkpoint_activations\(policy='some'\): accepted values are 'full', 'ops', "
                                     r"'budget'"),
    ({"policy": "budget"}, ValueError, r"checkpoint_activations\('budget'\) needs max_bytes="),
    ({"max_bytes": 10}, ValueError, r"max_bytes is the budget of policy='budget'"),
    ({"policy": "budget", "max_bytes": 10, "every": 2}, ValueError, r"the budget chooses the blocks itself"),
    ({"every": 0}, ValueError, r"checkpoint_activations\(every=0\): must be >= 1"),
    ({"every": 1.5}, TypeError, r"checkpoint_activations\(every=...\) must be an int"),
    ({"policy": "budget", "max_bytes": 0}, ValueError, r"checkpoint_activations\(max_bytes=0\): must be >= 1"),
    ({"modules": []}, ValueError, r"modules=\[\]\): no module is chosen"),
    ({"modules": [""]}, ValueError, r"an empty name pattern"),
    ({"modules": [3]}, TypeError, r"must be nn.Module classes or module name patterns \(str\), got 3"),
    ({"modules": 3}, TypeError, r"must be None, an nn.Module class, a module name pattern"),
])
def test_bad_arguments_are_refused_when_the_transform_is_built(kwargs: dict[str, Any], error: type,
                                                               message: str) -> None:
    """checkpoint_activations(...) checks its arguments at once, naming the argument and the rule."""
    with pytest.raises(error, match=message):
        af.checkpoint_activations(**kwargs)


class Nested(torch.nn.Module):
    """Two lists of blocks, one block holding a list of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(R.Block() for _ in range(3))
        self.heads = torch.nn.ModuleList(torch.nn.Linear(16, 2) for _ in range(2))
        self.blocks[1].inner = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(2))


def test_the_candidates_are_the_repeated_blocks_or_the_classes_and_patterns_named() -> None:
    """By default the children of every ModuleList of 2+ modules of one class, outermost lists
    first (a list inside a chosen block is not searched); classes and patterns choose the outermost
    matching modules, in the model's order; every=n takes the n-th, 2n-th, ...; the record stays
    hashable."""
    model = Nested()
    names = lambda spec: [n for n, _ in spec.candidates(model)]  # noqa: E731
    assert names(af.checkpoint_activations()) == ["blocks.0", "blocks.1", "blocks.2", "heads.0", "heads.1"]
    assert names(af.checkpoint_activations(modules=R.Block)) == ["blocks.0", "blocks.1", "blocks.2"]
    assert names(af.checkpoint_activations(modules=torch.nn.Linear)) == [
        "blocks.0.a", "blocks.0.b", "blocks.1.a", "blocks.1.b", "blocks.1.inner.0", "blocks.1.inner.1",
        "blocks.2.a", "blocks.2.b", "heads.0", "heads.1"]
    assert names(af.checkpoint_activations(modules=["heads.*", "blocks.1", "blocks.1.a"])) == [
        "blocks.1", "heads.0", "heads.1"]
    every = af.checkpoint_activations("ops", every=2)
    assert [n for n, _ in every.recomputed(model)] == ["blocks.1", "heads.0"]
    assert hash(every) == hash(af.checkpoint_activations("ops", every=2))


def _run(transforms: tuple[Any, ...], *, epochs: int = 2, evaluate: bool = False) -> tuple[af.TrainState, int, int]:
    state = R.make_state()
    calls = R.Calls(state.model)
    torch.manual_seed(7)
    state = af.run(af.compose(af.accumulate(2), *transforms)(af.train_step(R.loss)), state, R.loader(),
                   backend=af.backends.CPU(), epochs=epochs, progress=False)
    trained = calls.count
    if evaluate:
        af.evaluate(lambda m, b: m(b[0]), state, R.loader(), backend=af.backends.CPU())
    return state, trained, calls.count - trained


@pytest.mark.parametrize(("spec", "recomputed"), [
    (af.checkpoint_activations(), 4),
    (af.checkpoint_activations("ops"), 4),
    (af.checkpoint_activations(every=2), 2),
    (af.checkpoint_activations(modules="blocks.3"), 1),
])
def test_training_recomputes_and_equals_training_without_it_bitwise(spec: af.CheckpointActivations,
                                                                    recomputed: int) -> None:
    """With dropout in every block, 2 epochs of accumulate(2) give bitwise the parameters of the
    program without recomputation; each recomputed block's layers ran twice per micro-batch
    (12 micro-batches x 4 blocks once, plus once more per recomputed block), and af.evaluate
    afterwards runs each block once per batch (6 batches x 4 blocks): it recomputes nothing."""
    plain, plain_calls, _ = _run(())
    state, calls, evaluated = _run((spec,), evaluate=True)
    assert state.step == plain.step == 6
    assert plain_calls == 12 * 4 and calls == 12 * (4 + recomputed) and evaluated == 6 * 4
    for (name, a), b in zip(state.model.named_parameters(), plain.model.parameters()):
        assert torch.equal(a, b), name
    assert len(R.recomputed_blocks(state.model)) == recomputed


def _manifest(path: Path) -> dict[str, Any]:
    return orjson.loads((path / "manifest.json").read_bytes())


def test_state_dict_checkpoint_and_export_are_the_same_with_and_without_it(tmp_path: Path) -> None:
    """After the same training with and without recomputation: the state dicts have the same
    keys and values; the checkpoints' manifests are identical (checkpoint_activations is not
    recorded: it changes no value) and so are their tensor files, byte for byte; save_model writes
    the same keys, values and metadata; no name has anything added (no _checkpoint_wrapped_module)."""
    plain, _, _ = _run(())
    state, _, _ = _run((af.checkpoint_activations(),))
    assert R.recomputed_blocks(state.model)
    assert list(state.model.state_dict()) == list(plain.model.state_dict()) == list(R.Net().state_dict())
    program = af.train_step(R.loss)
    checkpoints = {}
    for name, s, step in (("plain", plain, program), ("recomputed", state, af.checkpoint_activations()(program))):
        checkpoints[name] = af.Checkpoints(tmp_path / name).save(s, program=step)
        af.save_model(s, tmp_path / f"export_{name}")
    assert _manifest(checkpoints["plain"]) == _manifest(checkpoints["recomputed"])
    for a in sorted(checkpoints["plain"].iterdir()):
        assert a.read_bytes() == (checkpoints["recomputed"] / a.name).read_bytes(), a.name
    exports = [sorted((tmp_path / f"export_{n}").iterdir()) for n in ("plain", "recomputed")]
    assert [p.name for p in exports[0]] == [p.name for p in exports[1]] == ["model.safetensors"]
    with safe_open(exports[0][0], "pt") as a, safe_open(exports[1][0], "pt") as b:
        assert a.metadata() == b.metadata() and list(a.keys()) == list(b.keys()) == sorted(plain.model.state_dict())
        for key in a.keys():
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key


@pytest.mark.parametrize("first", ["recomputed", "plain"])
def test_a_checkpoint_written_with_it_resumes_without_it_and_the_reverse(tmp_path: Path, first: str) -> None:
    """A run of shard_data + accumulate(2) checkpointed at step 3 with (without) recomputation,
    resumed with resume='auto' by a program without (with) it, ends bitwise where 6 uninterrupted
    updates without it end, with no warning that the programs differ."""
    recompute = (af.checkpoint_activations(),)
    before, after = (recompute, ()) if first == "recomputed" else ((), recompute)

    def run(transforms: tuple[Any, ...], max_steps: int, checkpoints: af.Checkpoints | None) -> af.TrainState:
        torch.manual_seed(7)
        return af.run(af.compose(af.shard_data(), af.accumulate(2), *transforms)(af.train_step(R.loss)),
                      R.make_state(), R.loader(), backend=af.backends.CPU(), epochs=2, max_steps=max_steps,
                      checkpoints=checkpoints, resume="auto" if checkpoints is not None else None, progress=False)

    uninterrupted = run((), 6, None)
    checkpoints = af.Checkpoints(tmp_path / "ckpt", every_steps=3)
    assert run(before, 3, checkpoints).step == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed = run(after, 6, checkpoints)
    assert resumed.step == 6
    for (name, a), b in zip(resumed.model.named_parameters(), uninterrupted.model.parameters()):
        assert torch.equal(a, b), name


def test_prepare_refuses_a_choice_of_nothing_before_anything_changes() -> None:
    """A model without repeated blocks, a pattern that matches no module and a budget nothing
    resolved are refused by prepare with a ValueError that says what to do, the model untouched
    (its forward its class's, its parameters the same objects)."""
    cpu = af.backends.CPU()
    cases = [
        (make_mlp(), af.checkpoint_activations(), "MLP has no repeated blocks"),
        (R.Net(), af.checkpoint_activations(modules="layers.*"), r"matches no module of Net \(its modules include "
                                                                 r"'inp', 'blocks'"),
        (R.Net(), af.checkpoint_activations("budget", max_bytes=10**6),
         r"af.run does before it prepares the program; in a loop of your own, prepare the program the plan "
         r"resolved \(af.plan\(step, state, data\).step\)"),
    ]
    for model, spec, message in cases:
        state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        params = list(model.parameters())
        with pytest.raises(ValueError, match=message):
            cpu.prepare(spec(af.train_step(R.loss)), state)
        assert not any("forward" in m.__dict__ for m in model.modules())
        assert list(model.parameters()) == params


def test_a_model_prepared_again_recomputes_as_the_new_program_says() -> None:
    """A state prepared with checkpoint_activations() and prepared again with every=2 recomputes
    blocks 1 and 3 only; prepared again without it, no block's forward is replaced."""
    cpu = af.backends.CPU()
    state = R.make_state()
    state, _ = cpu.prepare(af.checkpoint_activations()(af.train_step(R.loss)), state)
    assert R.recomputed_blocks(state.model) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    state, _ = cpu.prepare(af.checkpoint_activations(every=2)(af.train_step(R.loss)), state)
    assert R.recomputed_blocks(state.model) == ["blocks.1", "blocks.3"]
    assert isinstance(state.model.blocks[1].forward, RecomputedForward)
    state, _ = cpu.prepare(af.train_step(R.loss), state)
    assert R.recomputed_blocks(state.model) == [] and not any("forward" in m.__dict__ for m in state.model.modules())


def test_a_block_with_a_forward_of_its_own_keeps_it() -> None:
    """A block whose forward was replaced on the instance (a hook library's) recomputes that one,
    and gets it back when the program no longer recomputes."""
    cpu = af.backends.CPU()
    state = R.make_state()
    block = state.model.blocks[0]
    own = lambda x: x * 2  # noqa: E731
    block.forward = own
    state, _ = cpu.prepare(af.checkpoint_activations()(af.train_step(R.loss)), state)
    x = torch.ones(2, 16, requires_grad=True)
    assert torch.equal(block(x), x * 2)
    cpu.prepare(af.train_step(R.loss), state)
    assert block.forward is own


def test_deepspeed_is_refused_when_composed() -> None:
    """checkpoint_activations with deepspeed raises TransformError pointing at DeepSpeed's own
    activation checkpointing (called from the model's forward)."""
    with pytest.raises(af.TransformError, match=r"deepspeed.checkpointing.checkpoint\(block, x\)"):
        af.compose(af.deepspeed({}), af.checkpoint_activations())(af.train_step(R.loss))


def test_xla_refuses_it_before_anything_changes_and_the_plan_says_so() -> None:
    """The XLA backend's refusal (given to a CPU backend: a real XLA one needs torch_xla) makes
    prepare raise NotImplementedError naming torch_xla's own checkpoint, and af.plan report the
    error checkpoint-activations-unsupported."""
    cpu = af.backends.CPU(af.backends.LaunchEnv())
    cpu.refusals = af.backends.XLA.refusals  # type: ignore[misc]  # this instance's own
    step = af.checkpoint_activations()(af.train_step(R.loss))
    state = R.make_state()
    with pytest.raises(NotImplementedError, match="torch_xla.utils.checkpoint.checkpoint"):
        cpu.prepare(step, state)
    assert R.recomputed_blocks(state.model) == []
    plan = af.plan(step, state, R.loader(), backend=cpu, trace=False)
    assert [p.code for p in plan.errors] == ["checkpoint-activations-unsupported"]


def test_a_pipeline_split_point_inside_a_recomputed_block_is_refused() -> None:
    """pipeline's cut keeps each recomputed block whole (one call in its stage), so a split point
    inside one is refused, naming the block; at a block it cuts, and the stage calls the block."""
    model = R.Net()
    leaves = frozenset(model.blocks)
    with pytest.raises(ValueError, match=r"'blocks.2.a' is inside the block 'blocks.2', whose activations "
                                         r"checkpoint_activations\(\) recomputes"):
        pipeline_module.cut(model, af.pipeline(["blocks.2.a"], size=2), leaves)
    first, second = pipeline_module.cut(model, af.pipeline(["blocks.2"], size=2), leaves)
    assert [n.target for n in second.graph.nodes if n.op == "call_module"] == ["blocks.2", "blocks.3", "out"]
    assert second.get_submodule("blocks.2") is model.blocks[2]
