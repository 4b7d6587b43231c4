"""MLflow and W&B trackers on a real 2-process run, read back through each library's own reader;
per-epoch hooks on 2 processes, with a crash and ``resume="auto"``.

One launch (tests/workers/tracked.py) runs the job three ways; the tests below read what it
left. MLflow is read with ``mlflow.MlflowClient`` from the SQLite store; the offline W&B run
with ``wandb leet inspect --json`` (W&B's CLI that prints the records of a run's ``.wandb``
transaction log as JSON lines: the ``run`` record holds the config, each ``history`` record
one logged row with its step).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch

from tests.helpers import hooked
from tests.helpers import launch as _launch
from tests.helpers.pool import Pools

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def job(pool: Pools, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output directory of one 2-process launch of tracked.py."""
    pytest.importorskip("mlflow", reason="the MLflow tracker needs mlflow (the dev extra has it)")
    pytest.importorskip("wandb", reason="the W&B tracker needs wandb (the dev extra has it)")
    out = tmp_path_factory.mktemp("tracked")
    pool.launch("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60", script="tracked.py",
                script_args=("--out", out), env=_launch.environment(WANDB_SILENT="true"))
    return out


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def points(lines: list[dict[str, Any]], name: str) -> list[tuple[int, float]]:
    return [(line["step"], line[name]) for line in lines if name in line]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same job on one process with twice the batch: its log and final parameters."""
    import accelfn as af

    out = tmp_path_factory.mktemp("single")
    state = hooked.train(af.backends.CPU(af.backends.LaunchEnv()), 2 * hooked.PER_RANK_BATCH,
                         trackers=[af.JSONL(out / "m.jsonl")])
    return {"log": jsonl(out / "m.jsonl"), "params": hooked.flat_parameters(state)}


def test_mlflow_holds_every_metric_at_its_step_and_the_config_as_params(job):
    """Read through MlflowClient, the MLflow run has each metric at the steps and values the
    JSONL tracker of the same run logged, and the config with accelfn's additions as params."""
    from mlflow import MlflowClient

    rank0 = json.loads((job / "rank0.json").read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{job / 'mlflow' / 'mlflow.db'}")
    run = client.get_run(rank0["mlflow_run_id"])
    log = jsonl(job / "whole.jsonl")
    names = {name for line in log for name in line} - {"step"}
    assert set(run.data.metrics) == names
    for name in names:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
        expected = sorted(points(log, name))
        assert [s for s, _ in history] == [s for s, _ in expected]
        assert [v for _, v in history] == pytest.approx([v for _, v in expected], rel=1e-12)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(1, 13))
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "val/loss")) == [4, 8, 12]
    params = run.data.params
    assert params["lr"] == "0.01" and params["model.hidden"] == "8" and params["tags"] == "['a', 'b']"
    assert params["accelfn.world_size"] == "2" and params["accelfn.backend"] == "cpu"
    assert params["accelfn.precision"] == "fp32" and params["accelfn.batch_size"] == "3"
    assert params["accelfn.transforms.shard_data.seed"] == "3"
    assert params["accelfn.torch_version"] == torch.__version__
    assert run.info.status == "FINISHED" and len(client.search_runs([run.info.experiment_id])) == 1


def test_wandb_offline_run_holds_every_row_and_the_config(job):
    """``wandb leet inspect --json`` on the offline run shows one history row per logged step,
    with the JSONL tracker's values (rows of one step merged), and the config."""
    rank0 = json.loads((job / "rank0.json").read_text())
    (run_dir,) = (job / "wandb").glob(f"offline-run-*-{rank0['wandb_run_id']}")
    records = [json.loads(line) for line in subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
        check=True, capture_output=True, text=True, stdin=subprocess.DEVNULL).stdout.splitlines()]
    rows = {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}
    expected: dict[int, dict[str, float]] = {}
    for line in jsonl(job / "whole.jsonl"):
        expected.setdefault(line["step"], {}).update({k: v for k, v in line.items() if k != "step"})
    assert sorted(rows) == list(range(1, 13))
    for step, values in expected.items():
        assert {k: rows[step][k] for k in values} == pytest.approx(values)
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    config = run["config"]["update"]
    assert config["lr"] == 0.01 and config["model"] == {"hidden": 8, "activation": "tanh"}
    assert config["accelfn"]["world_size"] == 2 and config["accelfn"]["transforms"]["replicate"]["bucket_cap_mb"] == 25


