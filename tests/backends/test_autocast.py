"""Precision in user code: ``backend.autocast(step)``, ``backend.precision(step)`` and
``af.evaluate(..., precision=step)`` run code under the policy training uses, in exact dtypes."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import accelfn as af

CPU = af.backends.CPU(af.backends.LaunchEnv())


def _program(policy: str | None) -> af.Step:
    step = af.train_step(lambda model, batch: model(batch).float().pow(2).mean())
    return step if policy is None else af.with_precision(policy)(step)


def _prepared(policy: str | None) -> tuple[af.TrainState, af.Step]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = _program(policy)
    state, _ = CPU.prepare(step, state)
    return state, step


@pytest.mark.parametrize(("policy", "enabled", "output_dtype"), [
    ("fp32", False, torch.float32),
    ("bf16", True, torch.bfloat16),
    ("fp16", True, torch.float16),
    ("bf16-true", False, torch.bfloat16),
])
def test_autocast_runs_user_code_in_the_programs_compute_dtype(policy: str, enabled: bool,
                                                               output_dtype: torch.dtype) -> None:
    """Inside backend.autocast(step) autocast is on exactly for bf16/fp16, and a linear layer
    computes in the policy's compute dtype (bf16-true: bf16 parameters, no autocast)."""
    state, step = _prepared(policy)
    x = torch.randn(4, 3).to(state.model.weight.dtype)
    with CPU.autocast(step):
        assert torch.is_autocast_enabled("cpu") is enabled
        if enabled:
            assert torch.get_autocast_dtype("cpu") == CPU.precision(step).compute_dtype
        y = state.model(x)
    assert y.dtype == output_dtype
    assert not torch.is_autocast_enabled("cpu")


def test_precision_is_the_programs_policy_else_the_launchs_else_fp32() -> None:
    """backend.precision(step): with_precision's policy; without it, accelfn launch --precision; else fp32."""
    launched = af.backends.CPU(af.backends.LaunchEnv(precision="bf16"))
    fp16 = CPU.precision(_program("fp16"))
    assert (fp16.name, fp16.param_dtype, fp16.compute_dtype) == ("fp16", torch.float32, torch.float16)
    assert fp16.scaling is not None
    bf16 = launched.precision(_program(None))
    assert (bf16.name, bf16.param_dtype, bf16.compute_dtype, bf16.scaling) == (
        "bf16", torch.float32, torch.bfloat16, None)
    assert launched.precision(_program("bf16-true")).name == "bf16-true"  # the script's wins
    assert CPU.precision(_program(None)).name == "fp32"
    with launched.autocast(_program(None)):
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize(("policy", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_evaluate_with_precision_runs_fn_as_the_training_forward_does(policy: str, dtype: torch.dtype) -> None:
    """evaluate(..., precision=step) returns the outputs torch.autocast(compute dtype) gives,
    bit for bit; without it the outputs are fp32."""
    state, step = _prepared(policy)
    x = torch.randn(7, 3)
    loader = DataLoader(x, batch_size=3)
    mixed = af.evaluate(lambda model, batch: model(batch), state, loader, backend=CPU, precision=step)
    full = af.evaluate(lambda model, batch: model(batch), state, loader, backend=CPU)
    with torch.inference_mode(), torch.autocast("cpu", dtype=dtype):
        expected = torch.cat([state.model(x[:3]), state.model(x[3:6]), state.model(x[6:])])
    assert mixed.dtype == dtype and torch.equal(mixed, expected)
    assert full.dtype == torch.float32


def test_autocast_precision_and_evaluate_refuse_what_is_not_a_step() -> None:
    """A policy name where a Step is expected is a TypeError saying what to pass."""
    with pytest.raises(TypeError, match=r"autocast\(\) takes the Step .* got str"):
        CPU.autocast("bf16")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"precision\(\) takes a Step .* got str"):
        CPU.precision("bf16")  # type: ignore[arg-type]
    state, _ = _prepared(None)
    with pytest.raises(TypeError, match=r"evaluate\(precision=...\) takes the training Step .* got str"):
        af.evaluate(lambda m, b: m(b), state, [torch.ones(1, 3)], backend=CPU, precision="bf16")  # type: ignore[arg-type]
