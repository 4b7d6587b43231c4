"""af.evaluate in one process: dataset order for every kind of data, inference mode, errors.

Two processes are covered in tests/test_multiprocess.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import accelfn as af
from tests.helpers import programs as P

CPU = af.backends.CPU(af.backends.LaunchEnv())


def _state() -> af.TrainState:
    return P.make_state(seed=5)


def test_shuffled_map_style_loader_comes_back_in_dataset_order() -> None:
    """A DataLoader with shuffle=True still gives the outputs in dataset index order."""
    state = _state()
    x = P.regression_data(11).tensors[0]
    loader = DataLoader(P.IndexDataset(11), batch_size=4, shuffle=True)
    out = af.evaluate(P.eval_outputs, state, loader, backend=CPU)
    assert torch.equal(out["index"], torch.arange(11))
    torch.testing.assert_close(out["prediction"], state.model(x).detach(), rtol=1e-6, atol=1e-7)


def test_iterable_dataset_over_two_workers_comes_back_in_stream_order() -> None:
    """An IterableDataset read by 2 DataLoader workers gives one output per item, in stream order."""
    state = _state()
    loader = DataLoader(P.CountingStream(13), batch_size=3, num_workers=2)
    out = af.evaluate(lambda model, batch: batch * 10, state, loader, backend=CPU)
    assert torch.equal(out, torch.arange(13) * 10)


def test_list_of_batches_comes_back_in_batch_order_with_nested_outputs() -> None:
    """Plain batches of different sizes give tuple and dict outputs concatenated in order."""
    state = _state()
    x = P.regression_data(10).tensors[0]
    batches = [x[:4], x[4:5], x[5:]]
    out = af.evaluate(lambda model, b: (model(b), {"x": b}), state, batches, backend=CPU)
    assert isinstance(out, tuple) and torch.equal(out[1]["x"], x)
    assert out[0].shape == (10, 1)


def test_runs_in_eval_mode_under_no_grad_and_restores_training_mode() -> None:
    """fn sees model.training False and grad mode off (no_grad, not inference mode); the model
    is in training mode again afterwards."""
    state = _state()
    seen = []

    def fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        seen.append((model.training, torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        return model(batch)

    out = af.evaluate(fn, state, [torch.randn(3, 4)], backend=CPU)
    assert seen == [(False, False, False)]
    assert not out.requires_grad
    assert state.model.training


@pytest.mark.parametrize(("fn", "error", "message"), [
    (lambda m, b: m(b).mean(), ValueError, r"has shape \(\), but its leading dimension must be the batch size 4"),
    (lambda m, b: (m(b), m(b)[:2]), ValueError, r"output\[1\] has shape \(2, 1\)"),
    (lambda m, b: {"loss": 1.0}, TypeError, r"output\['loss'\] is a float"),
])
def test_outputs_that_are_not_per_sample_tensors_are_rejected(fn, error, message):  # type: ignore[no-untyped-def]
    """A reduced metric, a wrong leading dimension or a non-tensor output raises, naming the output."""
    with pytest.raises(error, match=message):
        af.evaluate(fn, _state(), [torch.randn(4, 4)], backend=CPU)


def test_empty_data_and_unbatched_loaders_are_rejected() -> None:
    """No samples at all, or a DataLoader without batch_size, raises ValueError."""
    with pytest.raises(ValueError, match="holds no samples"):
        af.evaluate(lambda m, b: m(b), _state(), [], backend=CPU)
    with pytest.raises(ValueError, match="batch_size"):
        af.evaluate(lambda m, b: m(b), _state(), DataLoader(TensorDataset(torch.randn(3, 4)), batch_size=None),
                    backend=CPU)
