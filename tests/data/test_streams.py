"""Streams under shard_data() in one process: every item read once per epoch whatever the
DataLoader workers, and a resumed epoch that continues from its readers' saved state (the
checkpoint's ``data_state``, plain JSON) instead of reading the stream again.

The same on 2 and 3 real processes: tests/data/test_streams_ranks.py.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import accelfn as af
from accelfn.data import streams
from accelfn.transforms import ShardData
from tests.helpers import streams as S

CPU = af.backends.CPU(af.backends.LaunchEnv())


def _loader(kind: str, log: Path, *, workers: int, shards: int = 4, cls: type[DataLoader] = DataLoader,
            **options: Any) -> DataLoader:
    dataset: Any = {"hf": lambda: S.hf_stream(shards), "stream": S.Stream,
                    "hf_shuffled": lambda: S.hf_stream(shards).shuffle(seed=1, buffer_size=8), "stateful": lambda: S.StatefulStream(log=str(log)),
                    "items": S.Items}[kind]()
    return cls(dataset, batch_size=S.BATCH, num_workers=workers, collate_fn=S.Collate(log), **options)


def _hf_rule_warnings(shards: int, workers: int) -> list[str]:
    return ["read nothing"] if workers > shards else []


@pytest.mark.filterwarnings(S.MANY_WORKERS)
@pytest.mark.parametrize("workers", [0, 1, 2, 3])
@pytest.mark.parametrize(("kind", "shards"), [("hf", 4), ("hf", 1), ("stream", 1)])
def test_every_item_is_read_once_per_epoch(tmp_path: Path, kind: str, shards: int, workers: int) -> None:
    """One process, 0-3 DataLoader workers, a datasets stream of 4 shards or 1 (then workers
    beyond the first read nothing, a RuntimeWarning says so) or a torch IterableDataset: each
    of the 48 items is collated once in the epoch, and each batch reaches the step once."""
    loader = _loader(kind, tmp_path, workers=workers, shards=shards)
    expected = _hf_rule_warnings(shards, workers) if kind == "hf" else []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = CPU.batches(loader, af.shard_data()(af.train_step(S.loss_fn([]))), 0)
        seen = [int(i) for batch, _ in batches for i in batch["id"]]
    ours = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(ours) == len(expected) and all(e in m for e, m in zip(expected, ours)), ours
    assert sorted(seen) == list(range(S.N))
    assert sorted(S.logged(tmp_path)) == list(range(S.N))


def test_the_rule_where_processes_outnumber_shards(tmp_path: Path) -> None:
    """Rank r of 3 processes over a stream of 4 shards: datasets' split gives it every 3rd
    example (each process streams every shard; a RuntimeWarning on rank 0 says so): the
    three ranks together read each item once."""
    loader = _loader("hf", tmp_path, workers=0)
    reads: list[int] = []
    for rank in range(3):
        if rank == 0:
            with pytest.warns(RuntimeWarning, match="4 shards, which do not divide over 3 processes"):
                batches = af.data.epoch_batches(loader, ShardData(), rank=rank, world_size=3, epoch=0)
        else:
            batches = af.data.epoch_batches(loader, ShardData(), rank=rank, world_size=3, epoch=0)
        mine = [int(i) for batch, _ in batches for i in batch["id"]]
        assert mine == list(range(rank, S.N, 3))
        reads += mine
    assert sorted(reads) == sorted(S.logged(tmp_path)) == list(range(S.N))


def test_a_stream_already_split_over_processes_is_refused() -> None:
    """A datasets stream already split with split_dataset_by_node would be split twice (most of
    it never read): refused, naming the fix."""
    datasets = S.datasets_module()
    split = datasets.distributed.split_dataset_by_node(S.hf_stream(4), rank=0, world_size=2)
    with pytest.raises(ValueError, match="already split with split_dataset_by_node"):
        CPU.batches(DataLoader(split, batch_size=4), af.shard_data()(af.train_step(S.loss_fn([]))), 0)


def test_evaluate_refuses_a_datasets_stream_read_by_workers() -> None:
    """evaluate() keys outputs by stream position, which datasets' per-worker shards lose: refused."""
    state = S.fresh_state()
    with pytest.raises(ValueError, match="evaluate it with num_workers=0"):
        af.evaluate(lambda m, b: m(b["x"].float()), state, DataLoader(S.hf_stream(4), batch_size=4, num_workers=2),
                    backend=CPU)


