"""Data parallel training over gloo: 2 real processes started by `accelfn launch` vs 1 process.

One launch of tests/workers/mp_checks.py (2 processes) records everything; each test
compares one part of it with a single-process reference computed here.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader, DistributedSampler

import accelfn as af
from tests.helpers import launch as _launch
from tests.helpers import programs as P
from tests.helpers.events import read_scalars
from tests.helpers.pool import Pools
from tests.helpers.tracking import Recorder

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def mp(pool: Pools, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("mp_checks")
    pool.launch("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60", script="mp_checks.py",
                script_args=("--out", out), cwd=out)
    return {
        "out": out,
        "json": _launch.read_ranks(out, 2),
        "tensors": [load_file(out / f"rank{r}.safetensors") for r in range(2)],
    }


def _one_process() -> af.backends.Backend:
    return af.backends.CPU(af.backends.LaunchEnv())


def _with_prefix(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


@pytest.mark.parametrize("case", list(P.TRAIN_CASES))
def test_two_processes_equal_one_process_with_twice_the_batch(mp: dict[str, Any], case: str) -> None:
    """2 processes x batch 3 under shard_data+replicate give the parameters of 1 process x batch 6 (1e-6)."""
    reference = P.parameters(P.train_case(case, _one_process(), 2 * P.PER_RANK_BATCH))
    for rank in range(2):
        got = _with_prefix(mp["tensors"][rank], f"train.{case}.")
        assert got.keys() == reference.keys()
        for name, value in reference.items():
            torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-6, msg=f"{case} rank {rank} {name}")
    initial = P.parameters(P.make_state())
    assert any(not torch.allclose(initial[k], reference[k]) for k in initial), "the case must move the parameters"


def test_replicas_stay_bitwise_identical(mp: dict[str, Any]) -> None:
    """After every training case the two ranks hold bitwise identical parameters."""
    rank0, rank1 = mp["tensors"]
    names = [k for k in rank0 if k.startswith(("train.", "uneven.", "tokens."))]
    assert len(names) >= len(P.TRAIN_CASES) * 4
    for name in names:
        assert torch.equal(rank0[name], rank1[name]), name


def _expected_order(seed: int, epoch: int, rank: int) -> list[int]:
    sampler = DistributedSampler(range(P.NUM_SAMPLES), num_replicas=2, rank=rank, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def test_each_epoch_is_partitioned_exactly_in_a_reproducible_order(mp: dict[str, Any]) -> None:
    """Per epoch the ranks' samples partition the dataset; orders differ by epoch and seed and repeat for a seed."""
    orders = [r["orders"] for r in mp["json"]]
    for seed in (P.SHARD_SEED, P.SHARD_SEED + 10):
        for epoch in (0, 1):
            key = f"seed{seed}.epoch{epoch}"
            rank0, rank1 = orders[0][f"{key}.read0"], orders[1][f"{key}.read0"]
            assert sorted(rank0 + rank1) == list(range(P.NUM_SAMPLES)), key
            for rank in range(2):
                assert orders[rank][f"{key}.read0"] == orders[rank][f"{key}.read1"], key
                assert orders[rank][f"{key}.read0"] == _expected_order(seed, epoch, rank), key
        assert orders[0][f"seed{seed}.epoch0.read0"] != orders[0][f"seed{seed}.epoch1.read0"]
    assert orders[0][f"seed{P.SHARD_SEED}.epoch0.read0"] != orders[0][f"seed{P.SHARD_SEED + 10}.epoch0.read0"]


def test_iterable_dataset_over_two_workers_and_two_ranks_yields_each_item_once(mp: dict[str, Any]) -> None:
    """A 22-item IterableDataset read by 2 DataLoader workers on each of 2 ranks yields every item exactly once."""
    items = mp["json"][0]["stream_items"] + mp["json"][1]["stream_items"]
    assert sorted(items) == list(range(22))


def test_five_samples_on_two_ranks_finish_with_agreeing_replicas(mp: dict[str, Any]) -> None:
    """5 samples, 2 ranks, batch 1 (map-style and streamed): 3 updates per epoch, replicas equal, 5 gathered."""
    rank0, rank1 = mp["json"]
    for r in (rank0, rank1):
        assert r["uneven_map_steps"] == 6
        assert r["uneven_stream_steps"] == 6
        assert sorted(r["uneven_gathered"]) == [0, 1, 2, 3, 4]
    for kind in ("map", "stream"):
        a = _with_prefix(mp["tensors"][0], f"uneven.{kind}.")
        b = _with_prefix(mp["tensors"][1], f"uneven.{kind}.")
        assert a and all(torch.equal(a[k], b[k]) for k in a)


