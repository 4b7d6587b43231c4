"""Records in checkpoints are named by stable tags, and checkpoints of older formats load."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import orjson
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

import accelfn as af
from accelfn.checkpoint import _codec as _tags
from accelfn.errors import CheckpointError

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def test_the_tag_table_is_pinned() -> None:
    """The registry maps exactly these tags to these records, and format 2's module paths to
    the same tags (changing either is a checkpoint format change)."""
    assert {tag: f"{cls.__module__}.{cls.__qualname__}" for tag, cls in _tags.RECORDS.items()} == {
        "loss_scale": "accelfn.transforms.precision.LossScale",
        "skip_count": "accelfn.transforms.precision.SkipCount",
        "accumulation_window": "accelfn.transforms.accumulate.Window",
        "rng_state": "accelfn.checkpoint._rng.RngState",
        "powersgd_state": "accelfn.transforms.replicate.PowerSGDMemory",
        "invariant_layout": "accelfn.transforms.invariant.Layout",
        "invariant_window": "accelfn.transforms.invariant.TreeWindow",
        "invariant_node": "accelfn.transforms.invariant.Node",
    }
    assert dict(_tags.LEGACY_NAMES) == {
        "accelfn._precision.LossScale": "loss_scale",
        "accelfn._precision.SkipCount": "skip_count",
        "accelfn.backends._interpreter.Window": "accumulation_window",
        "accelfn._rng.RngState": "rng_state",
    }


def _fixture_job() -> tuple[af.TrainState, af.Step, DataLoader]:
    """The job ``fixtures/make_format2.py`` ran, built afresh with other initial weights."""

    class Counter:
        def __init__(self) -> None:
            self.seen = 0

        def state_dict(self) -> dict:
            return {"seen": self.seen}

        def load_state_dict(self, state: dict) -> None:
            self.seen = state["seen"]

    torch.manual_seed(123)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    state = af.TrainState.create(model, optimizer, scheduler=scheduler, extra={"counter": Counter()})
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(24, 3, generator=g), torch.randn(24, 2, generator=g))
    step = af.compose(af.shard_data(seed=5), af.with_precision("fp16"), af.accumulate(2), af.clip(1.0))(
        af.train_step(lambda m, b: F.mse_loss(m(b[0]).float(), b[1])))
    return state, step, DataLoader(data, batch_size=4, shuffle=True)


def test_a_format_2_checkpoint_written_by_the_old_layout_loads_and_continues_bitwise(cpu, tmp_path) -> None:
    """A checkpoint written by accelfn before records had tags (format 2, module-path names,
    saved mid-accumulation-window under fp16) loads every record and finishes its epoch with
    bitwise the parameters the writing process reached."""
    manifest = orjson.loads((FIXTURES / "format2" / "manifest.json").read_bytes())
    assert manifest["format_version"] == 2
    assert b'"__record__":"accelfn._precision.LossScale"' in (FIXTURES / "format2" / "manifest.json").read_bytes()
    state, step, loader = _fixture_job()
    state, step_fn = cpu.prepare(step, state)
    state = af.load(FIXTURES / "format2", into=state)

    ts = state.transforms_state
    assert (state.step, state.micro_step, state.epoch, state.epoch_micro_step) == (2, 5, 0, 5)
    assert ts["loss_scale"] == af.transforms.LossScale(scale=65536.0, growth_tracker=2)
    assert ts["skips"] == af.transforms.SkipCount(num_skipped=0, consecutive=0)
    assert (ts["window"].count, ts["window"].num_samples) == (4, 4)
    assert state.extra["counter"].seen == 3
    for batch, last in cpu.batches(loader, step, 0, start=state.epoch_micro_step):
        state, _ = step_fn(state, batch, flush=last)
    expected = load_file(FIXTURES / "format2_continued.safetensors")
    for name, value in state.model.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_a_saved_record_is_written_under_its_tag(cpu, tmp_path) -> None:
    """A new checkpoint (format 4; tags since format 3) names its records by tag and never by a module path."""
    state, step, loader = _fixture_job()
    state, step_fn = cpu.prepare(step, state)
    batches = iter(cpu.batches(loader, step, 0))
    state, _ = step_fn(state, next(batches)[0], flush=False)
    af.save(state, tmp_path / "ckpt")
    text = (tmp_path / "ckpt" / "manifest.json").read_text()
    assert orjson.loads(text)["format_version"] == 4
    for tag in ("loss_scale", "skip_count", "accumulation_window", "rng_state"):
        assert f'"__record__":"{tag}"' in text
    assert '"__record__":"accelfn.' not in text


def test_an_unknown_record_tag_is_refused_naming_the_field(cpu, tmp_path) -> None:
    """A record tag outside the registry (here a format-2 module path that never existed) is
    refused with the path of the value and the tags this accelfn reads."""
    shutil.copytree(FIXTURES / "format2", tmp_path / "ckpt")
    manifest = tmp_path / "ckpt" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes().replace(b"accelfn._precision.LossScale", b"accelfn.gone.LossScale"))
    (tmp_path / "ckpt" / "manifest.sha256").write_text(
        f"{hashlib.sha256(manifest.read_bytes()).hexdigest()}  manifest.json\n")
    state, step, _ = _fixture_job()
    state, _ = cpu.prepare(step, state)
    with pytest.raises(CheckpointError, match=r"ranks\[0\]\.transforms_state\.loss_scale: a record tagged "
                                              r"'accelfn\.gone\.LossScale', which this accelfn does not have"):
        af.load(tmp_path / "ckpt", into=state)