def _run(loader: DataLoader, *, shard: bool = True, stop: int | None = None, path: Path | None = None,
         workers_after: int | None = None, log: Path | None = None) -> tuple[list[int], list[int], af.TrainState]:
    """Trains 1 epoch of ``loader``; with ``stop``, first ``stop`` updates, an af.save, and an
    af.load into a fresh state that trains on (its reads logged apart). Returns the ids the
    step saw before and after the stop, and the final state."""
    before: list[int] = []
    after: list[int] = []
    step = af.train_step(S.loss_fn(before))
    step = af.shard_data()(step) if shard else step
    state = S.fresh_state()
    if stop is not None:
        assert path is not None and log is not None
        state = af.run(step, state, loader, backend=CPU, epochs=1, max_steps=stop, progress=False)
        af.save(state, path)
        (log / "before").mkdir()
        for f in log.glob("*-*"):
            f.rename(log / "before" / f.name)
        state = af.load(path, into=S.fresh_state())
        if workers_after is not None:
            loader = DataLoader(loader.dataset, batch_size=S.BATCH, num_workers=workers_after,
                                collate_fn=loader.collate_fn)
        step = af.train_step(S.loss_fn(after))
        step = af.shard_data()(step) if shard else step
    state = af.run(step, state, loader, backend=CPU, epochs=1, progress=False)
    return before, after, state


RESUMED = [("hf", 0), ("hf", 2), ("stateful", 0), ("stateful", 2)]


@pytest.mark.parametrize(("kind", "workers"), RESUMED)
def test_a_resumed_epoch_continues_the_stream_from_its_readers_state(tmp_path: Path, kind: str, workers: int) -> None:
    """Stopped after 5 updates, saved with af.save and loaded with af.load into a fresh state,
    a run reads exactly the batches the uninterrupted one reads after its 5th, trains to the
    same parameters bitwise, and its readers read (collate) only the items not consumed
    before the stop: none again (the lookahead batch is within one batch per reader)."""
    if workers:
        S.torchdata_loader()
    whole_log, log = tmp_path / "whole", tmp_path / "log"
    whole_log.mkdir(), log.mkdir()
    whole, _, uninterrupted = _run(_loader(kind, whole_log, workers=workers))
    before, after, resumed = _run(_loader(kind, log, workers=workers), stop=5, path=tmp_path / "ckpt", log=log)
    assert before == whole[:5 * S.BATCH] and after == whole[5 * S.BATCH:]
    assert torch.equal(resumed.model.weight, uninterrupted.model.weight)
    reread = Counter(S.logged(log)) & Counter(before)
    assert sum(reread.values()) == 0
    assert sorted(S.logged(log)) == sorted(after)
    saved = json.loads((tmp_path / "ckpt" / "manifest.json").read_bytes())["ranks"][0]["data_state"]
    assert {k: saved[k] for k in ("reader", "world_size", "rank", "num_workers", "epoch")} == {
        "reader": "shard_data", "world_size": 1, "rank": 0, "num_workers": workers, "epoch": 0}
    if kind == "stateful" and workers == 0:  # the dataset itself resumed at its saved position
        assert S.logged(log, "inner") == list(range(5 * S.BATCH, S.N)) and saved["state"]["dataset"] == {"next": 20}


def test_a_stream_without_state_is_read_again_up_to_its_position(tmp_path: Path) -> None:
    """An IterableDataset without state_dict() resumes exactly too, its readers reading the
    stream again up to their positions (a RuntimeWarning says so and how to avoid it)."""
    whole_log, log = tmp_path / "whole", tmp_path / "log"
    whole_log.mkdir(), log.mkdir()
    whole, _, uninterrupted = _run(_loader("stream", whole_log, workers=0))
    with pytest.warns(RuntimeWarning, match="without state_dict"):
        before, after, resumed = _run(_loader("stream", log, workers=0), stop=5, path=tmp_path / "ckpt", log=log)
    assert before + after == whole and torch.equal(resumed.model.weight, uninterrupted.model.weight)
    assert sorted(S.logged(log)) == sorted(after)  # collated once; the replay happens before collation


