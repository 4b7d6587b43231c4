"""The CUDA backend against the CPU reference and hand-written torch.amp loops (needs a GPU).

Run them all with scripts/gpu-check.sh on a machine with a GPU; elsewhere they skip.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils.data import DataLoader

import accelfn as af
from tests.helpers import launch as _launch
from tests.helpers import programs as P
from tests.helpers import sharded as S

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(NUM_GPUS == 0, reason=f"needs a CUDA GPU; torch {torch.__version__} sees none "
                       "(run scripts/gpu-check.sh on a GPU machine)"),
]


@pytest.fixture(autouse=True)
def _full_fp32_matmuls() -> Iterator[None]:
    """TF32 off, so that fp32 on the GPU is comparable with the CPU at 1e-5."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture
def cuda() -> af.backends.Backend:
    return af.backends.CUDA(af.backends.LaunchEnv())


def _cpu() -> af.backends.Backend:
    return af.backends.CPU(af.backends.LaunchEnv())


def _assert_params_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float,
                         atol: float) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name].cpu(), expected[name].cpu(), rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("case", ["e2", "e2_acc2_clip"])
def test_cuda_training_equals_the_cpu_reference(cuda: af.backends.Backend, case: str) -> None:
    """fp32 training on one GPU gives the CPU's parameters to 1e-5 (2 epochs, with accumulate(2) and clip)."""
    expected = P.parameters(P.train_case(case, _cpu(), 6))
    state = P.train_case(case, cuda, 6)
    assert {p.device.type for p in state.model.parameters()} == {"cuda"}
    assert all(v.device.type == "cuda" for s in state.optimizer.state.values() for v in s.values() if v.ndim)
    _assert_params_close(P.parameters(state), expected, rtol=1e-5, atol=1e-6)


def _hand_written(precision: torch.dtype, data: list, *, scaler: torch.amp.GradScaler | None) -> torch.nn.Module:
    """A torch.amp loop on the GPU: accumulate 2 micro-batches, clip at 0.5, AdamW."""
    state = P.make_state()
    model, optimizer = state.model.cuda(), state.optimizer
    for window in (data[:2], data[2:]):
        for x, y in window:
            with torch.autocast("cuda", dtype=precision):
                loss = F.mse_loss(model(x.cuda()), y.cuda())
            (scaler.scale(loss / 2) if scaler else loss / 2).backward()
        if scaler:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
    return model


def _batches(bad: int | None = None) -> list:
    x, y = P.regression_data(16, seed=4).tensors
    out = [(x[i:i + 4].clone(), y[i:i + 4]) for i in range(0, 16, 4)]
    if bad is not None:
        out[bad][0][0, 0] = math.inf
    return out


def test_bf16_autocast_on_cuda_equals_the_hand_written_autocast_loop(cuda: af.backends.Backend) -> None:
    """with_precision('bf16') + accumulate(2) + clip runs the forward in bf16 and equals torch.autocast's loop."""
    data = _batches()
    expected = _hand_written(torch.bfloat16, data, scaler=None)
    state = P.make_state()
    forward_dtypes = set()
    state.model[0].register_forward_hook(lambda m, i, out: forward_dtypes.add(out.dtype))
    step = af.compose(af.with_precision("bf16"), af.accumulate(2), af.clip(0.5))(af.train_step(P.mse))
    state = af.run(step, state, data, backend=cuda, progress=False)
    assert forward_dtypes == {torch.bfloat16}
    assert {p.dtype for p in state.model.parameters()} == {torch.float32}
    _assert_params_close(P.parameters(state), {k: v.detach() for k, v in expected.state_dict().items()},
                         rtol=1e-5, atol=1e-6)


def test_fp16_on_cuda_equals_the_grad_scaler_loop_and_skips_an_overflow(cuda: af.backends.Backend) -> None:
    """with_precision('fp16') skips the window with an inf and matches torch.amp.GradScaler's parameters and scale."""
    data = _batches(bad=3)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    expected = _hand_written(torch.float16, data, scaler=scaler)
    step = af.compose(af.with_precision("fp16", init_scale=2.0**10), af.accumulate(2), af.clip(0.5))(
        af.train_step(P.mse))
    state = af.run(step, P.make_state(), data, backend=cuda, progress=False)
    assert state.step == 1  # the second window overflowed
    assert state.transforms_state["loss_scale"].scale == scaler.get_scale() == 2.0**9
    _assert_params_close(P.parameters(state), {k: v.detach() for k, v in expected.state_dict().items()},
                         rtol=1e-5, atol=1e-6)


