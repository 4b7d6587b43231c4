"""Placement opt-out: ``place_model=False`` / ``place_batches=False`` leave the model and the
batches where the user put them. The meta device stands in for a second device on CPU: the
default backend would move (and fail to copy) a meta tensor, the opted-out one never touches it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import accelfn as af

ENV = af.backends.LaunchEnv()


def _split_model() -> torch.nn.Module:
    """A Linear on the CPU followed by one on the meta device (a model split by hand)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2, device="meta"))


def _state(model: torch.nn.Module) -> af.TrainState:
    return af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_prepare_without_model_placement_keeps_every_parameter_on_its_device() -> None:
    """place_model=False: the meta half stays on meta (same Parameter objects); bf16-true still
    casts every parameter to bf16 where it is; the default backend refuses it (a model with
    meta tensors is materialized only under shard_params or tensor_parallel)."""
    model = _split_model()
    before = list(model.parameters())
    step = af.with_precision("bf16-true")(af.train_step(lambda m, b: m(b).sum()))
    af.backends.CPU(ENV, place_model=False).prepare(step, _state(model))
    assert [p.device.type for p in model.parameters()] == ["cpu", "cpu", "meta", "meta"]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(a is b for a, b in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="model is on the meta device"):
        af.backends.CPU(ENV).prepare(af.train_step(lambda m, b: m(b).sum()), _state(_split_model()))


class _Tagged(torch.nn.Module):
    """An MLP with a buffer on the meta device that the forward never reads."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.register_buffer("tag", torch.empty(2, device="meta"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_run_without_placement_trains_on_the_users_model_and_batches_as_they_are() -> None:
    """place_model/place_batches=False: run trains a model with a meta buffer on batches with a
    meta tensor, loss_fn receives the loader's very tensors, and the parameters equal a
    hand-written SGD loop's to 1e-6."""
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g), torch.empty(1, device="meta"))
               for _ in range(5)]
    seen = []

    def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y, tag = batch
        seen.append(tag)
        return F.mse_loss(model(x), y)

    model = _Tagged()
    backend = af.backends.CPU(ENV, place_model=False, place_batches=False)
    state = af.run(af.train_step(loss_fn), _state(model), batches, backend=backend, epochs=2, progress=False)

    reference = _Tagged()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        for x, y, _ in batches:
            F.mse_loss(reference(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert state.step == 10 and model.tag.device.type == "meta"
    assert [id(t) for t in seen] == [id(b[2]) for b in batches] * 2
    for got, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        next(iter(af.backends.CPU(ENV).batches(batches, af.train_step(loss_fn), 0)))


def test_placement_options_must_be_bools() -> None:
    """place_model="no" is a TypeError naming the option, before any process group exists."""
    with pytest.raises(TypeError, match=r"CPU\(place_model=...\) must be True or False, got 'no'"):
        af.backends.CPU(ENV, place_model="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"auto\(place_batches=...\) must be True or False, got 0"):
        af.backends.auto(ENV, place_batches=0)  # type: ignore[arg-type]


def test_evaluation_without_batch_placement_hands_over_the_loaders_tensors() -> None:
    """place_batches=False: eval_batches and evaluate give fn the meta tensors the DataLoader
    collated, untouched; the default backend tries to copy them to the CPU and fails."""
    loader = DataLoader(torch.empty(5, 3, device="meta"), batch_size=2)
    kept = af.backends.CPU(ENV, place_batches=False)
    assert [(b.device.type, tuple(b.shape)) for b in kept.eval_batches(loader)] == [
        ("meta", (2, 3)), ("meta", (2, 3)), ("meta", (1, 3))]
    seen = []

    def fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        seen.append(batch.device.type)
        return torch.zeros(len(batch))

    out = af.evaluate(fn, _state(torch.nn.Linear(3, 1)), loader, backend=kept)
    assert seen == ["meta"] * 3 and out.shape == (5,)
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        next(iter(af.backends.CPU(ENV).eval_batches(loader)))
