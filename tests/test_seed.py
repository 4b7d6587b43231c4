"""``af.set_seed``: every global generator seeded, runs repeat bitwise, deterministic mode."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import accelfn as af


class Augmented(Dataset):
    """Samples with random augmentation drawn from torch, NumPy and Python's ``random``
    (in the DataLoader's worker processes when it has any)."""

    def __init__(self, n: int = 32) -> None:
        self.x = torch.linspace(-1, 1, n * 6).reshape(n, 6)
        self.y = torch.arange(n) % 3

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.randn(6) + float(np.random.uniform()) + random.random()
        return self.x[i] + 0.1 * noise, self.y[i]


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def train(seed: int, cpu: af.backends.CPU, *, num_workers: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A run from ``af.set_seed(seed)``: random init, dropout, shuffling, augmentation in
    ``num_workers`` worker processes; its final parameters and the batches it read."""
    af.set_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 3))
    loader = DataLoader(Augmented(), batch_size=8, shuffle=True, num_workers=num_workers)
    seen: list[torch.Tensor] = []

    def recording(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        seen.append(batch[0].clone())
        return loss_fn(model, batch)

    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state = af.run(af.train_step(recording), state, loader, backend=cpu, epochs=2, progress=False)
    return [p.detach().clone() for p in state.model.parameters()], seen


@pytest.mark.parametrize("num_workers", [0, 2])
def test_two_runs_from_the_same_seed_are_bitwise_equal(cpu: af.backends.CPU, num_workers: int) -> None:
    """Two runs after set_seed(7) read the same augmented batches and end with bitwise equal
    parameters, also with DataLoader workers; set_seed(8) changes both."""
    params, batches = train(7, cpu, num_workers=num_workers)
    torch.manual_seed(123), np.random.seed(123), random.seed(123)  # whatever ran in between
    again, batches_again = train(7, cpu, num_workers=num_workers)
    other, other_batches = train(8, cpu, num_workers=num_workers)
    assert len(batches) == 8
    assert all(torch.equal(a, b) for a, b in zip(batches, batches_again))
    assert all(torch.equal(a, b) for a, b in zip(params, again))
    assert not torch.equal(batches[0], other_batches[0])
    assert not torch.equal(params[0], other[0])


def test_set_seed_seeds_python_numpy_and_torch() -> None:
    """After set_seed(s) the global generators draw what each library's own seeding gives."""
    af.set_seed(2024)
    drawn = (random.random(), float(np.random.uniform()), torch.rand(3))
    random.seed(2024), np.random.seed(2024), torch.manual_seed(2024)
    expected = (random.random(), float(np.random.uniform()), torch.rand(3))
    assert drawn[:2] == expected[:2]
    assert torch.equal(drawn[2], expected[2])


@pytest.fixture
def restore_determinism(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Puts torch's deterministic settings (and CUBLAS_WORKSPACE_CONFIG) back after a test."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]


def test_deterministic_turns_on_torchs_deterministic_algorithms(restore_determinism: None) -> None:
    """deterministic=True turns on use_deterministic_algorithms and cuDNN's deterministic
    mode, turns its autotuner off, and sets CUBLAS_WORKSPACE_CONFIG for cuBLAS."""
    torch.backends.cudnn.benchmark = True
    af.set_seed(0, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) == (True, False)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_without_deterministic_torchs_settings_are_left_alone(restore_determinism: None) -> None:
    """set_seed(s) alone changes no algorithm setting."""
    torch.backends.cudnn.benchmark = True
    af.set_seed(0)
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.benchmark
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


@pytest.mark.parametrize(("args", "error", "message"), [
    ((-1,), ValueError, r"set_seed\(seed=-1\): must be in 0..2\*\*32 - 1"),
    ((2**32,), ValueError, r"set_seed\(seed=4294967296\): must be in 0..2\*\*32 - 1"),
    ((1.5,), TypeError, r"set_seed\(seed=...\) must be an int, got 1.5"),
    ((True,), TypeError, r"set_seed\(seed=...\) must be an int, got True"),
])
def test_a_bad_seed_is_refused_before_any_generator_changes(args: tuple, error: type, message: str) -> None:
    """A seed that is not an int in 0..2**32-1 raises, naming it, and draws stay as they were."""
    torch.manual_seed(5)
    expected = torch.rand(1)
    torch.manual_seed(5)
    with pytest.raises(error, match=message):
        af.set_seed(*args)
    assert torch.equal(torch.rand(1), expected)
