"""af.save applies every rule af.load applies, before anything is written, with the same words.

Each of the rules a snapshot's values meet (``_codec.RULES``) has a case here: a state that
breaks it, which ``af.save`` refuses leaving nothing on disk, and a saved checkpoint edited to
break it, which ``af.load`` refuses; both errors name the same problem in the same line. The
cases cover the rules exactly, so a rule added without one fails here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import orjson
import pytest
import torch

import accelfn as af
from accelfn.checkpoint import _rng
from accelfn.checkpoint._codec import RULES
from accelfn.errors import CheckpointError
from accelfn.state import Stopped
from accelfn.transforms import LossScale, Window
from tests.helpers.states import build

Edit = Callable[[dict[str, Any]], None]


class ListState(torch.optim.lr_scheduler.CosineAnnealingLR):
    """A scheduler whose state is a list (a Snapshot holds a mapping, or None)."""

    def state_dict(self) -> Any:
        return ["x"]


class NoState(torch.optim.lr_scheduler.CosineAnnealingLR):
    """A scheduler whose state is None, though it is there."""

    def state_dict(self) -> Any:
        return None


class BadGroups(torch.optim.AdamW):
    """An optimizer whose state_dict has no list of param groups."""

    def state_dict(self) -> dict[str, Any]:
        return {"state": {}, "param_groups": "x"}


def _with(state: af.TrainState, **fields: Any) -> af.TrainState:
    """``state`` with ``fields`` set past TrainState's own validators (values no TrainState takes)."""
    for name, value in fields.items():
        object.__setattr__(state, name, value)
    return state


def _scheduled(cls: type) -> af.TrainState:
    state = build(0)
    return af.TrainState.create(state.model, state.optimizer, scheduler=cls(state.optimizer, T_max=15))


def _optimizer(cls: type) -> af.TrainState:
    model = build(0).model
    return af.TrainState.create(model, cls(model.parameters(), lr=1e-2))


def _set(*keys: Any, value: Any) -> Edit:
    def change(manifest: dict[str, Any]) -> None:
        node = manifest
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value

    return change


def _skips_as_loss_scale(manifest: dict[str, Any]) -> None:
    states = manifest["ranks"][0]["transforms_state"]
    states["skips"] = {"__record__": "loss_scale", "fields": {"scale": 1.0, "growth_tracker": 0}}


#: rule -> (a state that breaks it, an edit of a valid checkpoint that breaks it, the problem both name)
CASES: dict[str, tuple[Callable[[], af.TrainState], Edit, str]] = {
    "types": (lambda: _scheduled(ListState), _set("scheduler", value=["x"]),
              "scheduler: ['x'] (a list), must be Mapping[str, Any] | None"),
    "counters": (lambda: _with(build(0), epoch=-1), _set("counters", "epoch", value=-1),
                 "counters.epoch: -1 (an int), must be an int >= 0"),
    "micro_step": (lambda: build(0).replace(step=1, micro_step=0), _set("counters", "step", value=1),
                   "counters.micro_step: 0, below counters.step (1); every optimizer update consumes at least one "
                   "micro-batch"),
    "stopped": (lambda: build(0).replace(stopped=Stopped(-1, "x")), _set("stopped", value={"step": -1, "reason": "x"}),
                "stopped: a mapping, must be None or {'step': <int >= 0>, 'reason': <str>}"),
    "rng": (lambda: build(0), _set("ranks", 0, "rng", "fields", "torch_cpu", value="00"),
            "ranks[0].rng.torch_cpu: not a state of torch's CPU generator"),
    "optimizer": (lambda: _optimizer(BadGroups), _set("optimizer", "param_groups", value="x"),
                  "optimizer: not a state_dict of a torch optimizer"),
    "scheduler": (lambda: _scheduled(NoState), _set("scheduler", value=None),
                  "scheduler: None (a NoneType) for a scheduler of type"),
    "transforms_state": (lambda: build(0).replace(transforms_state={"skips": LossScale(1.0)}), _skips_as_loss_scale,
                         "ranks[0].transforms_state.skips: LossScale(scale=1.0, growth_tracker=0) (a LossScale), "
                         "must be a SkipCount record"),
}


def test_every_rule_has_a_case() -> None:
    """The cases below are the rules load applies to a snapshot's values, all of them."""
    assert sorted(CASES) == sorted(rule.name for rule in RULES)


def _refused_save(state: af.TrainState, path: Path) -> str:
    with pytest.raises(CheckpointError) as error:
        af.save(state, path)
    assert str(error.value).startswith(f"{path}: not written: af.load would refuse a checkpoint of this state")
    assert not path.exists() and not list(path.parent.iterdir()), "the refused save left something on disk"
    return str(error.value)


def _edited(path: Path, edit: Edit) -> None:
    manifest = orjson.loads((path / "manifest.json").read_bytes())
    edit(manifest)
    data = orjson.dumps(manifest)
    (path / "manifest.json").write_bytes(data)
    (path / "manifest.sha256").write_text(f"{hashlib.sha256(data).hexdigest()}  manifest.json\n")


@pytest.mark.parametrize("rule", sorted(CASES))
def test_save_refuses_what_load_refuses_before_writing_anything(rule: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A state that breaks the rule is refused by af.save with nothing written, and a valid
    checkpoint edited to break it is refused by af.load, both errors naming the same problem."""
    make, edit, problem = CASES[rule]
    _edited(af.save(build(0), tmp_path / "valid" / "ckpt"), edit)
    with pytest.raises(CheckpointError) as loaded:
        af.load(tmp_path / "valid" / "ckpt", into=build(0))
    assert f"\n  {problem}" in str(loaded.value), str(loaded.value)
    state = make()
    if rule == "rng":  # the global generators' states captured with torch's cut to one byte
        capture = _rng.capture
        monkeypatch.setattr(_rng, "capture", lambda: attrs.evolve(capture(), torch_cpu="00"))
    (tmp_path / "save").mkdir()
    saved = _refused_save(state, tmp_path / "save" / "ckpt")
    assert f"\n  {problem}" in saved, saved


def test_a_record_save_would_write_but_load_refuse_is_refused_by_the_save(tmp_path: Path) -> None:
    """A window whose sample count is a numpy int (a value its record's annotation refuses on
    decoding) makes af.save refuse, by the decoding load runs, and write nothing."""
    window = Window(reference=8.0, count=4, num_samples=np.int64(4), loss_sum=torch.tensor(1.0))
    state = build(0).replace(step=0, micro_step=1, transforms_state={"window": window})
    (tmp_path / "save").mkdir()
    saved = _refused_save(state, tmp_path / "save" / "ckpt")
    assert "ranks[0].transforms_state.window.num_samples: np.int64(4) (an int64), must be int" in saved, saved


def test_a_state_that_keeps_the_rules_saves_and_loads(tmp_path: Path) -> None:
    """The rules refuse nothing a run writes: a state with every counter at its smallest
    consistent value, a stop record and a scheduler saves and loads back."""
    state = build(0).replace(step=2, micro_step=2, epoch=1, epoch_micro_step=0, stopped=Stopped(2, "done"))
    loaded = af.load(af.save(state, tmp_path / "ckpt"), into=build(1))
    assert (loaded.step, loaded.micro_step, loaded.epoch, loaded.epoch_micro_step) == (2, 2, 1, 0)
    assert loaded.stopped == Stopped(2, "done")
