"""State trained on XLA continues on the CPU backend, and the other way round."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import accelfn as af
from tests.helpers.models import classification_data, make_mlp
from tests.helpers.xla import flat, loss_fn

pytestmark = pytest.mark.xla

LOADER = DataLoader(classification_data(42), batch_size=4, shuffle=True)  # 11 micro-batches, 6 updates an epoch
STEP = af.compose(af.shard_data(seed=3), af.replicate(), af.accumulate(2), af.clip(0.5))(af.train_step(loss_fn))


@pytest.fixture(scope="module")
def xla() -> af.backends.Backend:
    return af.backends.XLA(af.backends.LaunchEnv())


def fresh() -> af.TrainState:
    model = make_mlp()
    return af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))


@pytest.fixture(scope="module")
def reference(cpu) -> af.TrainState:
    """Two uninterrupted epochs on the CPU backend."""
    return af.run(STEP, fresh(), LOADER, backend=cpu, epochs=2, progress=False)


def assert_continues_like(state: af.TrainState, reference: af.TrainState) -> None:
    assert (state.step, state.micro_step, state.epoch) == (reference.step, reference.micro_step, reference.epoch)
    torch.testing.assert_close(flat(state.model), flat(reference.model), rtol=0, atol=1e-4)


def to_cpu(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [to_cpu(v) for v in tree]
    return tree


def carry_over(source: af.TrainState, into: af.TrainState) -> af.TrainState:
    """What a snapshot carries here, by hand: CPU copies of the model's and optimizer's state
    dicts, and the counters (no transform holds state in STEP between updates)."""
    into.model.load_state_dict(to_cpu(source.model.state_dict()))
    into.optimizer.load_state_dict(to_cpu(source.optimizer.state_dict()))
    return into.replace(step=source.step, micro_step=source.micro_step, epoch=source.epoch,
                        epoch_micro_step=source.epoch_micro_step)


@pytest.mark.parametrize("first, then", [("xla", "cpu"), ("cpu", "xla")])
def test_state_dicts_carry_training_across_backends(cpu, xla, reference, first, then):
    """Stopped mid-epoch after 4 updates on one backend, carried over through CPU state dicts
    into a fresh state and finished on the other, training ends within 1e-4 of two
    uninterrupted CPU epochs."""
    backends = {"cpu": cpu, "xla": xla}
    stopped = af.run(STEP, fresh(), LOADER, backend=backends[first], epochs=2, max_steps=4, progress=False)
    assert (stopped.step, stopped.epoch, stopped.epoch_micro_step) == (4, 0, 8)
    finished = af.run(STEP, carry_over(stopped, fresh()), LOADER, backend=backends[then], epochs=2, progress=False)
    assert_continues_like(finished, reference)


def test_a_checkpoint_saved_on_xla_resumes_on_cpu(cpu, xla, reference, tmp_path):
    """af.save of a state stopped mid-epoch on XLA, af.load into a fresh state, and training
    on the CPU backend end within 1e-4 of two uninterrupted CPU epochs."""
    stopped = af.run(STEP, fresh(), LOADER, backend=xla, epochs=2, max_steps=4, progress=False)
    af.save(stopped, tmp_path / "from-xla")
    resumed = af.load(tmp_path / "from-xla", into=fresh())
    assert resumed.step == 4 and resumed.model.fc1.weight.device.type == "cpu"
    assert_continues_like(af.run(STEP, resumed, LOADER, backend=cpu, epochs=2, progress=False), reference)


def test_a_cpu_snapshot_restores_into_a_state_on_xla(cpu, xla, reference, tmp_path):
    """af.snapshot of a state stopped mid-epoch on the CPU backend, af.restore into a state
    already placed on XLA, and training on XLA end within 1e-4 of two uninterrupted CPU
    epochs; the same through af.save/af.load."""
    stopped = af.run(STEP, fresh(), LOADER, backend=cpu, epochs=2, max_steps=4, progress=False)
    placed, _ = xla.prepare(STEP, fresh())
    restored = af.restore(placed, af.snapshot(stopped))
    assert restored.step == 4 and restored.model.fc1.weight.device.type == "xla"
    assert_continues_like(af.run(STEP, restored, LOADER, backend=xla, epochs=2, progress=False), reference)

    af.save(stopped, tmp_path / "from-cpu")
    placed, _ = xla.prepare(STEP, fresh())
    loaded = af.load(tmp_path / "from-cpu", into=placed)
    assert_continues_like(af.run(STEP, loaded, LOADER, backend=xla, epochs=2, progress=False), reference)
