"""with_precision("fp8") in one process: torchao's float8 conversion as a precision policy.

The conversion and its filter, training equal to a hand-written torchao loop, bitwise resume,
the export of fp32 weights into the unconverted model, compile composed, and the errors raised
before anything changes. The 2-process acceptance (shard_params with float8 all-gathers) is
tests/distributed/test_fp8.py.
"""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

import accelfn as af
from accelfn.distributed import float8
from accelfn.transforms.precision import Float8
from tests.helpers import fp8 as H


class Odd(torch.nn.Module):
    """Layers of every kind the filter sees: suitable, a dimension of 10, an excluded block,
    and a Hugging Face style output head (``get_output_embeddings``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 64)
        self.narrow = torch.nn.Linear(64, 10)
        self.widen = torch.nn.Linear(10, 32)
        self.block = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
        self.lm_head = torch.nn.Linear(32, 16)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.block(self.widen(torch.relu(self.narrow(self.a(x))))))


def _state(model: torch.nn.Module) -> af.TrainState:
    return af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=3e-3))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(DataLoader(H.data(), batch_size=16))[:n]


def test_fp8_options_are_parsed_once_and_checked():
    """with_precision('fp8', ...) records its float8 options; bad ones raise naming the option."""
    policy = af.with_precision("fp8", recipe="rowwise", exclude=["head"]).policy
    assert (policy.param_dtype, policy.compute_dtype) == (torch.float32, torch.bfloat16)
    assert policy.float8 == Float8(recipe="rowwise", all_gather=False, exclude=("head",))
    assert af.with_precision("fp8").policy.float8 == Float8()
    assert af.with_precision("bf16").policy.float8 is None
    with pytest.raises(ValueError, match=r"recipe='blockwise'\): unknown recipe; accepted values are 'tensorwise', 'rowwise'"):
        af.with_precision("fp8", recipe="blockwise")
    with pytest.raises(ValueError, match=r"float8 all-gathers need one scale per weight, the 'tensorwise' recipe"):
        af.with_precision("fp8", recipe="rowwise", float8_all_gather=True)
    with pytest.raises(ValueError, match=r"with_precision\('bf16'\) converts no layer to float8"):
        af.with_precision("bf16", exclude=("head",))
    with pytest.raises(TypeError, match=r"with_precision\(exclude=...\) must be a tuple of module names"):
        af.with_precision("fp8", exclude="head")
    with pytest.raises(TypeError, match=r"with_precision\(float8_all_gather=...\) must be True or False"):
        af.with_precision("fp8", float8_all_gather=1)
    with pytest.raises(ValueError, match=r"accepted values are 'fp32', 'bf16', 'fp16', 'bf16-true', 'fp8'"):
        af.with_precision("fp4")


def test_filter_follows_torchaos_divisibility_rule_the_head_and_exclusions():
    """Layers with a dimension not a multiple of 16, the output head and excluded modules are
    kept, each with its reason; the rest are converted."""
    kept = float8.kept(Odd(), Float8(exclude=("block",)))
    assert kept == {
        "narrow": "weight 10x64: both dimensions must be multiples of 16",
        "widen": "weight 32x10: both dimensions must be multiples of 16",
        "block.0": "excluded ('block')",
        "block.1": "excluded ('block')",
        "lm_head": "the output head (get_output_embeddings())",
    }
    assert float8.convertible(Odd(), Float8(exclude=("block",))) == ["a"]
    assert float8.convertible(Odd(), Float8()) == ["a", "block.0", "block.1"]


@H.requires_fp8
def test_prepare_converts_the_suitable_layers_and_keeps_fp32_master_weights(cpu):
    """prepare swaps exactly the suitable Linears for torchao's Float8Linear, keeping each
    Parameter object (the optimizer's), fp32, under the same state_dict names."""
    model = Odd()
    params = list(model.parameters())
    names = list(model.state_dict())
    state, _ = cpu.prepare(af.with_precision("fp8")(af.train_step(H.loss_fn)), _state(model))
    kinds = {n: type(m).__name__ for n, m in state.model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds == {"a": "Float8Linear", "narrow": "Linear", "widen": "Linear", "block.0": "Float8Linear",
                     "block.1": "Float8Linear", "lm_head": "Linear"}
    assert list(state.model.parameters()) == params and list(state.model.state_dict()) == names
    assert [p for g in state.optimizer.param_groups for p in g["params"]] == params
    assert {p.dtype for p in params} == {torch.float32}


@H.requires_fp8
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_training_equals_a_hand_written_torchao_loop(cpu, recipe):
    """6 AdamW updates under with_precision('fp8', recipe) give bitwise the parameters of the
    same model converted by hand with torchao and trained under bf16 autocast; and differ from
    bf16 training (the matmuls really ran in float8)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    batches = _batches(6)
    state = H.make_state()
    step = af.with_precision("fp8", recipe=recipe, exclude=("head",))(af.train_step(H.loss_fn))
    state, step_fn = cpu.prepare(step, state)
    for batch in batches:
        state, _ = step_fn(state, batch)

    by_hand = H.make_state()
    model, optimizer = by_hand.model, by_hand.optimizer
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=lambda _, name: name != "head")
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = H.loss_fn(model, (x, y))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for (name, got), want in zip(state.model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(got, want), name

    bf16 = H.make_state()
    bf16, bf16_fn = cpu.prepare(af.with_precision("bf16")(af.train_step(H.loss_fn)), bf16)
    for batch in batches:
        bf16, _ = bf16_fn(bf16, batch)
    assert not torch.equal(bf16.model.inp.weight, state.model.inp.weight)
    torch.testing.assert_close(bf16.model.inp.weight, state.model.inp.weight, rtol=0, atol=2e-2)


@H.requires_fp8
def test_fp8_resume_is_bitwise_and_the_export_loads_into_the_unconverted_model(cpu, tmp_path):
    """3 updates, save, load into a fresh state, 3 more equal 6 straight updates bitwise; the
    save_model export holds fp32 weights that load strictly into a plain (unconverted) Net."""
    batches = _batches(6)
    step = H.fp8()(af.train_step(H.loss_fn))
    straight, fn = cpu.prepare(step, H.make_state())
    for batch in batches:
        straight, _ = fn(straight, batch)

    first, fn = cpu.prepare(step, H.make_state())
    for batch in batches[:3]:
        first, _ = fn(first, batch)
    af.save(first, tmp_path / "ckpt")
    resumed, fn = cpu.prepare(step, H.make_state(seed=7))
    resumed = af.load(tmp_path / "ckpt", into=resumed)
    for batch in batches[3:]:
        resumed, _ = fn(resumed, batch)
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    for sa, sb in zip(straight.optimizer.state.values(), resumed.optimizer.state.values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)

    af.save_model(straight, tmp_path / "export")
    weights = load_file(tmp_path / "export" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float32}
    plain = H.Net()
    plain.load_state_dict(weights, strict=True)
    assert all(type(m) is torch.nn.Linear for m in plain.modules() if isinstance(m, torch.nn.Linear))
    for name, value in straight.model.state_dict().items():
        assert torch.equal(plain.state_dict()[name], value), name


@H.requires_fp8
def test_fp8_composes_with_compile(cpu):
    """fp8 under compile() trains the converted model through torch.compile: its 4 losses stay
    within 1% of eager fp8's (inductor fuses the float8 casts, so not bitwise) and its weights
    differ from bf16's (the compiled matmuls are float8; bf16 eager, one compilation less)."""
    batches = _batches(4)

    def train(*transforms: af.Transform) -> tuple[af.TrainState, list[float]]:
        state, fn = cpu.prepare(af.compose(*transforms)(af.train_step(H.loss_fn)), H.make_state())
        losses = []
        for batch in batches:
            state, metrics = fn(state, batch)
            losses.append(float(metrics["loss"]))
        return state, losses

    _, eager = train(H.fp8())
    compiled, losses = train(H.fp8(), af.compile())
    bf16, _ = train(af.with_precision("bf16"))
    assert type(compiled.model.inp).__name__ == "Float8Linear"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager), rtol=1e-2, atol=0)
    assert not torch.allclose(compiled.model.inp.weight, bf16.model.inp.weight, rtol=0, atol=1e-3)


