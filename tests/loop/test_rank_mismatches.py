"""What ranks must agree on, with 2 real processes: metric names, evaluate outputs, and calls
like af.save that rank 0 makes alone; each fails on every rank (or rank 0) instead of hanging."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from tests.helpers import launch as _launch
from tests.helpers.pool import Pools

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def mismatches(pool: Pools, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("mismatches")
    pool.launch("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "30", script="rank_mismatches.py",
                script_args=("--out", out), cwd=out, timeout_s=120)
    return {"ranks": _launch.read_ranks(out, 2), "out": out}


def test_metric_names_that_differ_across_ranks_fail_on_every_rank(mismatches) -> None:
    """loss_fn returning a metric on rank 1 only raises the same ValueError on both ranks (no hang)."""
    expected = ("loss_fn returned other metrics on some ranks (rank 0: loss, lr; rank 1: extra, loss, lr); "
                "metrics are averaged over the ranks name by name, so loss_fn must return the same metric "
                "names on every rank")
    assert [r["names"] for r in mismatches["ranks"]] == [expected, expected]
    assert not (mismatches["out"] / "extra.jsonl").exists()


def test_an_af_loss_on_one_rank_and_a_mean_loss_on_the_other_fail_on_every_rank(mismatches) -> None:
    """loss_fn returning af.Loss on rank 0 and a mean loss on rank 1 raises a ValueError on both
    ranks, naming each rank's kind, before any backward (no hang; nothing logged), under
    replicate() and under shard_params() alone (the plain step function); under invariant()
    (with replicate() or shard_params()) where the first window closes, before any update."""
    ranks = mismatches["ranks"]
    assert ([r["kinds"] for r in ranks] == [r["kinds_sharded"] for r in ranks]
            == [r["kinds_invariant_replicate"] for r in ranks] == [r["kinds_invariant_shard_params"] for r in ranks]
            == [
        f"loss_fn returned an af.Loss on some ranks and a plain loss on others (this is rank {rank}: {kind}); "
        "the ranks reduce an af.Loss's counts together, so loss_fn must return the same kind on every rank"
        for rank, kind in ((0, "an af.Loss"), (1, "a plain loss"))])
    for name in ("kinds", "kinds_sharded", "kinds_invariant_replicate", "kinds_invariant_shard_params"):
        assert not (mismatches["out"] / f"{name}.jsonl").exists()


def test_the_same_metric_names_in_another_order_are_averaged_name_by_name(mismatches) -> None:
    """Rank 0 returns {a: 1, b: 2}, rank 1 {b: 20, a: 10}: every logged point has a 5.5, b 11."""
    lines = [orjson.loads(line) for line in (mismatches["out"] / "reordered.jsonl").read_bytes().splitlines()]
    assert [(line["step"], line["a"], line["b"]) for line in lines] == [(1, 5.5, 11.0), (2, 5.5, 11.0)]


def test_evaluate_outputs_of_another_structure_fail_on_every_rank(mismatches) -> None:
    """fn returning other dict keys on each rank raises the same ValueError on both ranks."""
    expected = ("evaluate(): fn returned outputs of another structure on some ranks (rank 0: {'out0': "
                "float32[*, 1]}; rank 1: {'out1': float32[*, 1]}); fn must return the same structure (the same "
                "tensors, keys and trailing shapes) on every rank")
    assert [r["evaluate_structure"] for r in mismatches["ranks"]] == [expected, expected]


def test_save_and_evaluate_on_rank_zero_alone_fail_naming_the_call(mismatches) -> None:
    """af.save, af.evaluate, af.save_model and af.load inside `if backend.is_main_process:` fail
    on rank 0 after a tenth of the 30 s timeout, naming the call and the missing rank; no
    checkpoint or export is written, and a save on every rank afterwards works."""
    rank0, rank1 = mismatches["ranks"]
    assert not (mismatches["out"] / "model_main_only").exists()
    for what in ("af.save", "af.evaluate", "af.save_model", "af.load"):
        assert rank0["alone"][what] == (
            f"{what} was called on rank 0, but rank(s) 1 did not call it within 3 s: {what} is a collective, "
            "call it on every rank (not inside `if backend.is_main_process:`)")
    assert rank1["alone"] == {}
    assert not (mismatches["out"] / "main_only").exists()
    assert [r["saved"] for r in mismatches["ranks"]] == [["manifest.json", "manifest.sha256", "model.safetensors"]] * 2


def test_ranks_that_arrive_at_other_calls_fail_on_every_rank_naming_each_call(mismatches) -> None:
    """af.save of another path on each rank, af.save on rank 0 while rank 1 evaluates, or af.run
    on rank 0 while rank 1 calls af.save_model, fail on both ranks at once with one message
    naming each rank's call; nothing is written."""
    out = mismatches["out"]
    rank0, rank1 = (r["crossed"] for r in mismatches["ranks"])
    tail = ("af.save is a collective, call it on every rank at the same point of the script (not inside "
            "`if backend.is_main_process:`)")
    paths = (f"af.save({str(out / 'one')!r}) was called on rank 0 while other ranks called something else "
             f"(rank 1: af.save({str(out / 'all')!r})): {tail}")
    calls = (f"af.save({str(out / 'two')!r}) was called on rank 0 while other ranks called something else "
             f"(rank 1: af.evaluate): {tail}")
    run = (f"af.run was called on rank 0 while other ranks called something else (rank 1: "
           f"af.save_model({str(out / 'model_crossed')!r})): af.run is a collective, call it on every rank at the "
           "same point of the script (not inside `if backend.is_main_process:`)")
    assert rank0 == rank1 == {"paths": paths, "calls": calls, "run": run}
    assert not any((out / name).exists() for name in ("one", "all", "two", "model_crossed"))
