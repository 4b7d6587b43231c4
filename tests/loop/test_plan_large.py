"""A 1B-parameter GPT-2-style model built on the meta device plans for 64 processes under
shard_params without materializing anything, its micro-batch traced on fake tensors: small host
memory, exact per-rank shards (its speed is benchmarks/plan_1b.py's; this test prints its own)."""

from __future__ import annotations

import importlib.util
import time
import tracemalloc

import torch

import accelfn as af
from tests.helpers import launch as _launch


def test_a_1b_model_on_the_meta_device_plans_for_64_processes_in_little_memory():
    """Planning the 1.1B-parameter model for 64 ranks allocates under 50 MB on the host, and each
    rank's planned AdamW state is two fp32 moments of its shards (plus the scalar steps)."""
    spec = importlib.util.spec_from_file_location("plan_1b", _launch.ROOT / "benchmarks" / "plan_1b.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with torch.device("meta"):
        model = bench.GPT()
    state = af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    step = af.compose(af.shard_data(), af.shard_params(), af.with_precision("bf16"))(af.train_step(bench.loss_fn))
    data = torch.utils.data.DataLoader(bench.Tokens(), batch_size=4)
    tracemalloc.start()
    start, cpu = time.perf_counter(), time.process_time()
    try:
        plan = af.plan(step, state, data, world_size=64, epochs=None, max_steps=10_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"1B plan for 64 ranks: {time.perf_counter() - start:.2f} s wall, {time.process_time() - cpu:.2f} s CPU "
          f"(under tracemalloc), {peak / 2**20:.1f} MiB of host allocations at the peak")
    assert peak < 50 * 2**20
    params = list(model.parameters())
    assert sum(p.numel() for p in params) > 1e9
    rank0 = sum(-(-p.shape[0] // 64) * p[0].numel() for p in params) * 4
    assert plan.memory[0].params == rank0
    assert plan.memory[0].optimizer == 2 * rank0 + 4 * len(params)
    assert plan.total_updates == 10_000 and not plan.errors
    # the traced micro-batch (4 sequences of 1024 tokens, bf16 autocast) holds at least the logits
    # in fp32 and their gradient, and less than the 18 blocks' activations could ever need
    logits = 4 * 1024 * bench.VOCAB * 4
    assert 2 * logits < plan.memory[0].micro_batch < 40 * 2**30
