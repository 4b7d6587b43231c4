"""The XLA backend's runtime parts: the parallel loader, in-graph all-reduce, process rules."""

from __future__ import annotations

import collections
import subprocess
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import accelfn as af
from tests.helpers import launch as _launch
from tests.helpers.models import classification_data, make_mlp
from tests.helpers.xla import counts, loss_fn, met, since

pytestmark = pytest.mark.xla
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def xla() -> af.backends.Backend:
    return af.backends.XLA(af.backends.LaunchEnv())


def as_cpu(pairs):
    return [((x.cpu(), y.cpu()), last) for (x, y), last in pairs]


def test_sharded_batches_arrive_on_the_device_in_the_cpu_backends_order(cpu, xla):
    """Under shard_data, the XLA backend yields the CPU backend's batches of an epoch, from a
    resume position, in order, on the XLA device, with the last one flagged."""
    loader = DataLoader(classification_data(22), batch_size=4, shuffle=True)  # 6 micro-batches
    step = af.shard_data(seed=5)(af.train_step(loss_fn))
    expected = list(cpu.batches(loader, step, 1, start=2))
    batches = xla.batches(loader, step, 1, start=2)
    got = list(batches)

    assert len(batches) == len(got) == 4
    assert {t.device.type for (x, y), _ in got for t in (x, y)} == {"xla"}
    assert [last for _, last in got] == [False, False, False, True]
    for ((x, y), last), ((ex, ey), elast) in zip(as_cpu(got), expected):
        assert torch.equal(x, ex) and torch.equal(y, ey) and last == elast


Pair = collections.namedtuple("Pair", "features label")


def test_batches_keep_their_structure_through_the_loader(cpu, xla):
    """Tuples, named tuples, dicts and non-tensor values in a batch arrive as the CPU backend
    yields them, with every tensor on the XLA device."""
    data = [{"pair": Pair(torch.full((2, 3), float(i)), torch.tensor([i, i])), "span": (torch.ones(2), i),
             "name": f"b{i}"} for i in range(3)]
    step = af.shard_data()(af.train_step(loss_fn))
    expected = [batch for batch, _ in cpu.batches(data, step, 0)]
    got = [batch for batch, _ in xla.batches(data, step, 0)]

    for batch, wanted in zip(got, expected, strict=True):
        assert type(batch["pair"]) is Pair and type(batch["span"]) is tuple
        assert (batch["name"], batch["span"][1]) == (wanted["name"], wanted["span"][1])
        for t, w in ((batch["pair"].features, wanted["pair"].features), (batch["pair"].label, wanted["pair"].label),
                     (batch["span"][0], wanted["span"][0])):
            assert t.device.type == "xla" and torch.equal(t.cpu(), w)


