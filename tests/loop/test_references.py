"""``run`` keeps nothing alive: the basis of docs/08's answer to ``accelerator.free_memory()``."""

from __future__ import annotations

import gc
import weakref

import torch
import torch.nn.functional as F

import accelfn as af


def test_run_keeps_no_reference_to_the_model_optimizer_or_state_once_it_returns(cpu, tmp_path):
    """After a run with accumulate, clip, a tracker and checkpoints, dropping the user's
    references frees the model, the optimizer and the state (the backend holds none)."""
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = af.TrainState.create(model, optimizer)
    step = af.compose(af.accumulate(2), af.clip(1.0))(af.train_step(lambda m, b: F.mse_loss(m(b[0]), b[1])))
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(4)]
    state = af.run(step, state, data, backend=cpu, trackers=[af.JSONL(tmp_path / "m.jsonl")],
                   checkpoints=af.Checkpoints(tmp_path / "ckpt", every_steps=1), progress=False)
    assert state.step == 2
    refs = [weakref.ref(model), weakref.ref(optimizer), weakref.ref(state)]
    del model, optimizer, state
    gc.collect()
    assert [ref() for ref in refs] == [None, None, None]
