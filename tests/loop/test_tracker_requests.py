"""What a tracker can ask of ``run`` besides receiving points: the checkpoints it writes
(``saved(path, step)``) and a checkpoint now (``save_requested``, read on trackers that run
on every rank), the hooks af.RayTrain relies on."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import accelfn as af
from tests.helpers.models import classification_data, make_mlp


class Requesting:
    """A tracker called on every rank that asks for a checkpoint at the points of ``at``
    and records the checkpoints it is handed."""

    every_rank = True

    def __init__(self, at: set[int]):
        self.at = at
        self.save_requested = False
        self.saved_at: list[tuple[str, int, bool]] = []

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.save_requested = step in self.at

    def saved(self, path: Path, step: int) -> None:
        self.saved_at.append((path.name, step, (path / "manifest.json").is_file()))
        self.save_requested = False

    def close(self) -> None:
        pass


def test_a_tracker_is_handed_each_checkpoint_and_can_request_one(tmp_path: Path, cpu: af.backends.Backend) -> None:
    """``run`` hands a tracker each complete checkpoint it writes (periodic ones and those the
    tracker requested through ``save_requested`` at a log point), and a requested one
    resumes bitwise like any other."""
    loader = torch.utils.data.DataLoader(classification_data(32), batch_size=4)  # 8 updates an epoch

    def train(state: af.TrainState, trackers: list, directory: Path, resume: Path | None = None) -> af.TrainState:
        step = af.train_step(lambda m, b: F.cross_entropy(m(b[0]), b[1]))
        return af.run(step, state, loader, backend=cpu, epochs=2, trackers=trackers, progress=False, log_every=3,
                      checkpoints=af.Checkpoints(directory, every_steps=8), resume=resume)

    def fresh() -> af.TrainState:
        torch.manual_seed(0)
        model = make_mlp()
        return af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))

    tracker = Requesting(at={3, 9})
    whole = train(fresh(), [tracker], tmp_path / "a")
    # requested at the log points 3 and 9, periodic at 8 and 16; nothing requested at 6, 12, 15
    assert tracker.saved_at == [("step_00000003", 3, True), ("step_00000008", 8, True),
                                ("step_00000009", 9, True), ("step_00000016", 16, True)]
    resumed = train(fresh(), [], tmp_path / "b", resume=tmp_path / "a" / "step_00000009")
    for a, b in zip(whole.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


def test_a_main_process_tracker_cannot_request_a_checkpoint(tmp_path: Path, cpu: af.backends.Backend) -> None:
    """``save_requested`` is read only on trackers called on every rank (a request seen by one
    rank alone would make the ranks save at different updates)."""
    tracker = Requesting(at={3})
    tracker.every_rank = False  # type: ignore[misc]
    torch.manual_seed(0)
    model = make_mlp()
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    af.run(af.train_step(lambda m, b: F.cross_entropy(m(b[0]), b[1])), state,
           torch.utils.data.DataLoader(classification_data(32), batch_size=4), backend=cpu, trackers=[tracker],
           progress=False, log_every=3, checkpoints=af.Checkpoints(tmp_path, every_steps=8))
    assert [s for _, s, _ in tracker.saved_at] == [8]


@pytest.mark.skipif(__import__("importlib").util.find_spec("ray") is not None, reason="Ray is installed here")
def test_ray_train_without_ray_names_the_extra() -> None:
    """af.RayTrain without Ray installed raises ImportError naming ``accelfn[ray]``."""
    with pytest.raises(ImportError, match=r"accelfn\[ray\]"):
        af.RayTrain()