@pytest.mark.parametrize("kind", ["stateful", "items"])
def test_a_stateful_dataloader_without_shard_data_resumes_from_its_own_state(tmp_path: Path, kind: str) -> None:
    """The user's own torchdata StatefulDataLoader (a stream, or shuffle=True over a map-style
    dataset), read without shard_data(): the checkpoint holds its state_dict(), and the
    resumed run reads the uninterrupted run's batches, none again."""
    loader_class = S.torchdata_loader()
    whole_log, log = tmp_path / "whole", tmp_path / "log"
    whole_log.mkdir(), log.mkdir()
    options = {"shuffle": True, "generator": torch.Generator().manual_seed(3)} if kind == "items" else {}
    whole, _, uninterrupted = _run(_loader(kind, whole_log, workers=0, cls=loader_class, **options), shard=False)
    options = {"shuffle": True, "generator": torch.Generator().manual_seed(3)} if kind == "items" else {}
    before, after, resumed = _run(_loader(kind, log, workers=0, cls=loader_class, **options), shard=False, stop=5,
                                  path=tmp_path / "ckpt", log=log)
    assert before + after == whole and torch.equal(resumed.model.weight, uninterrupted.model.weight)
    assert sorted(S.logged(log)) == sorted(after)
    saved = json.loads((tmp_path / "ckpt" / "manifest.json").read_bytes())["ranks"][0]["data_state"]
    assert saved["reader"] == "loader" and saved["state"]["_num_yielded"] == 5


def test_shard_data_takes_a_stateful_dataloader_that_shuffles() -> None:
    """shard_data() shards a StatefulDataLoader(shuffle=True) as it shards DataLoader(shuffle=True):
    the same batches (it was refused, as if it had no shuffle=True)."""
    loader_class = S.torchdata_loader()
    step = af.shard_data(seed=4)(af.train_step(S.loss_fn([])))
    ids = [[b["id"].tolist() for b, _ in CPU.batches(cls(S.Items(), batch_size=S.BATCH, shuffle=True), step, 1)]
           for cls in (DataLoader, loader_class)]
    assert ids[0] == ids[1] and sorted(sum(ids[0], [])) == list(range(S.N))
    from torchdata.stateful_dataloader.sampler import RandomSampler
    drawing = loader_class(S.Items(), batch_size=4, sampler=RandomSampler(S.Items(), replacement=True))
    with pytest.raises(ValueError, match="RandomSampler that draws with replacement"):
        CPU.batches(drawing, step, 0)


@pytest.mark.filterwarnings(S.MANY_WORKERS)
def test_readers_that_differ_resume_by_reading_the_epoch_again(tmp_path: Path) -> None:
    """Saved with 2 workers and resumed with 0, the readers' state does not apply (the stream's
    order depends on the readers): the resumed run reads its first 5 batches again and skips
    them, and a RuntimeWarning says so and why."""
    S.torchdata_loader()
    log = tmp_path / "log"
    log.mkdir()
    with pytest.warns(RuntimeWarning, match="num_workers 2 in the checkpoint, 0 here"):
        _, after, _ = _run(_loader("hf", log, workers=2), stop=5, path=tmp_path / "ckpt", workers_after=0, log=log)
    assert after == list(range(5 * S.BATCH, S.N))  # one process's order, from its 6th batch
    assert sorted(S.logged(log)) == list(range(S.N))  # the whole epoch collated again


