"""``af.compile``: the record's checks, eager equivalence, clean checkpoints, the launch default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

import accelfn as af
from accelfn.backends import LaunchEnv
from tests.helpers.models import classification_data, make_mlp
from tests.helpers.pool import Pools

#: inductor fuses and reorders float32 arithmetic, so compiled parameters may differ from eager by rounding
RTOL, ATOL = 1e-5, 1e-6


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def fresh_state(seed: int = 0) -> af.TrainState:
    model = make_mlp(seed)
    return af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def test_compiled_training_matches_eager_and_saves_names_an_uncompiled_model_loads(
        cpu: af.backends.CPU, tmp_path: Path) -> None:
    """With accumulate(2) and clip, compiled training ends within rtol 1e-5/atol 1e-6 of eager;
    its checkpoint names parameters as the plain model does and loads into an uncompiled one."""
    data = torch.utils.data.DataLoader(classification_data(), batch_size=4)
    program = af.compose(af.accumulate(2), af.clip(0.5))(af.train_step(loss_fn))
    eager = af.run(program, fresh_state(), data, backend=cpu, epochs=2, progress=False)
    compiled = af.run(af.compile()(program), fresh_state(), data, backend=cpu, epochs=2, progress=False)
    assert compiled.step == eager.step == 10
    for (name, a), b in zip(compiled.model.named_parameters(), eager.model.parameters()):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=name)
    assert not isinstance(compiled.model, torch._dynamo.eval_frame.OptimizedModule)

    af.save(compiled, tmp_path / "ckpt")
    with safe_open(tmp_path / "ckpt" / "model.safetensors", "pt") as f:
        assert set(f.keys()) == set(make_mlp().state_dict()) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    loaded = af.load(tmp_path / "ckpt", into=fresh_state(seed=1))
    for a, b in zip(loaded.model.parameters(), compiled.model.parameters()):
        assert torch.equal(a, b)


def test_prepare_compiles_the_model_the_forward_calls_and_leaves_the_states_model_plain() -> None:
    """The step function calls an OptimizedModule around the state's own (unwrapped) model."""
    state = fresh_state()
    state, step_fn = af.backends.CPU(LaunchEnv()).prepare(af.compile(backend="eager")(af.train_step(loss_fn)), state)
    called = step_fn._model  # noqa: SLF001 (what the forward calls)
    assert isinstance(called, torch._dynamo.eval_frame.OptimizedModule)
    assert called._orig_mod is state.model  # noqa: SLF001


def test_launch_compile_adds_compile_to_a_program_without_one() -> None:
    """`accelfn launch --compile` (ACCELFN_COMPILE=1) adds af.compile() where the script has none,
    and keeps a script's own af.compile(...) as it is."""
    backend = af.backends.CPU(LaunchEnv(compile=True))
    _, step_fn = backend.prepare(af.train_step(loss_fn), fresh_state())
    assert step_fn.step.find(af.Compile) == af.compile()
    own = af.compile(mode="max-autotune")
    _, step_fn = backend.prepare(own(af.train_step(loss_fn)), fresh_state())
    assert step_fn.step.find(af.Compile) is own


def test_compile_is_listed_after_replicate_whatever_the_order_of_composition() -> None:
    """compile and replicate share the model phase; the program lists them in one order."""
    one = af.compose(af.compile(), af.replicate())(af.train_step(loss_fn)).transforms
    other = af.compose(af.replicate(), af.compile())(af.train_step(loss_fn)).transforms
    assert [type(t).__name__ for t in one] == [type(t).__name__ for t in other] == ["Compile", "Replicate"]


def test_options_are_passed_to_torch_compile_and_the_record_stays_hashable() -> None:
    """compile's arguments become torch.compile's keyword arguments; options are kept sorted."""
    spec = af.compile(fullgraph=True, dynamic=False, backend="aot_eager", options={"b": 1, "a": True})
    assert spec.options == (("a", True), ("b", 1))
    assert hash(spec) == hash(af.compile(fullgraph=True, dynamic=False, backend="aot_eager",
                                         options={"a": True, "b": 1}))
    assert spec.torch_compile_kwargs() == {"fullgraph": True, "dynamic": False, "backend": "aot_eager",
                                           "options": {"a": True, "b": 1}}
    assert af.compile(mode="reduce-overhead").torch_compile_kwargs() == {
        "fullgraph": False, "dynamic": None, "backend": "inductor", "mode": "reduce-overhead"}


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"mode": "fast"}, ValueError, r"compile\(mode='fast'\): accepted values are None, 'default', "
                                   r"'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs'"),
    ({"mode": "default", "options": {"a": 1}}, ValueError, r"torch.compile takes a mode or options, not both"),
    ({"options": [1, 2]}, TypeError, r"compile\(options=...\) must be a mapping of option names to values"),
    ({"options": {"a": [1]}}, TypeError, r"maps option names to str/int/float/bool values, got 'a': \[1\]"),
    ({"backend": ""}, TypeError, r"compile\(backend=...\) must be the name of a TorchDynamo backend"),
    ({"fullgraph": 1}, TypeError, r"compile\(fullgraph=...\) must be True or False, got 1"),
])
def test_bad_options_are_refused_when_the_transform_is_built(kwargs: dict, error: type, message: str) -> None:
    """compile(...) checks its arguments at once, naming the argument and what it accepts."""
    with pytest.raises(error, match=message):
        af.compile(**kwargs)