def test_evaluate_on_cuda_equals_the_cpu(cuda: af.backends.Backend) -> None:
    """evaluate on the GPU returns the CPU's outputs, in dataset order, on the GPU."""
    loader = DataLoader(P.IndexDataset(9), batch_size=5)
    expected = af.evaluate(P.eval_outputs, P.make_state(seed=7), loader, backend=_cpu())
    state = P.make_state(seed=7)
    state.model.cuda()
    got = af.evaluate(P.eval_outputs, state, loader, backend=cuda)
    assert got["prediction"].device.type == "cuda"
    assert torch.equal(got["index"].cpu(), torch.arange(9))
    torch.testing.assert_close(got["prediction"].cpu(), expected["prediction"], rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
def test_launch_with_backend_cuda_gives_workers_the_cuda_backend(tmp_path: Path) -> None:
    """`accelfn launch --backend cuda` makes af.backends.auto() return the CUDA backend in the worker."""
    _launch.launch("--backend", "cuda", "--nproc-per-node", "1", "--timeout-s", "60", script="hello.py",
                   script_args=("--out", tmp_path), cwd=tmp_path)
    (record,) = _launch.read_ranks(tmp_path, 1)
    assert (record["backend"], record["requested_backend"], record["world_size"]) == ("cuda", "cuda", 1)


@pytest.mark.multiprocess
@pytest.mark.skipif(NUM_GPUS < 2, reason=f"DDP over NCCL needs 2 GPUs; this machine has {NUM_GPUS}")
def test_ddp_over_two_gpus_equals_the_cpu_reference(tmp_path: Path) -> None:
    """2 GPU processes x batch 3 under NCCL DDP give the CPU parameters of 1 process x batch 6, replicas equal."""
    _launch.launch("--backend", "cuda", "--nproc-per-node", "2", "--timeout-s", "120", script="cuda_ddp.py",
                   script_args=("--out", tmp_path), cwd=tmp_path)
    ranks = [load_file(tmp_path / f"rank{r}.safetensors") for r in range(2)]
    for case in ("e2", "e2_acc2_clip"):
        expected = P.parameters(P.train_case(case, _cpu(), 2 * P.PER_RANK_BATCH))
        for tensors in ranks:
            got = {k[len(f"train.{case}."):]: v for k, v in tensors.items() if k.startswith(f"train.{case}.")}
            _assert_params_close(got, expected, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])
    assert torch.equal(ranks[0]["evaluate.index"], torch.arange(9))


# -- placement opt-out and precision in user code (issue 15, items 6 and 7) ----------------


class _Split(torch.nn.Module):
    """6 -> 16 -> 3 whose layers may sit on different devices; the forward moves activations."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(6, 16)
        self.last = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x.to(self.first.weight.device)))
        return self.last(h.to(self.last.weight.device))


def _split_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    out = model(x)
    return F.cross_entropy(out, y.to(out.device))


def test_cuda_without_model_placement_trains_a_model_split_over_gpu_and_cpu() -> None:
    """place_model=False: a model with its first layer on the GPU and its last on the CPU stays
    split through run, and trains to the CPU reference's parameters (1e-5)."""
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(4)]
    step = af.train_step(_split_loss)
    reference = _Split()
    af.run(step, af.TrainState.create(reference, torch.optim.SGD(reference.parameters(), lr=0.1)), data,
           backend=_cpu(), epochs=2, progress=False)

    split = _Split()
    split.first.cuda()
    backend = af.backends.CUDA(af.backends.LaunchEnv(), place_model=False)
    state = af.run(step, af.TrainState.create(split, torch.optim.SGD(split.parameters(), lr=0.1)), data,
                   backend=backend, epochs=2, progress=False)
    assert state.step == 8
    assert [p.device.type for p in split.parameters()] == ["cuda", "cuda", "cpu", "cpu"]
    _assert_params_close(dict(split.named_parameters()), dict(reference.named_parameters()), rtol=1e-5, atol=1e-6)


def test_cuda_without_batch_placement_leaves_batches_where_the_collate_put_them() -> None:
    """place_batches=False: batches and evaluate's inputs stay on the CPU; by default they go to the GPU."""
    data = [(torch.randn(4, 6), torch.zeros(4, dtype=torch.int64)) for _ in range(3)]
    step = af.train_step(_split_loss)
    kept = af.backends.CUDA(af.backends.LaunchEnv(), place_batches=False)
    placed = af.backends.CUDA(af.backends.LaunchEnv())
    assert [b[0].device.type for b, _ in kept.batches(data, step, 0)] == ["cpu"] * 3
    assert [b[0].device.type for b, _ in placed.batches(data, step, 0)] == ["cuda"] * 3
    seen = []
    model = torch.nn.Linear(6, 2)
    state, _ = kept.prepare(step, af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1)))
    af.evaluate(lambda m, x: seen.append(x.device.type) or m(x.cuda()), state,
                DataLoader(torch.randn(5, 6), batch_size=5), backend=kept)
    assert seen == ["cpu"] and model.weight.device.type == "cuda"