def test_without_torchdata_workers_resume_by_reading_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without torchdata a stream read by workers has no state to save: a resumed epoch reads its
    first batches again and skips them, exactly, and a RuntimeWarning says to install torchdata."""
    monkeypatch.setattr(streams, "stateful_loader_class", lambda: None)
    whole_log, log = tmp_path / "whole", tmp_path / "log"
    whole_log.mkdir(), log.mkdir()
    whole, _, uninterrupted = _run(_loader("hf", whole_log, workers=2))
    with pytest.warns(RuntimeWarning, match="can be saved only with torchdata installed"):
        before, after, resumed = _run(_loader("hf", log, workers=2), stop=5, path=tmp_path / "ckpt", log=log)
    assert before + after == whole and torch.equal(resumed.model.weight, uninterrupted.model.weight)
    assert json.loads((tmp_path / "ckpt" / "manifest.json").read_bytes())["ranks"][0].get("data_state") is None


class _Opaque:
    pass


def test_a_readers_state_that_is_not_json_and_tensors_is_refused_at_the_save(tmp_path: Path) -> None:
    """A dataset whose state_dict() holds an object (which only pickle could store) is refused
    at the save, naming where and what to return instead; nothing is written."""

    class Odd(S.StatefulStream):
        def state_dict(self) -> dict[str, Any]:
            return {"next": self.next, "cursor": _Opaque()}

    loader = DataLoader(Odd(), batch_size=S.BATCH)
    state = af.run(af.shard_data()(af.train_step(S.loss_fn([]))), S.fresh_state(), loader, backend=CPU, epochs=1,
                   max_steps=2, progress=False)
    with pytest.raises(TypeError, match=r"cannot save 'data_state\.state\.dataset\.cursor'.*never pickled"):
        af.save(state, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("workers", [0, 2])
def test_run_called_again_continues_the_stream_of_the_live_state(tmp_path: Path, workers: int) -> None:
    """A run stopped by max_steps keeps its readers in the state (data_state): run again on the
    same state, it continues the stream from them (no save in between), reading nothing again."""
    if workers:
        S.torchdata_loader()
    whole_log, log = tmp_path / "whole", tmp_path / "log"
    whole_log.mkdir(), log.mkdir()
    whole, _, _ = _run(_loader("hf", whole_log, workers=workers))
    seen: list[int] = []
    step = af.shard_data()(af.train_step(S.loss_fn(seen)))
    loader = _loader("hf", log, workers=workers)
    state = af.run(step, S.fresh_state(), loader, backend=CPU, epochs=1, max_steps=5, progress=False)
    assert isinstance(state.data_state, af.data.Readers)
    consumed = list(seen)
    S.clear(log)
    state = af.run(step, state, loader, backend=CPU, epochs=1, progress=False)
    assert seen == whole and state.data_state is None
    assert sorted(S.logged(log)) == sorted(whole[len(consumed):])


def test_a_shuffled_datasets_stream_resumes_by_reading_again(tmp_path: Path) -> None:
    """datasets' state_dict() does not keep an IterableDataset.shuffle() buffer (a resume from it
    loses those examples), so a shuffled stream resumes by reading its first batches again: the
    same seed gives the same order, the run is exact, and a RuntimeWarning says why."""
    whole_log, log = tmp_path / "whole", tmp_path / "log"
    whole_log.mkdir(), log.mkdir()
    whole, _, uninterrupted = _run(_loader("hf_shuffled", whole_log, workers=0))
    assert sorted(whole) == list(range(S.N)) and whole != list(range(S.N))
    with pytest.warns(RuntimeWarning, match=r"IterableDataset\.shuffle\(\) buffer"):
        before, after, resumed = _run(_loader("hf_shuffled", log, workers=0), stop=5, path=tmp_path / "ckpt", log=log)
    assert before + after == whole and torch.equal(resumed.model.weight, uninterrupted.model.weight)


class _LiveState(S.StatefulStream):
    """A stream whose state_dict() hands out the very dict its iterator goes on updating."""

    def __init__(self) -> None:
        super().__init__()
        self.live = {"next": 0}

    def state_dict(self) -> dict[str, int]:
        return self.live

    def __iter__(self) -> Any:
        for item in super().__iter__():
            self.live["next"] = self.next
            yield item


@pytest.mark.parametrize("shard", [True, False])
def test_a_state_dict_that_goes_on_changing_is_saved_as_it_was(tmp_path: Path, shard: bool) -> None:
    """A dataset whose state_dict() returns a dict it keeps updating: the state kept for the
    batches consumed is a copy, not the live dict a batch ahead, so the resume skips nothing
    (under shard_data, and in a StatefulDataLoader of one's own)."""
    loader_class = S.torchdata_loader() if not shard else DataLoader
    whole_log, log = tmp_path / "whole", tmp_path / "log"
    whole_log.mkdir(), log.mkdir()
    whole, _, _ = _run(loader_class(_LiveState(), batch_size=S.BATCH, collate_fn=S.Collate(whole_log)), shard=shard)
    before, after, _ = _run(loader_class(_LiveState(), batch_size=S.BATCH, collate_fn=S.Collate(log)), shard=shard,
                            stop=5, path=tmp_path / "ckpt", log=log)
    assert before + after == whole == list(range(S.N))