@pytest.mark.multiprocess
def test_compile_after_ddp_on_two_processes_matches_one_eager_process(pool: Pools, cpu: af.backends.CPU,
                                                                      tmp_path: Path) -> None:
    """On 2 gloo processes the forward calls DDP inside torch.compile (TorchDynamo and
    AOTAutograd with DDP's graph split; backend aot_eager skips inductor's slow code
    generation), and training equals one eager process with twice the batch."""
    pool.launch("--nproc-per-node", "2", script="compile_ddp.py",
                script_args=("--out", tmp_path, "--backend-name", "aot_eager"))
    assert json.loads((tmp_path / "rank0.json").read_text()) == {
        "layers": ["OptimizedModule", "DistributedDataParallel"], "step": 10}
    program = af.compose(af.accumulate(2), af.clip(0.5))(af.train_step(loss_fn))
    reference = af.run(program, fresh_state(), torch.utils.data.DataLoader(classification_data(), batch_size=4),
                       backend=cpu, epochs=2, progress=False)
    trained = load_file(tmp_path / "params.safetensors")
    for name, p in reference.model.named_parameters():
        torch.testing.assert_close(trained[name], p.detach(), rtol=RTOL, atol=ATOL, msg=name)


#: TorchDynamo reads ``.grad`` of a block's input (not a leaf) under torch's own ``hide_warnings``, which
#: users never see; where warnings are errors (here) it is one
HIDDEN_BY_TORCH = pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf Tensor is being accessed:UserWarning")


def _block_state(seed: int = 0, blocks: int = 4) -> af.TrainState:
    from tests.helpers import recompute as R

    return R.make_state(seed, hidden=(32,) * blocks, p=0.0)


def _block_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _block_data() -> torch.utils.data.DataLoader:
    from tests.helpers import recompute as R

    return R.loader()


@HIDDEN_BY_TORCH
@pytest.mark.parametrize("recompute", [False, True])
def test_regional_compilation_matches_eager_and_leaves_names_and_modules_as_they_are(
        cpu: af.backends.CPU, recompute: bool) -> None:
    """compile(regions=True) (inductor) compiles each of the 4 blocks in place (and with
    checkpoint_activations, each block with its recomputation): 2 epochs of accumulate(2) end
    within compile's tolerance of eager; the step calls the state's own model, no module is an
    OptimizedModule, the names are the plain model's."""
    extra = (af.checkpoint_activations(),) if recompute else ()
    program = af.compose(af.accumulate(2), *extra)(af.train_step(_block_loss))
    eager = af.run(program, _block_state(), _block_data(), backend=cpu, epochs=2, progress=False)
    state = _block_state()
    state, step_fn = cpu.prepare(af.compile(regions=True)(program), state)
    assert step_fn._model is state.model  # noqa: SLF001 (what the forward calls)
    compiled = af.run(af.compile(regions=True)(program), state, _block_data(), backend=cpu, epochs=2, progress=False)
    assert compiled.step == eager.step == 6
    for (name, a), b in zip(compiled.model.named_parameters(), eager.model.parameters()):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=name)
    assert not any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in compiled.model.modules())
    assert list(compiled.model.state_dict()) == list(_block_state().model.state_dict())
    assert [m._compiled_call_impl is not None for m in compiled.model.modules()] == [  # noqa: SLF001
        n.startswith("blocks.") and n.count(".") == 1 for n, _ in compiled.model.named_modules()]


@HIDDEN_BY_TORCH
@pytest.mark.parametrize("blocks", [4, 8])
def test_regional_compilation_compiles_the_block_once_whatever_the_number_of_blocks(
        cpu: af.backends.CPU, blocks: int) -> None:
    """TorchDynamo compiles the blocks' shared forward once, for 4 blocks as for 8: one compiled
    code object (one graph) serves every block."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    af.run(af.compile(backend="eager", regions=True)(af.train_step(_block_loss)), _block_state(blocks=blocks),
           _block_data(), backend=cpu, epochs=1, progress=False)
    assert counters["frames"]["ok"] == 1
    assert counters["stats"]["unique_graphs"] == 1


@HIDDEN_BY_TORCH
def test_regional_compilation_is_refused_without_repeated_blocks_and_undone_by_a_plain_prepare(
        cpu: af.backends.CPU) -> None:
    """compile(regions=True) of a model without repeated blocks raises ValueError before anything
    changes; a model whose blocks a prepare compiled has them uncompiled by a prepare without it."""
    with pytest.raises(ValueError, match=r"compile\(regions=True\): MLP has no repeated blocks"):
        cpu.prepare(af.compile(regions=True)(af.train_step(loss_fn)), fresh_state())
    state, _ = cpu.prepare(af.compile(backend="eager", regions=True)(af.train_step(_block_loss)), _block_state())
    assert state.model.blocks[0]._compiled_call_impl is not None  # noqa: SLF001
    state, _ = cpu.prepare(af.train_step(_block_loss), state)
    assert all(m._compiled_call_impl is None for m in state.model.modules())  # noqa: SLF001
