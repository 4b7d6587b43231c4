"""run trains in the train/eval modes the user set on each submodule."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import accelfn as af

CPU = af.backends.CPU(af.backends.LaunchEnv())


def _frozen_backbone_model() -> torch.nn.Sequential:
    """Sequential(backbone, head) with the backbone (Linear + BatchNorm) frozen and in eval mode."""
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    model = torch.nn.Sequential(backbone, torch.nn.Linear(8, 1))
    backbone.requires_grad_(False)
    backbone.eval()
    return model


def _regression() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(32, 4, generator=g) * 2 + 3, torch.randn(32, 1, generator=g))


def _mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def test_run_keeps_a_frozen_backbone_in_eval_mode_like_a_plain_loop() -> None:
    """A backbone the user put in eval mode stays there through run: its BatchNorm statistics
    do not move and the head's parameters equal a hand-written loop's (1e-6)."""
    reference = _frozen_backbone_model()
    optimizer = torch.optim.SGD(_trainable(reference), lr=0.1)
    for batch in DataLoader(_regression(), batch_size=8):
        _mse(reference, batch).backward()
        optimizer.step()
        optimizer.zero_grad()

    model = _frozen_backbone_model()
    statistics = model[0][1].running_mean.clone()
    state = af.TrainState.create(model, torch.optim.SGD(_trainable(model), lr=0.1))
    state = af.run(af.train_step(_mse), state, DataLoader(_regression(), batch_size=8), backend=CPU,
                   progress=False)
    assert (model.training, model[0].training, model[0][1].training, model[1].training) == (True, False, False, True)
    assert torch.equal(model[0][1].running_mean, statistics)
    torch.testing.assert_close(model[1].weight, reference[1].weight, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(model[1].bias, reference[1].bias, rtol=1e-6, atol=1e-7)
