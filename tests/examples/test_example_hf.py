"""A Hugging Face model built from a config trains under accelfn with ``m(**b).loss``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import accelfn as af

pytest.importorskip("transformers", reason="the Hugging Face example needs transformers (pip install transformers)")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_gpt2.py"


@pytest.fixture(scope="module")
def hf_gpt2():
    spec = importlib.util.spec_from_file_location("hf_gpt2_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its Dataset class must be picklable by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_gpt2_from_config_equals_the_hand_written_loop(hf_gpt2, cpu):
    """Three updates of GPT-2 with shard_data, accumulate(2) and clip(1.0) through ``run`` give
    the parameters of the hand-written loop over the same shuffled batches (rtol 1e-5)."""
    dataset = hf_gpt2.ByteBlocks(hf_gpt2.stdlib_bytes(), 32)

    torch.manual_seed(0)
    model = hf_gpt2.gpt2(32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(0)
    batches = iter(DataLoader(dataset, batch_size=4, sampler=sampler))
    for _ in range(3):
        for _ in range(2):
            (model(**next(batches)).loss / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    torch.manual_seed(0)
    ours = hf_gpt2.gpt2(32)
    state = af.TrainState.create(ours, torch.optim.AdamW(ours.parameters(), lr=3e-3))
    step = af.compose(af.shard_data(), af.accumulate(2), af.clip(1.0))(af.train_step(hf_gpt2.loss_fn))
    loader = DataLoader(dataset, batch_size=4, shuffle=True)
    state = af.run(step, state, loader, backend=cpu, max_steps=3, progress=False)

    assert state.step == 3
    for (name, expected), actual in zip(model.named_parameters(), state.model.parameters()):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=name)


def test_gpt2_example_lowers_the_loss(hf_gpt2):
    """The example's 30 updates on standard-library bytes lower the logged loss by over 0.5 nats."""
    state, losses = hf_gpt2.main(steps=30, progress=False)
    assert state.step == 30
    assert len(losses) == 3
    assert losses[-1] < losses[0] - 0.5