def test_gather_of_lengths_two_and_three_returns_five_in_rank_order(mp: dict[str, Any]) -> None:
    """gather of a (2, 2) tensor on rank 0 and a (3, 2) tensor on rank 1 is their (5, 2) concatenation."""
    expected = torch.tensor([[0.0, 0.0], [1.0, 0.0], [10.0, 1.0], [11.0, 1.0], [12.0, 1.0]])
    for rank in range(2):
        assert torch.equal(mp["tensors"][rank]["gather"], expected)
        r = mp["json"][rank]
        assert (r["reduce_sum"], r["reduce_mean"], r["broadcast"]) == (3.0, 1.5, 6.0)
        assert r["gather_object"] == [{"rank": 0}, {"rank": 1}]


def test_gather_of_other_trailing_dims_or_dtypes_fails_on_every_rank(mp: dict[str, Any]) -> None:
    """Tensors that differ past the first dimension, or in dtype, raise ValueError on both
    ranks, naming each rank's shape and dtype (rather than a gloo abort on one rank and a
    wrong tensor on the other)."""
    for r in mp["json"]:
        assert r["gather_dims_error"].endswith("got rank 0: shape (2, 3) float32, rank 1: shape (2, 4) float32")
        assert r["gather_dtype_error"].endswith("got rank 0: shape (2, 3) float32, rank 1: shape (2, 3) int64")


def test_evaluate_returns_every_sample_once_in_dataset_order(mp: dict[str, Any]) -> None:
    """evaluate on 9 samples, 2 ranks, batch 5 returns the 9 outputs of a single-process run, in dataset order
    (and on 1 sample, where rank 1 has none, that one output)."""
    state = P.make_state(seed=7)
    loader = DataLoader(P.IndexDataset(9), batch_size=5)
    reference = af.evaluate(P.eval_outputs, state, loader, backend=_one_process())
    assert torch.equal(reference["index"], torch.arange(9))
    assert [r["evaluate_local_batches"] for r in mp["json"]] == [1, 1]  # 5 and 4 samples
    one_reference = state.model(P.IndexDataset(1).x).detach()
    for rank in range(2):
        got = mp["tensors"][rank]
        assert torch.equal(got["evaluate.index"], torch.arange(9))
        torch.testing.assert_close(got["evaluate.prediction"], reference["prediction"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got["evaluate_one.prediction"], one_reference, rtol=1e-6, atol=1e-7)


def test_one_gradient_allreduce_per_optimizer_update(mp: dict[str, Any]) -> None:
    """Under accumulate(3) a DDP comm hook runs once on each window's last micro-batch and never otherwise."""
    for r in mp["json"]:
        per_micro_batch = r["allreduces"]
        assert len(per_micro_batch) == 16  # 2 epochs x 8 micro-batches: windows of 3, 3, 2
        assert [m["updated"] for m in per_micro_batch] == [False, False, True, False, False, True, False, True] * 2
        assert [m["allreduces"] for m in per_micro_batch] == [int(m["updated"]) for m in per_micro_batch]
        assert r["allreduce_steps"] == 6
        assert r["state_model_type"] == "Sequential"  # the state keeps the unwrapped model


def test_replicate_options_reach_ddp(mp: dict[str, Any]) -> None:
    """replicate(bucket_cap_mb=1, find_unused_parameters=True, gradient_as_bucket_view=True) builds that DDP."""
    for r in mp["json"]:
        assert r["ddp_options"] == ["DistributedDataParallel", 2**20, True, True, False]


def test_loss_counts_are_summed_over_ranks(mp: dict[str, Any]) -> None:
    """af.Loss on 2 ranks with 2 and 10 (then 7 and 1, 4 and 4) tokens equals one process over all 12 tokens."""
    state = P.make_state()
    model, optimizer = state.model, state.optimizer
    for k, counts in enumerate(P.TOKEN_COUNTS):
        both = P.token_batches(counts, seed=100 + k)
        x = torch.cat([b[0] for b in both])
        y = torch.cat([b[1] for b in both])
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    reference = P.parameters(state)
    for rank in range(2):
        got = _with_prefix(mp["tensors"][rank], "tokens.")
        for name, value in reference.items():
            torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-6, msg=f"rank {rank} {name}")


