"""run trains in the train/eval modes the user set on each submodule."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

import accelfn as af
from tests.helpers.models import frozen_backbone_model, shifted_regression, trainable
from tests.helpers.programs import mse

CPU = af.backends.CPU(af.backends.LaunchEnv())



def test_run_keeps_a_frozen_backbone_in_eval_mode_like_a_plain_loop() -> None:
    """A backbone the user put in eval mode stays there through run: its BatchNorm statistics
    do not move and the head's parameters equal a hand-written loop's (1e-6)."""
    reference = frozen_backbone_model()
    optimizer = torch.optim.SGD(trainable(reference), lr=0.1)
    for batch in DataLoader(shifted_regression(), batch_size=8):
        mse(reference, batch).backward()
        optimizer.step()
        optimizer.zero_grad()

    model = frozen_backbone_model()
    statistics = model[0][1].running_mean.clone()
    state = af.TrainState.create(model, torch.optim.SGD(trainable(model), lr=0.1))
    state = af.run(af.train_step(mse), state, DataLoader(shifted_regression(), batch_size=8), backend=CPU,
                   progress=False)
    assert (model.training, model[0].training, model[0][1].training, model[1].training) == (True, False, False, True)
    assert torch.equal(model[0][1].running_mean, statistics)
    torch.testing.assert_close(model[1].weight, reference[1].weight, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(model[1].bias, reference[1].bias, rtol=1e-6, atol=1e-7)
