"""Throughput and memory metrics at log points, and nothing read when nothing consumes it."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
import torch

import accelfn as af
from accelfn.loop import _progress
from tests.helpers import programs as P


def jsonl(path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_items_per_s_is_the_window_count_over_its_time(tmp_path, cpu):
    """With af.Loss over batches of 3, 5, 2, 6 items and log_every=2, items per second over
    updates per second is the window's mean count, (3 + 5) / 2 and (2 + 6) / 2: items/s equals
    the summed counts over the same elapsed time as updates/s. The peak RSS is logged in MiB,
    and no device peak on the CPU."""
    batches = P.token_batches((3, 5, 2, 6), seed=1)
    af.run(af.train_step(P.summed_mse), P.make_state(), batches, backend=cpu, progress=False, log_every=2,
           trackers=[af.JSONL(tmp_path / "m.jsonl")])
    log = jsonl(tmp_path / "m.jsonl")
    assert [line["step"] for line in log] == [2, 4]
    assert [line["items_per_s"] / line["updates_per_s"] for line in log] == pytest.approx([4.0, 4.0], rel=1e-12)
    assert [line["items_per_s"] * 2 / line["updates_per_s"] for line in log] == pytest.approx([8, 8], rel=1e-12)
    assert all(50 < line["rss_mib"] < 65536 and "peak_device_mib" not in line for line in log)


def test_a_mean_loss_logs_no_items(tmp_path, cpu):
    """A plain mean loss has samples, not counted items: samples_per_s is logged, items_per_s not."""
    data = [(torch.randn(4, 4), torch.randn(4, 1))] * 2
    af.run(af.train_step(P.mse), P.make_state(), data, backend=cpu, progress=False,
           trackers=[af.JSONL(tmp_path / "m.jsonl")])
    (first, _) = jsonl(tmp_path / "m.jsonl")
    assert "items_per_s" not in first and first["samples_per_s"] / first["updates_per_s"] == pytest.approx(4)


@pytest.mark.parametrize(("trackers", "progress", "interval_s", "reads"),
                         [(False, False, 0.0, 0), (True, False, 3600.0, 3), (False, True, 3600.0, 0),
                          (False, True, 0.0, 3)])
def test_metrics_are_read_only_when_something_consumes_them(tmp_path, cpu, monkeypatch, trackers, progress,
                                                            interval_s, reads):
    """Without trackers and bar, 6 updates at log_every=2 read the metrics never; with a tracker
    at each of the 3 log points; with the bar alone on one process only at log points at least
    BAR_INTERVAL_S apart (an hour: never; 0 s: all 3)."""
    calls = []
    original = _progress.Progress._reduce

    def counted(self, metrics, elapsed_s):
        calls.append(elapsed_s)
        return original(self, metrics, elapsed_s)

    monkeypatch.setattr(_progress.Progress, "_reduce", counted)
    monkeypatch.setattr(_progress, "BAR_INTERVAL_S", interval_s)
    data = [(torch.randn(4, 4), torch.randn(4, 1))] * 6
    af.run(af.train_step(P.mse), P.make_state(), data, backend=cpu, progress=progress, log_every=2,
           trackers=[af.JSONL(tmp_path / "m.jsonl")] if trackers else [])
    assert len(calls) == reads


def test_profile_writes_a_chrome_trace_of_the_chosen_window(tmp_path, cpu):
    """Profile(wait=2, warmup=1, active=2) over 8 updates writes one trace, rank0.*.pt.trace.json,
    a Chrome trace whose steps are updates 3 and 4 (from 0), with the model's matmuls in it."""
    data = [(torch.randn(4, 4), torch.randn(4, 1))] * 8
    af.run(af.train_step(P.mse), P.make_state(), data, backend=cpu, progress=False,
           profile=af.Profile(tmp_path / "prof", wait=2, warmup=1, active=2))
    (trace,) = (tmp_path / "prof").iterdir()
    assert trace.name.startswith("rank0.") and trace.name.endswith(".pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert {n for n in names if n.startswith("ProfilerStep#")} == {"ProfilerStep#3", "ProfilerStep#4"}
    assert "aten::addmm" in names


def test_profile_checks_its_window(tmp_path):
    """A zero active window, a negative wait and a file as directory are refused at once."""
    with pytest.raises(ValueError, match=r"^Profile\(active=0\): must be >= 1$"):
        af.Profile(tmp_path, active=0)
    with pytest.raises(ValueError, match=r"^Profile\(wait=-1\): must be >= 0$"):
        af.Profile(tmp_path, wait=-1)
    with pytest.raises(TypeError, match=r"^Profile\(repeat=...\) must be an int \(optimizer updates\), got 1.5$"):
        af.Profile(tmp_path, repeat=1.5)  # type: ignore[arg-type]
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="is a file, not a directory; give a directory"):
        af.Profile(tmp_path / "f")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; torch sees none")
def test_cuda_logs_the_peak_device_memory(tmp_path):
    """On CUDA, peak_device_mib is logged: the allocator's peak (max_memory_allocated) in MiB."""
    backend = af.backends.CUDA(af.backends.LaunchEnv())
    data = [(torch.randn(64, 4), torch.randn(64, 1))] * 3
    af.run(af.train_step(P.mse), P.make_state(), data, backend=backend, progress=False,
           trackers=[af.JSONL(tmp_path / "m.jsonl")])
    log = jsonl(tmp_path / "m.jsonl")
    assert 0 < log[0]["peak_device_mib"] <= torch.cuda.max_memory_allocated() / 2**20