def test_loss_counts_log_the_loss_of_one_big_batch(mp: dict[str, Any]) -> None:
    """The logged loss of each af.Loss update with 2 and 10 (7 and 1, 4 and 4) tokens on the
    two ranks is sum(total) / sum(count) over both ranks, the loss of one process over all
    12 tokens (not the mean of the ranks' means); so is an accumulate(3) window of all
    three, with its metric weighted by the counts of both ranks."""
    state = P.make_state()
    model, optimizer = state.model, state.optimizer
    losses, batches = [], []
    for k, counts in enumerate(P.TOKEN_COUNTS):
        both = P.token_batches(counts, seed=100 + k)
        batches += both
        x, y = torch.cat([b[0] for b in both]), torch.cat([b[1] for b in both])
        loss = torch.nn.functional.mse_loss(model(x), y)
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    logged = [orjson.loads(line) for line in (mp["out"] / "tokens.jsonl").read_bytes().splitlines()]
    assert [point["step"] for point in logged] == [1, 2, 3]
    assert [point["loss"] for point in logged] == pytest.approx(losses, rel=1e-6)

    model = P.make_state().model
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    with torch.no_grad():
        loss, error = torch.nn.functional.mse_loss(model(x), y).item(), (model(x) - y).abs().mean().item()
    (point,) = [orjson.loads(line) for line in (mp["out"] / "tokens_window.jsonl").read_bytes().splitlines()]
    assert (point["step"], point["loss"], point["abs_error"]) == (1, pytest.approx(loss, rel=1e-6),
                                                                   pytest.approx(error, rel=1e-6))


def test_updates_skipped_on_one_rank_only_are_logged_as_a_mean_without_hanging(mp: dict[str, Any]) -> None:
    """Without replicate, an update skipped on rank 1 only keeps the ranks' metric names
    equal: its point has skipped 0.5 (the mean of 0 and 1) and a nan grad_norm, and the
    run finishes its 3 points."""
    points = [orjson.loads(line) for line in (mp["out"] / "independent.jsonl").read_bytes().splitlines()]
    assert [(p["step"], p["skipped"]) for p in points] == [(1, 0.0), (2, 0.5), (3, 0.0)]
    assert [p["grad_norm"] is None or p["grad_norm"] != p["grad_norm"] for p in points] == [False, True, False]


def test_one_tensorboard_file_from_rank_zero_with_reduced_values(mp: dict[str, Any]) -> None:
    """A 2-process run writes one event file whose loss and grad_norm equal a single-process run's."""
    files = [p for p in (mp["out"] / "tb").rglob("*") if p.is_file()]
    assert len(files) == 1, files
    scalars = read_scalars(files[0])
    record = Recorder()
    P.train_case("e2_acc2_clip", _one_process(), 2 * P.PER_RANK_BATCH, trackers=(record,))
    assert [step for step, _ in scalars["loss"]] == [step for step, _ in record.points] == list(range(1, 7))
    for name in ("loss", "grad_norm", "lr"):
        got = [value for _, value in scalars[name]]
        expected = [metrics[name] for _, metrics in record.points]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected, dtype=torch.float32),
                                   rtol=1e-5, atol=1e-6, msg=name)


def test_replicate_over_unequal_per_rank_data_fails_before_training(mp: dict[str, Any]) -> None:
    """Ranks whose own data have 3 and 5 batches under replicate() get a ValueError naming the
    fix on every rank before any update, instead of a collective timeout."""
    for r in mp["json"]:
        assert "between 3 and 5 batches per epoch" in r["unequal_error"]
        assert "af.shard_data()" in r["unequal_error"]
        assert r["unequal_untouched"]