@H.requires_fp8
def test_bad_fp8_programs_fail_before_the_model_changes(cpu):
    """An excluded name the model lacks, a model with no suitable layer, fp8 with invariant(),
    and a converted model prepared in another precision raise, naming the fix; the model is
    left unconverted (or as it was)."""
    model = H.Net()
    with pytest.raises(ValueError, match=r"exclude=...\): the model has no module named 'lm_head'; names are"):
        cpu.prepare(af.with_precision("fp8", exclude=("lm_head",))(af.train_step(H.loss_fn)), _state(model))
    assert not float8.is_converted(model)
    tiny = torch.nn.Linear(4, 1)
    with pytest.raises(ValueError, match=r"no layer of the model suits float8 \(the model: weight 1x4: both dimensions"):
        cpu.prepare(af.with_precision("fp8")(af.train_step(H.loss_fn)), _state(tiny))
    with pytest.raises(NotImplementedError, match=r"with_precision\('fp8'\) with invariant: "):
        cpu.prepare(af.compose(H.fp8(), af.invariant())(af.train_step(H.loss_fn)), _state(model))
    assert not float8.is_converted(model)
    state, _ = cpu.prepare(H.fp8()(af.train_step(H.loss_fn)), _state(model))
    with pytest.raises(ValueError, match=r"converted to float8 training .* not 'bf16'"):
        cpu.prepare(af.with_precision("bf16")(af.train_step(H.loss_fn)), state)


def test_fp8_without_torchao_names_the_install(cpu, monkeypatch):
    """Without torchao (its import fails, as where it is not installed), preparing an fp8 program
    raises NotImplementedError naming pip install 'accelfn[fp8]', before the model changes."""
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao...` now raises ModuleNotFoundError
    model = H.Net()
    with pytest.raises(NotImplementedError) as raised:
        cpu.prepare(H.fp8()(af.train_step(H.loss_fn)), af.TrainState.create(model, torch.optim.SGD(model.parameters(),
                                                                                                  lr=0.1)))
    assert type(model.inp).__name__ == "Linear"
    assert str(raised.value) == ("with_precision('fp8') trains through torchao's float8 layers, and torchao is not "
                                 "installed: pip install 'accelfn[fp8]' (torchao)")


@H.requires_fp8
def test_fp8_composes_with_activation_checkpointing(cpu):
    """fp8 with checkpoint_activations() recomputes the converted blocks in the backward and gives
    bitwise the parameters of fp8 without it after 3 updates (the conversion runs first)."""
    batches = _batches(3)
    results = []
    for transforms in ([H.fp8()], [H.fp8(), af.checkpoint_activations()]):
        state, fn = cpu.prepare(af.compose(*transforms)(af.train_step(H.loss_fn)), H.make_state())
        for batch in batches:
            state, _ = fn(state, batch)
        assert type(state.model.blocks[0].up).__name__ == "Float8Linear"
        results.append(state.model.state_dict())
    assert results[0].keys() == results[1].keys()
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])
