"""The digits example trains a real CNN on real data to >= 95% held-out accuracy."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tests.helpers.events import read_scalars

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits.py"


def load_example():
    spec = importlib.util.spec_from_file_location("digits_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_digits_reaches_95_percent_and_writes_tensorboard(tmp_path):
    """``examples/digits.py`` reaches >= 0.95 held-out accuracy and logs loss, lr, grad norm
    and samples/s at x = state.step into one TensorBoard event file."""
    digits = load_example()
    accuracy = digits.main(logdir=str(tmp_path / "tb"), progress=False)
    assert accuracy >= 0.95

    files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 1
    scalars = read_scalars(files[0])
    assert {"loss", "lr", "grad_norm", "samples_per_s", "acc"} <= set(scalars)
    steps = [s for s, _ in scalars["loss"]]
    assert steps == list(range(10, 541, 10))  # log_every=10 over 12 epochs x 45 updates
    assert scalars["loss"][-1][1] < scalars["loss"][0][1] / 10
    assert all(v > 0 for _, v in scalars["samples_per_s"])
