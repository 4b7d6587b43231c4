"""Streams for the tests of ``accelfn.data.streams``: items that say which they are, and the reads
counted from any process (a DataLoader worker's too).

Item ``i`` is ``{"id": i, "x": [i / N, 1.0]}``. A *read* is an item a reader collated into a
batch (:class:`Collate` appends the batch's ids to a file of its process in a log
directory): what a resumed run must not read again. :class:`StatefulStream` also logs what
its own iterator yields (``inner-*`` files), to show where it resumed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate

import accelfn as af

N, BATCH = 48, 4
#: torch's own warning for more DataLoader workers than the machine's CPUs (2 here)
MANY_WORKERS = "ignore:This DataLoader will create:UserWarning"


def datasets_module() -> Any:
    """The ``datasets`` package, or the test is skipped with the reason."""
    return pytest.importorskip("datasets", reason="streaming tests of Hugging Face datasets need `datasets` "
                                                  "(pip install 'accelfn[streaming]'; .ci/run installs it)")


def torchdata_loader() -> type[DataLoader]:
    """torchdata's StatefulDataLoader, or the test is skipped with the reason."""
    module = pytest.importorskip("torchdata.stateful_dataloader",
                                 reason="resuming streams read by DataLoader workers needs torchdata "
                                        "(pip install 'accelfn[streaming]'; .ci/run installs it)")
    return module.StatefulDataLoader


def item(i: int) -> dict[str, Any]:
    return {"id": i, "x": [i / N, 1.0]}


def _shards(shards: list[int], per: int) -> Any:
    for s in shards:
        for i in range(s * per, (s + 1) * per):
            yield item(i)


def hf_stream(num_shards: int, n: int = N) -> Any:
    """A ``datasets.IterableDataset`` of items ``0..n-1`` in ``num_shards`` shards (as files are)."""
    datasets = datasets_module()
    return datasets.IterableDataset.from_generator(
        _shards, gen_kwargs={"shards": list(range(num_shards)), "per": n // num_shards}).with_format("torch")


def _tensors(i: int) -> dict[str, torch.Tensor]:
    return {"id": torch.tensor(i), "x": torch.tensor([i / N, 1.0])}


class Stream(IterableDataset):
    """Items ``0..n-1``, without a state of its own."""

    def __init__(self, n: int = N):
        self.n = n

    def __iter__(self) -> Any:
        return (_tensors(i) for i in range(self.n))


class StatefulStream(Stream):
    """Items ``0..n-1`` with ``state_dict``/``load_state_dict`` (the next item), logging each
    item its iterator yields to ``log/inner-<pid>``."""

    def __init__(self, n: int = N, log: str | None = None):
        super().__init__(n)
        self.log, self.next, self._resume = log, 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume = state["next"]

    def __iter__(self) -> Any:
        start, self._resume = self._resume, 0
        for i in range(start, self.n):
            self.next = i + 1
            if self.log is not None:
                _append(Path(self.log) / f"inner-{os.getpid()}", [i])
            yield _tensors(i)


def _append(path: Path, ids: list[int]) -> None:
    with open(path, "a") as f:
        f.write("".join(f"{i}\n" for i in ids))


class Collate:
    """``default_collate``, logging each batch's ids to ``log/reads-<pid>`` (picklable)."""

    def __init__(self, log: str | os.PathLike[str]):
        self.log = str(log)

    def __call__(self, items: list[Any]) -> Any:
        batch = default_collate(items)
        _append(Path(self.log) / f"reads-{os.getpid()}", [int(i) for i in batch["id"]])
        return batch


def logged(log: Path, kind: str = "reads") -> list[int]:
    """Every id logged under ``log`` (by any process) as ``kind`` ("reads" or "inner")."""
    return [int(line) for path in sorted(log.glob(f"{kind}-*")) for line in path.read_text().split()]


def clear(log: Path) -> None:
    for path in log.glob("*-*"):
        path.unlink()


def loss_fn(seen: list[int]) -> Any:
    """A loss over a stream's batches that appends each batch's ids to ``seen``."""
    def loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        seen.extend(int(i) for i in batch["id"])
        x = batch["x"].float()
        return torch.nn.functional.mse_loss(model(x), x[:, :1] * 2 - 1)
    return loss


def fresh_state() -> af.TrainState:
    """The same model and optimizer every time."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))


class Items(torch.utils.data.Dataset):
    """Items ``0..n-1``, map-style."""

    def __init__(self, n: int = N):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return _tensors(i)
