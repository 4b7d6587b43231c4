"""DataLoader workers under shard_data() on 2 real processes: each rank and epoch draws its own
augmentations, and a resumed epoch draws the same ones again."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers import launch as _launch
from tests.helpers.pool import Pools

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def seeds(pool: Pools, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("worker_seeds")
    pool.launch("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60", script="worker_seeds.py",
                script_args=("--out", out), cwd=out)
    return _launch.read_ranks(out, 2)


def _draws(batches: list[list[list[float]]]) -> list[float]:
    return [v for _, torch_noise, numpy_noise in batches for v in torch_noise + numpy_noise]


def test_dataloader_workers_draw_other_augmentations_on_each_rank_and_epoch(seeds) -> None:
    """With the same global seed on both ranks, no torch or numpy draw of a map-style dataset's
    workers repeats across samples, ranks or epochs (as with DistributedSampler)."""
    everything = [v for rank in seeds for epoch in (0, 1) for v in _draws(rank["map"][epoch])]
    assert len(everything) == 2 * 2 * 16  # ranks x epochs x (8 samples x 2 draws)
    assert len(set(everything)) == len(everything)
    for epoch in (0, 1):
        assert sorted(i for rank in seeds for batch in rank["map"][epoch] for i in batch[0]) == list(range(16))


def test_stream_workers_draw_other_values_on_each_rank_and_epoch(seeds) -> None:
    """A stream's workers, each drawing once per pass, draw 2 values per rank and epoch, all 8
    different (the workers' base seed includes the rank), and each item is read once."""
    per_pass = [sorted(set(_draws(rank["stream"][epoch]))) for rank in seeds for epoch in (0, 1)]
    assert [len(values) for values in per_pass] == [4] * 4  # 2 workers x (torch, numpy)
    assert len({v for values in per_pass for v in values}) == 16
    for epoch in (0, 1):
        assert sorted(i for rank in seeds for batch in rank["stream"][epoch] for i in batch[0]) == list(range(16))


def test_map_style_draws_are_a_function_of_seed_epoch_rank_and_batch(seeds) -> None:
    """Batch k of epoch e on rank r draws from torch/numpy seeded by SeedSequence([seed, e, r, k]):
    the same whatever the worker, so a resumed run reads the same augmentations."""
    for rank, result in enumerate(seeds):
        for epoch in (0, 1):
            for k, (indices, torch_noise, numpy_noise) in enumerate(result["map"][epoch]):
                state = np.random.SeedSequence([5, epoch, rank, k]).generate_state(2)
                torch.manual_seed(int(state[0]) << 32 | int(state[1]))
                np.random.seed(int(state[1]))
                draws = [(torch.rand(1).item(), np.random.rand(1).item()) for _ in indices]
                assert (torch_noise, numpy_noise) == ([t for t, _ in draws], [n for _, n in draws])


@pytest.mark.parametrize("kind", ["map", "stream"])
def test_a_resumed_epoch_draws_what_the_uninterrupted_one_drew(seeds, kind) -> None:
    """Epoch 1 read from micro-batch 2 on gives exactly the samples and draws of its batches 2, 3."""
    for result in seeds:
        assert result[f"{kind}_resumed"] == result[kind][1][2:]
