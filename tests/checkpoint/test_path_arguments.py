"""Path arguments are checked when given, before any training, not at their first write."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import accelfn as af

CPU = af.backends.CPU(af.backends.LaunchEnv())


class _Count:
    """A tracker counting the updates it is given."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def log(self, metrics: object, step: int) -> None:
        self.steps.append(step)

    def close(self) -> None:
        pass


def _job() -> tuple[af.Step, af.TrainState, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(10)]
    return af.train_step(lambda m, b: F.mse_loss(m(b[0]), b[1])), state, data


def test_checkpoints_in_a_file_are_refused_when_made(tmp_path) -> None:
    """Checkpoints(a file) and Checkpoints(a path under a file) raise ValueError at once."""
    (tmp_path / "not_a_dir").write_text("x")
    with pytest.raises(ValueError) as error:
        af.Checkpoints(tmp_path / "not_a_dir", every_steps=5)
    assert str(error.value) == (
        f"Checkpoints({str(tmp_path / 'not_a_dir')!r}): {tmp_path / 'not_a_dir'} is a file, not a directory; "
        "give a directory (it is created if missing)")
    with pytest.raises(ValueError, match=r"/not_a_dir/ckpt cannot be created, since .*/not_a_dir is a file"):
        af.Checkpoints(tmp_path / "not_a_dir" / "ckpt", every_steps=5)


def test_a_checkpoint_directory_that_became_a_file_is_refused_before_the_first_step(tmp_path) -> None:
    """run checks the directory again: no update is applied, no point logged, no parameter moves."""
    step, state, data = _job()
    checkpoints = af.Checkpoints(tmp_path / "ckpt", every_steps=5)
    (tmp_path / "ckpt").write_text("x")
    weight = state.model.weight.detach().clone()
    count = _Count()
    with pytest.raises(ValueError, match=r"^run\(checkpoints=Checkpoints\(.*\)\): .*/ckpt is a file, not a directory"):
        af.run(step, state, data, backend=CPU, checkpoints=checkpoints, trackers=[count], log_every=1,
               progress=False)
    assert (count.steps, state.step) == ([], 0)
    assert torch.equal(state.model.weight, weight)


@pytest.mark.parametrize(("make", "what"), [
    (lambda p: af.TensorBoard(p / "tb"), "TensorBoard(logdir="),
    (lambda p: af.JSONL(p / "metrics.jsonl"), "JSONL(path="),
    (lambda p: af.Checkpoints(p / "ckpt"), "Checkpoints("),
])
def test_trackers_and_checkpoints_under_a_file_are_refused_when_made(tmp_path, make, what) -> None:
    """A tracker or checkpoint path whose parent is a file raises at construction, naming both."""
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError) as error:
        make(tmp_path / "file")
    assert str(error.value).startswith(what)
    assert str(error.value).endswith(f"cannot be created, since {tmp_path / 'file'} is a file, not a directory")


def test_save_under_a_file_is_refused_before_writing(tmp_path) -> None:
    """af.save to a path under a file raises ValueError naming the file (not a raw FileExistsError)."""
    _, state, _ = _job()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError) as error:
        af.save(state, tmp_path / "file" / "ckpt")
    assert str(error.value) == (f"save(path={str(tmp_path / 'file' / 'ckpt')!r}): {tmp_path / 'file' / 'ckpt'} "
                                f"cannot be created, since {tmp_path / 'file'} is a file, not a directory")


@pytest.mark.parametrize(("make", "what"), [
    (lambda p: af.TensorBoard(p / "tb"), "TensorBoard(logdir="),
    (lambda p: af.JSONL(p / "metrics.jsonl"), "JSONL(path="),
    (lambda p: af.Checkpoints(p / "ckpt"), "Checkpoints("),
    (lambda p: af.Profile(p / "profile"), "Profile("),
])
def test_paths_where_no_file_can_be_made_are_refused_even_for_root(make, what) -> None:
    """Under /sys no file can be made, whatever the permission bits say (the tests run as root,
    for whom they always say yes): the path is refused when given, naming the directory."""
    with pytest.raises(PermissionError) as error:
        make(Path("/sys"))
    assert str(error.value).startswith(what)
    assert " cannot be written, since /sys refuses new files (" in str(error.value)


def test_a_writable_directory_is_accepted_and_left_as_it_was(tmp_path) -> None:
    """Checking a path tries a file in the nearest existing directory and removes it."""
    af.Checkpoints(tmp_path / "a" / "ckpt", every_steps=5)
    af.JSONL(tmp_path / "metrics.jsonl")
    assert list(tmp_path.iterdir()) == []