class Stream(IterableDataset):
    """Samples 0..n-1 of unknown length."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n, dtype=torch.float32).reshape(-1, 1))


def test_a_stream_of_unknown_length_ends_with_its_last_batch_flagged(xla):
    """A sharded stream of unknown length arrives whole, in order, and only its final batch
    is flagged last."""
    step = af.shard_data()(af.train_step(loss_fn))
    got = list(xla.batches(DataLoader(Stream(10), batch_size=4), step, 0))
    assert [b.cpu().flatten().tolist() for b, _ in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [last for _, last in got] == [False, False, True]


def test_leaving_an_epoch_early_stops_the_loader_threads(xla):
    """Breaking out of an epoch's batches stops torch_xla's loader threads."""
    loader = DataLoader(classification_data(64), batch_size=2)
    step = af.shard_data()(af.train_step(loss_fn))
    before = threading.active_count()
    for i, _ in enumerate(xla.batches(loader, step, 0)):
        if i == 1:
            assert threading.active_count() > before
            break
    assert threading.active_count() == before


def test_reduce_gradients_is_an_all_reduce_inside_the_graph(xla, monkeypatch):
    """reduce_gradients and all_reduce_sum lower to XLA all-reduce ops in the graph (forced on
    a world of one with XLA_ALWAYS_ALLREDUCE), where they leave values as they are."""
    monkeypatch.setenv("XLA_ALWAYS_ALLREDUCE", "1")
    model = make_mlp().to(xla.device)
    x, y = classification_data(8)[:]
    loss_fn(model, xla.place((x, y))).backward()
    params = list(model.parameters())
    grads = [p.grad.cpu() for p in params]
    in_place = met.counter_value("xla::AllReduceInPlace") or 0

    xla.reduce_gradients(params)
    total = xla.all_reduce_sum(torch.full((2,), 3.0, device=xla.device))
    xla.graph_cut()

    assert (met.counter_value("xla::AllReduceInPlace") or 0) == in_place + 1
    assert all(torch.equal(p.grad.cpu(), g) for p, g in zip(params, grads))
    assert total.cpu().tolist() == [3.0, 3.0]


def test_evaluate_on_xla_matches_the_cpu_backend(cpu, xla):
    """af.evaluate on XLA returns the CPU backend's outputs for all 42 samples in order, one
    graph per batch; evaluating again compiles nothing."""
    model = make_mlp()
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = DataLoader(classification_data(42), batch_size=4)  # 11 batches, the last of 2

    def fn(model, batch):
        return torch.softmax(model(batch[0]), -1)

    expected = af.evaluate(fn, state, data, backend=cpu)
    placed, _ = xla.prepare(af.train_step(loss_fn), state)
    af.evaluate(fn, placed, data, backend=xla)
    before = counts()
    got = af.evaluate(fn, placed, data, backend=xla)
    cost = since(before)

    assert got.device.type == "xla" and got.shape == (42, 3)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-6, atol=1e-7)
    assert cost["compilations"] == 0 and cost["graphs"] >= 11


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return _launch.python("-c", textwrap.dedent(code), cwd=ROOT, env=_launch.environment(PJRT_DEVICE="CPU", **env),
                          timeout_s=120)


def test_a_backend_created_after_a_backward_pass_says_how_to_fix_it():
    """A process that ran a backward pass before starting the XLA runtime gets an error that
    says to create the backend first, not PyTorch's internal assertion at the first step."""
    done = run_python("""
        import torch, accelfn as af
        torch.ones(2, requires_grad=True).sum().backward()
        af.backends.XLA()
    """)
    assert done.returncode != 0
    assert "Create af.backends.XLA() (or af.backends.auto()) before the first backward pass" in done.stderr


def test_accelfn_launch_runs_one_xla_process(tmp_path):
    """``accelfn launch --backend xla --nproc-per-node 1`` runs the script on the XLA backend."""
    _launch.launch("--backend", "xla", "--nproc-per-node", "1", script="hello.py", script_args=("--out", tmp_path),
                   env=_launch.environment(PJRT_DEVICE="CPU"))
    (record,) = _launch.read_ranks(tmp_path, 1)
    assert (record["backend"], record["world_size"], record["sum_of_ranks_plus_one"]) == ("xla", 1, 1.0)


@pytest.mark.multiprocess
def test_two_xla_processes_on_pjrt_cpu_stop_with_a_launch_error(tmp_path):
    """``accelfn launch --backend xla`` of two processes on PJRT's CPU device, whose runtime
    makes each process its own world, stops both with a LaunchError that explains it."""
    result = _launch.launch("--backend", "xla", "--nproc-per-node", "2", "--timeout-s", "60", script="hello.py",
                            script_args=("--out", tmp_path), env=_launch.environment(PJRT_DEVICE="CPU"),
                            check=False)
    assert result.returncode != 0 and not list(tmp_path.glob("rank*.json"))
    output = result.stdout + result.stderr
    for rank in (0, 1):
        assert f"accelfn launched 2 XLA processes (this is rank {rank}), but the PJRT runtime sees a world of 1" in output
    assert "has no collectives across processes" in output


def test_auto_picks_xla_where_pjrt_device_is_set_and_env_lists_the_devices(monkeypatch, capsys):
    """With PJRT_DEVICE=CPU (xla-env.sh sets it) and no --backend, auto() is the XLA backend;
    ``accelfn env`` lists the PJRT client's devices; without PJRT_DEVICE auto() stays on CPU."""
    from accelfn.cli import main

    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    backend = af.backends.auto(af.backends.LaunchEnv())
    assert backend.name == "xla" and backend.device.type == "xla"
    assert main(["env"]) == 0
    assert "  xla:0: CPU (PJRT_DEVICE=CPU)\n" in capsys.readouterr().out
    monkeypatch.delenv("PJRT_DEVICE")
    assert af.backends.auto(af.backends.LaunchEnv()).name == "cpu"
    assert main(["env"]) == 0
    assert "  xla: torch_xla is installed; set PJRT_DEVICE" in capsys.readouterr().out
