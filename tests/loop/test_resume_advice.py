"""The advice of a failed resume="auto" fits the failure."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import accelfn as af

CPU = af.backends.CPU(af.backends.LaunchEnv())


def _state(outputs: int) -> af.TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, outputs)
    return af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_another_models_checkpoints_do_not_suggest_the_previous_one(tmp_path) -> None:
    """Resuming a Linear(4, 2) from a Linear(4, 1)'s checkpoints lists the mismatch and says that
    the previous checkpoint does not load either, instead of suggesting to resume from it."""
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(4)]
    step = af.train_step(lambda m, b: F.mse_loss(m(b[0])[:, :1], b[1]))
    checkpoints = af.Checkpoints(tmp_path, every_steps=2)
    af.run(step, _state(1), data, backend=CPU, checkpoints=checkpoints, progress=False)
    with pytest.raises(af.CheckpointError) as error:
        af.run(step, _state(2), data, backend=CPU, checkpoints=checkpoints, resume="auto", progress=False)
    latest, previous = checkpoints.path_for(4), checkpoints.path_for(2)
    assert str(error.value) == (
        f"{latest}: the checkpoint does not match the state it is loaded into:\n"
        "  model 'weight': shape (1, 4) in the checkpoint, (2, 4) here\n"
        "  model 'bias': shape (1,) in the checkpoint, (2,) here\n"
        f"run(resume='auto'): the latest checkpoint, {latest}, failed to load; it is not skipped, since that could "
        f"hide a bug. The previous checkpoint, {previous}, does not load either (the checkpoint does not match the "
        "state it is loaded into), so resuming from it would not help: if the state is not built like the one that "
        "wrote them (model, optimizer, scheduler, extra), build it the same way; to train this state from scratch, "
        f"start a fresh run in another checkpoint directory than {tmp_path}")
    assert "resume from the previous one" not in str(error.value)


def test_a_single_checkpoint_of_another_model_advises_both_fixes(tmp_path) -> None:
    """With one checkpoint only, the advice names both causes (another state, a damaged file)
    and, for a fresh run, another checkpoint directory."""
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(2)]
    step = af.train_step(lambda m, b: F.mse_loss(m(b[0])[:, :1], b[1]))
    checkpoints = af.Checkpoints(tmp_path, every_steps=2)
    af.run(step, _state(1), data, backend=CPU, checkpoints=checkpoints, progress=False)
    with pytest.raises(af.CheckpointError) as error:
        af.run(step, _state(2), data, backend=CPU, checkpoints=checkpoints, resume="auto", progress=False)
    assert str(error.value).endswith(
        f"run(resume='auto'): the latest checkpoint, {checkpoints.path_for(2)}, failed to load; it is not skipped, "
        "since that could hide a bug. There is no earlier checkpoint: if the state is not built like the one that "
        "wrote it (model, optimizer, scheduler, extra), build it the same way; if the checkpoint is damaged, or to "
        f"train this state from scratch, start a fresh run in another checkpoint directory than {tmp_path}")