@pytest.mark.parametrize(("policy", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_cuda_autocast_of_a_program_computes_in_its_dtype(cuda: af.backends.Backend, policy: str,
                                                          dtype: torch.dtype) -> None:
    """backend.autocast(step) on the GPU is torch.autocast("cuda", compute dtype): a Linear returns it."""
    step = af.with_precision(policy)(af.train_step(_split_loss))
    layer = torch.nn.Linear(6, 2).cuda()
    with cuda.autocast(step):
        assert torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == dtype
        assert layer(torch.randn(3, 6, device="cuda")).dtype == dtype
def _check_sharded_run(tmp_path: Path, world_size: int, *, offload: bool) -> None:
    """The gathered parameters and logged grad_norm of cuda_shard.py's two optimizers equal the
    hand-written CPU loop over windows of 12 samples; evaluate returns the hand-written model's
    predictions; bf16 lowers the loss; with offload the shards and moments live in CPU memory."""
    ranks = [load_file(tmp_path / f"rank{r}.safetensors") for r in range(world_size)]
    records = _launch.read_ranks(tmp_path, world_size)
    for name in S.OPTIMIZERS:
        model, norms = S.hand_written(name)
        expected = {k: v.detach() for k, v in model.state_dict().items()}
        for tensors in ranks:
            got = {k[len(f"train.{name}."):]: v for k, v in tensors.items() if k.startswith(f"train.{name}.")}
            _assert_params_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(records[0][name]["grad_norms"]), torch.tensor(norms), rtol=1e-5, atol=0)
        for record in records:
            assert record[name]["param_types"] == ["DTensor"]
            assert record[name]["shard_devices"] == record[name]["moment_devices"] == (["cpu"] if offload else ["cuda"])
        if name == "adamw":
            with torch.no_grad():
                predictions = model(P.IndexDataset(9).x)
            for tensors in ranks:
                assert torch.equal(tensors["evaluate.index"], torch.arange(9))
                torch.testing.assert_close(tensors["evaluate.prediction"], predictions, rtol=1e-5, atol=1e-5)
    for record in records:
        losses = record["bf16_losses"]
        assert sum(losses[-8:]) < 0.5 * sum(losses[:8]), losses
    if world_size > 1:
        assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])


@pytest.mark.multiprocess
def test_shard_params_with_cpu_offload_on_one_gpu_equals_the_hand_written_loop(tmp_path: Path) -> None:
    """shard_params(offload=True) on one GPU (FSDP2 over a 1-process NCCL group, shards and
    AdamW moments in CPU memory) with accumulate(2) and clip(1.0) matches the CPU loop (1e-5)."""
    _launch.launch("--backend", "cuda", "--nproc-per-node", "1", "--timeout-s", "120", script="cuda_shard.py",
                   script_args=("--out", tmp_path, "--offload"), cwd=tmp_path)
    _check_sharded_run(tmp_path, 1, offload=True)


@pytest.mark.multiprocess
@pytest.mark.skipif(NUM_GPUS < 2, reason=f"FSDP2 over NCCL needs 2 GPUs; this machine has {NUM_GPUS}")
@pytest.mark.parametrize("offload", [False, True], ids=["on-gpu", "offload"])
def test_shard_params_over_two_gpus_equals_the_hand_written_loop(tmp_path: Path, offload: bool) -> None:
    """2 GPU processes x batch 3 under shard_params (NCCL), with and without CPU offload, give
    on both ranks the parameters of the hand-written 1-process loop over windows of 12 samples."""
    args: tuple[Any, ...] = ("--out", tmp_path, "--offload") if offload else ("--out", tmp_path)
    _launch.launch("--backend", "cuda", "--nproc-per-node", "2", "--timeout-s", "120", script="cuda_shard.py",
                   script_args=args, cwd=tmp_path)
    _check_sharded_run(tmp_path, 2, offload=offload)


@pytest.mark.parametrize("name", ["digits", "byte_lm", "hf_gpt2"])
def test_planned_micro_batch_peak_is_within_ten_percent_of_max_memory_allocated(cuda: af.backends.Backend,
                                                                               name: str) -> None:
    """On the GPU, the plan's micro-batch peak (traced on fake CUDA tensors under CUDA autocast)
    is within 10 % of what the same forward and backward add to ``torch.cuda.max_memory_allocated``
    over the model and batch already on the device (measured on a second micro-batch, after a
    first that allocated cuBLAS's workspace; gradients set to None in between)."""
    from accelfn.step import unpack
    from tests.helpers import planning

    pytest.importorskip("transformers" if name == "hf_gpt2" else "sklearn" if name == "digits" else "torch")
    model, loss_fn, loader, precision = planning.example_case(name)
    state = af.TrainState.create(model, torch.optim.AdamW(model.parameters()))
    step = af.with_precision(precision)(af.train_step(loss_fn))
    planned = af.plan(step, state, loader, backend=cuda).memory[0].micro_batch
    assert planned is not None, "the micro-batch was not traced"
    model = model.to("cuda")
    batch = next(iter(loader))
    batch = {k: v.cuda() for k, v in batch.items()} if isinstance(batch, dict) else [t.cuda() for t in batch]
    for _ in range(2):  # the second micro-batch is measured
        for p in model.parameters():
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = unpack(loss_fn(model, batch))[0]
        loss.backward()
        del loss
        torch.cuda.synchronize()
    real = torch.cuda.max_memory_allocated() - base
    print(f"{name}: planned {planned} B, max_memory_allocated {real} B, {100 * (planned - real) / real:+.1f} %")
    assert abs(planned - real) <= 0.10 * real