def test_hooks_log_at_epoch_ends_and_every_n_steps_on_two_processes(job, single):
    """On 2 processes the evaluation hook logs val/loss at steps 4, 8, 12 (each epoch's end) and
    the custom hook at 3, 6, 9, 12, with the values of the 1-process run of twice the batch."""
    log = jsonl(job / "whole.jsonl")
    assert [s for s, _ in points(log, "val/loss")] == [4, 8, 12]
    assert points(log, "hook/step") == [(3, 3.0), (6, 6.0), (9, 9.0), (12, 12.0)]
    assert points(log, "val/epoch") == [(4, 1.0), (8, 2.0), (12, 3.0)]
    assert [s for s, _ in points(single["log"], "val/loss")] == [4, 8, 12]
    assert [v for _, v in points(log, "val/loss")] == pytest.approx(
        [v for _, v in points(single["log"], "val/loss")], rel=1e-5)
    assert points(single["log"], "hook/step") == points(log, "hook/step")


def test_crash_and_resume_auto_logs_each_step_once_and_ends_where_the_whole_run_ends(job):
    """After a crash at step 8 and resume='auto' from the checkpoint of step 5, the resumed run
    logs steps 6..12 once each, its hooks fire at the same steps with bitwise the same values,
    and its final parameters equal the uninterrupted run's."""
    whole, crashed, resumed = (jsonl(job / f"{name}.jsonl") for name in ("whole", "crashed", "resumed"))
    assert [s for s, _ in points(crashed, "loss")] == list(range(1, 8))
    assert [s for s, _ in points(resumed, "loss")] == list(range(6, 13))
    assert [s for s, _ in points(resumed, "val/loss")] == [8, 12]
    assert points(resumed, "hook/step") == [(6, 6.0), (9, 9.0), (12, 12.0)]
    for name in ("loss", "val/loss"):
        assert points(resumed, name) == [p for p in points(whole, name) if p[0] > hooked.CHECKPOINT_EVERY]
    for rank in (0, 1):
        result = json.loads((job / f"rank{rank}.json").read_text())
        assert result["crashed"] and result["resumed"] == result["whole"]


def test_items_per_s_sums_both_ranks_counts_and_every_rank_writes_a_trace(job):
    """With af.Loss counts (2, 10), (7, 1), (4, 4) on ranks 0 and 1, the logged items per second
    over updates per second is each update's count summed over ranks, 12, 8, 8 (the one
    elapsed time cancels); so is samples per second here (one item per sample); the peak RSS is
    logged; Profile(all_ranks=True) wrote one Chrome trace per rank with update 1 in it."""
    log = jsonl(job / "items.jsonl")
    assert [line["items_per_s"] / line["updates_per_s"] for line in log] == pytest.approx([12, 8, 8], rel=1e-9)
    assert [line["samples_per_s"] / line["updates_per_s"] for line in log] == pytest.approx([12, 8, 8], rel=1e-9)
    assert all(50 < line["rss_mib"] < 65536 for line in log)
    for rank in (0, 1):
        (trace,) = (job / "profile").glob(f"rank{rank}.*.pt.trace.json")
        events = json.loads(trace.read_text())["traceEvents"]
        assert {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")} == {"ProfilerStep#1"}


def test_a_stop_asked_on_one_rank_stops_both_at_the_same_update(job):
    """A hook that returns af.Stop on rank 1 only, at step 4, ends the run at step 4 on both
    ranks (the stop is agreed by an all-reduce), so no collective is left waiting."""
    assert [json.loads((job / f"rank{r}.json").read_text())["stopped_at"] for r in (0, 1)] == [4, 4]
