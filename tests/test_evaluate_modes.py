"""evaluate puts every submodule back in its own mode, and runs under no_grad: it leaves no
inference tensors behind that break later training, and fn may compute gradients itself."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import accelfn as af
from tests.helpers.models import frozen_backbone_model, shifted_regression, trainable
from tests.helpers.programs import mse

CPU = af.backends.CPU(af.backends.LaunchEnv())



def test_evaluate_puts_every_submodule_back_in_its_own_mode() -> None:
    """fn sees every module in eval mode; afterwards the root and head are in train mode and the
    frozen backbone still in eval mode (model.train(was_training) would flip it)."""
    model = frozen_backbone_model()
    state = af.TrainState.create(model, torch.optim.SGD(trainable(model), lr=0.1))
    seen = []

    def fn(m: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        seen.append([module.training for module in m.modules()])
        return m(batch[0])

    af.evaluate(fn, state, DataLoader(shifted_regression(), batch_size=16), backend=CPU)
    assert seen == [[False] * 5] * 2
    assert [module.training for module in model.modules()] == [True, False, False, False, True]


class _Cached(torch.nn.Module):
    """A Linear scaled by a table built on the first forward (as rotary embeddings cache cos/sin)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.table: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = torch.linspace(0.5, 1.5, x.shape[1])
        return self.lin(x) * self.table[:1]  # the table is saved for backward


def test_a_cache_first_built_inside_evaluate_trains_like_a_plain_loop_afterwards() -> None:
    """A table built lazily during evaluate is an ordinary tensor: the next run trains, and its
    parameters equal a plain loop that evaluated under no_grad first (1e-6)."""
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]
    torch.manual_seed(0)
    reference = _Cached()
    with torch.no_grad():
        reference(data[0][0])
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for batch in data:
        mse(reference, batch).backward()
        optimizer.step()
        optimizer.zero_grad()

    torch.manual_seed(0)
    model = _Cached()
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    af.evaluate(lambda m, b: m(b[0]), state, data, backend=CPU)
    assert model.table is not None and not model.table.is_inference()
    state = af.run(af.train_step(mse), state, data, backend=CPU, progress=False)
    torch.testing.assert_close(model.lin.weight, reference.lin.weight, rtol=1e-6, atol=1e-7)


def test_lazy_linear_first_run_inside_evaluate_then_trains() -> None:
    """nn.LazyLinear materialized by evaluate keeps trainable, non-inference parameters, and
    run then updates them as a plain SGD step does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LazyLinear(1))
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    af.evaluate(lambda m, b: m(b), state, [x], backend=CPU)
    weight = model[0].weight
    assert weight.shape == (1, 4) and weight.requires_grad and not weight.is_inference()
    before = weight.detach().clone(), model[0].bias.detach().clone()
    af.run(af.train_step(mse), state, [(x, y)], backend=CPU, progress=False)
    w, b = before[0].requires_grad_(), before[1].requires_grad_()
    F.mse_loss(x @ w.T + b, y).backward()
    torch.testing.assert_close(model[0].weight, before[0] - 0.1 * w.grad, rtol=1e-6, atol=1e-7)


def test_evaluate_fn_may_compute_input_gradients_under_enable_grad() -> None:
    """A saliency map (input gradients under torch.enable_grad inside fn) equals plain autograd's,
    and leaves no gradient on the parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(10, 4)

    def saliency(m: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            inputs = batch.clone().requires_grad_(True)
            (grad,) = torch.autograd.grad(m(inputs).sum(), inputs)
        return grad

    out = af.evaluate(saliency, state, [x[:6], x[6:]], backend=CPU)
    inputs = x.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(model(inputs).sum(), inputs)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7)
    assert all(p.grad is None for p in model.parameters())


def test_parameter_gradients_taken_in_evaluate_do_not_reach_the_next_update() -> None:
    """fn calling backward() under torch.enable_grad (parameter gradients, say for an
    attribution method) leaves every .grad as it was, so the next run's first update equals
    a plain SGD step on the training batch alone."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(8, 4), torch.randn(8, 1)

    def attribution(m: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            m(batch).sum().backward()
        return m.weight.grad.expand(len(batch), -1).clone()

    af.evaluate(attribution, state, [x], backend=CPU)
    assert all(p.grad is None for p in model.parameters())
    w, b = model.weight.detach().clone().requires_grad_(), model.bias.detach().clone().requires_grad_()
    F.mse_loss(x @ w.T + b, y).backward()
    af.run(af.train_step(mse), state, [(x, y)], backend=CPU, progress=False)
    torch.testing.assert_close(model.weight, (w - 0.1 * w.grad).detach(), rtol=1e-6, atol=1e-7)
