"""Streams under shard_data() + replicate() on 2 and 3 real processes (the pool's started workers):
every item read once per epoch for 0-3 DataLoader workers over 4 shards and over 1, and a run
resumed from a checkpoint (Checkpoints + resume="auto") that reads the uninterrupted run's
batches, re-reading nothing it had consumed.

One process: tests/data/test_streams.py.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import streams as S
from tests.helpers.pool import Pools

pytestmark = pytest.mark.multiprocess

WORKERS = [0, 1, 2, 3]
STREAM_WORKERS = [0, 2]  # the round-robin deal of a torch IterableDataset (0-3 workers: one process's test)


def _pool(world_size: int) -> tuple[str, ...]:
    return ("--backend", "cpu", "--nproc-per-node", str(world_size), "--timeout-s", "60")


@pytest.fixture(scope="module", params=[2, 3], ids=["2-processes", "3-processes"])
def read(request: pytest.FixtureRequest, pool: Pools,
         tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path, list[dict[str, list[list[int]]]]]:
    S.datasets_module()
    S.torchdata_loader()
    world_size = request.param
    out = tmp_path_factory.mktemp(f"streams{world_size}")
    configs = [(kind, w) for kind in ("hf4", "hf1") for w in WORKERS] + [("stream", w) for w in STREAM_WORKERS]
    ranks = pool.call(*_pool(world_size), function="streams:read_once", out=str(out), configs=configs, timeout_s=240)
    return world_size, out, ranks


@pytest.mark.parametrize(("kind", "workers"), [(kind, w) for kind in ("hf4", "hf1") for w in WORKERS]
                         + [("stream", w) for w in STREAM_WORKERS])
def test_every_item_is_read_once_per_epoch_on_every_world_size(read: Any, kind: str, workers: int) -> None:
    """2 or 3 processes x 0-3 DataLoader workers over a datasets stream of 4 shards or 1 (and a
    torch IterableDataset, dealt round-robin): the readers of all processes collate each of
    the 48 items exactly once; every rank runs the same number of batches, the step getting
    each item once but for whole batches a rank that ran out replays (its first, as
    DistributedSampler pads)."""
    _, out, ranks = read
    name = f"{kind}-{workers}"
    assert sorted(S.logged(out / name)) == list(range(S.N))
    batches = [rank[name] for rank in ranks]
    assert len({len(b) for b in batches}) == 1
    real = []
    for mine in batches:
        while len(mine) > 1 and mine[-1] == mine[0]:  # a replay (items are unique, so no real batch repeats)
            mine = mine[:-1]
        real += [i for batch in mine for i in batch]
    assert sorted(real) == list(range(S.N))


@pytest.mark.parametrize(("world_size", "kind", "workers", "parallel"),
                         [(2, "hf4", 2, "replicate"), (2, "stateful", 2, "replicate"), (3, "hf1", 0, "replicate"),
                          (2, "hf4", 0, "shard_params")])
def test_a_run_resumed_from_its_checkpoint_reads_the_uninterrupted_batches(
        pool: Pools, tmp_path: Path, world_size: int, kind: str, workers: int, parallel: str) -> None:
    """Stopped after 3 updates with a checkpoint (Checkpoints + max_steps) and resumed by a fresh
    state (resume="auto"), also from a sharded checkpoint (shard_params): on every rank the
    step sees exactly the batches the uninterrupted run sees after its 3rd, the parameters
    are bitwise the same, and the resumed readers collate only items not consumed before the
    stop (at most one batch per reader again; here none)."""
    S.datasets_module()
    S.torchdata_loader()
    ranks = pool.call(*_pool(world_size), function="streams:resume", out=str(tmp_path), kind=kind, workers=workers,
                      stop=3, parallel=parallel, timeout_s=240)
    for rank in ranks:
        assert rank["part"] == rank["whole"][:3 * S.BATCH] and rank["rest"] == rank["whole"][3 * S.BATCH:]
        assert rank["same"] and rank["sharded"] == (parallel == "shard_params")
    consumed = Counter(i for rank in ranks for i in rank["part"])
    reads = S.logged(tmp_path / "rest")
    reread = Counter(reads) & consumed
    assert sum(reread.values()) <= world_size * max(workers, 1) * S.BATCH
    assert sum(reread.values()) == 0 and sorted(reads) == sorted(set(range(S.N)) - set(consumed))