def test_replicate_over_streams_of_unknown_unequal_length_keeps_ranks_in_step(mp: dict[str, Any]) -> None:
    """Generators of 3 and 5 batches under replicate() without shard_data: 5 updates on both
    ranks, rank 0 replaying its first batch for the last 2, equal to one process training
    on each pair of batches concatenated (1e-6)."""
    streams = [P.rank_stream(0), P.rank_stream(1)]
    streams[0] += [streams[0][0]] * 2
    pairs = [tuple(torch.cat(parts) for parts in zip(a, b)) for a, b in zip(*streams)]
    reference = af.run(af.train_step(P.mse), P.make_state(), pairs, backend=_one_process(), progress=False)
    for tensors in mp["tensors"]:
        assert int(tensors["stream_step"]) == 5
        got = _with_prefix(tensors, "stream.")
        for name, value in P.parameters(reference).items():
            torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-6)


def test_replicate_over_a_stream_that_is_empty_on_one_rank_replays_another_ranks_first_batch(
        mp: dict[str, Any]) -> None:
    """A generator of 2 batches on rank 0 and an empty one on rank 1 under replicate(): 2
    updates on both ranks (not an error on rank 1), rank 1 training on a copy of rank 0's first
    batch both times, equal to one process training on [b0, b0] then [b1, b0] (1e-6)."""
    b0, b1 = P.rank_stream(0)[:2]
    pairs = [tuple(torch.cat(parts) for parts in zip(a, b)) for a, b in ((b0, b0), (b1, b0))]
    reference = af.run(af.train_step(P.mse), P.make_state(), pairs, backend=_one_process(), progress=False)
    for tensors in mp["tensors"]:
        assert int(tensors["empty_stream_step"]) == 2
        got = _with_prefix(tensors, "empty_stream.")
        for name, value in P.parameters(reference).items():
            torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-6)


def test_fp16_loss_counts_back_off_the_loss_scale_like_a_mean_loss(mp: dict[str, Any]) -> None:
    """Under fp16 + replicate, af.Loss(sum, count) back-propagates at the magnitude of a mean
    loss: from a scale of 2**24 it skips the same updates and reaches the same scale as the
    mean loss (back-propagating the sum, 64 = 4 x 16 times larger, took 6 more halvings and
    left 1 update of 7), and the parameters agree (1e-5)."""
    for r, tensors in zip(mp["json"], mp["tensors"]):
        assert r["fp16_summed"] == r["fp16_mean"]
        assert r["fp16_mean"][1] > 0  # the scale did back off
        for name, value in _with_prefix(tensors, "fp16_mean.").items():
            torch.testing.assert_close(tensors[f"fp16_summed.{name}"], value, rtol=1e-5, atol=1e-6)


def test_split_batches_gives_each_rank_its_half_of_the_loaders_global_batch(mp: dict[str, Any]) -> None:
    """shard_data(split_batches=True) on 2 processes with a DataLoader of batch 6: rank 0 reads
    the first 3 samples of every batch the same loader gives on one process (same shuffle),
    rank 1 the next 3, the last batch of 4 split 2 + 2; training under replicate +
    accumulate(2) equals one process reading the loader's batches whole (1e-6)."""
    one = _one_process()
    step = af.compose(af.shard_data(seed=P.SHARD_SEED, split_batches=True), af.replicate(),
                      af.accumulate(2))(af.train_step(P.mse))
    loader = DataLoader(P.IndexDataset(P.NUM_SAMPLES), batch_size=2 * P.PER_RANK_BATCH, shuffle=True)
    for epoch in (0, 1):
        whole = [index.tolist() for (_, index), _ in one.batches(loader, step, epoch)]
        assert [len(b) for b in whole] == [6, 6, 6, 6, 4]
        rank0, rank1 = (r["split_indices"][epoch] for r in mp["json"])
        assert [a + b for a, b in zip(rank0, rank1)] == whole
        assert [len(b) for b in rank0] == [len(b) for b in rank1] == [3, 3, 3, 3, 2]
    assert mp["json"][0]["split_indices"][0] != mp["json"][0]["split_indices"][1]  # a shuffle per epoch
    reference = af.run(step, P.make_state(), DataLoader(P.regression_data(), batch_size=2 * P.PER_RANK_BATCH,
                                                        shuffle=True), backend=one, epochs=2, progress=False)
    for r, tensors in zip(mp["json"], mp["tensors"]):
        assert r["split_steps"] == reference.step == 6
        for name, value in P.parameters(reference).items():
            torch.testing.assert_close(_with_prefix(tensors, "split.")[name], value, rtol=1e-6, atol=1e-6)
