"""``backend.eval_batches(loader)``: a loader sharded for an evaluation loop of one's own,
without a training Step, in one process and in two (tests/workers/eval_batches.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import accelfn as af
from tests.helpers import launch as _launch
from tests.helpers import programs as P
from tests.helpers.pool import Pools

CPU = af.backends.CPU(af.backends.LaunchEnv())


def test_one_process_reads_every_sample_once_in_order_and_gathers_them_unchanged() -> None:
    """5 samples at batch 2 give [0, 1], [2, 3], [4]; gather_for_metrics returns each batch as it is."""
    seen, gathered = [], []
    for batch in CPU.eval_batches(DataLoader(torch.arange(5), batch_size=2)):
        seen.append(batch.tolist())
        gathered.append(CPU.gather_for_metrics(batch).tolist())
    assert seen == gathered == [[0, 1], [2, 3], [4]]


def test_eval_batches_keeps_the_loaders_collate_function() -> None:
    """The DataLoader's collate function builds the batches (here a dict of index and square)."""
    loader = DataLoader(P.IndexDataset(3), batch_size=2,
                        collate_fn=lambda items: {"i": torch.tensor([i for _, i in items])})
    assert [b["i"].tolist() for b in CPU.eval_batches(loader)] == [[0, 1], [2]]


def test_eval_batches_refuses_data_it_cannot_shard_by_samples() -> None:
    """A list, an IterableDataset, a batch sampler, drop_last=True: each names the problem (the
    first two point to af.evaluate)."""
    with pytest.raises(TypeError, match=r"eval_batches\(\) takes a torch.utils.data.DataLoader, got list; .*af.evaluate"):
        CPU.eval_batches([torch.ones(2)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"map-style dataset .* for an IterableDataset use af.evaluate"):
        CPU.eval_batches(DataLoader(P.CountingStream(4), batch_size=2))
    batch_sampler = torch.utils.data.BatchSampler(range(4), batch_size=2, drop_last=False)
    with pytest.raises(ValueError, match=r"batch_size=None \(a custom batch_sampler"):
        CPU.eval_batches(DataLoader(torch.arange(4), batch_sampler=batch_sampler))
    with pytest.raises(ValueError, match=r"cannot honour drop_last=True; build the evaluation DataLoader with "
                                         r"drop_last=False"):
        CPU.eval_batches(DataLoader(torch.arange(5), batch_size=3, drop_last=True))


@pytest.mark.multiprocess
def test_two_ranks_read_their_padded_shards_and_gather_for_metrics_drops_the_padding(pool: Pools,
                                                                                     tmp_path: Any) -> None:
    """11 samples at batch 4 on 2 ranks: rank 0 reads 0,2,..,10, rank 1 reads 1,3,..,9 then 0 (padding);
    gather_for_metrics gives every rank 8 then 3 values, sample 0 only once."""
    pool.launch("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60", script="eval_batches.py",
                script_args=("--out", tmp_path), cwd=tmp_path)
    ranks = _launch.read_ranks(tmp_path, 2)
    assert ranks[0]["seen"] == [[0, 2, 4, 6], [8, 10]]
    assert ranks[1]["seen"] == [[1, 3, 5, 7], [9, 0]]
    for rank in ranks:
        assert rank["gathered"] == [[0, 20, 40, 60, 10, 30, 50, 70], [80, 100, 90]]
