"""Planning a 1B-parameter GPT-2-style model built on the meta device for 64 processes under
shard_params: the time ``af.plan`` takes and the host memory it adds (peak RSS growth).

Usage: python benchmarks/plan_1b.py [--no-trace]   (prints one JSON line)

``seconds`` is wall time, ``cpu_seconds`` this process's CPU time (the figure to compare on a
shared machine); ``extra_host_mib`` the growth of the peak resident set during ``af.plan``.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import accelfn as af

VOCAB, CONTEXT, WIDTH, DEPTH, HEADS = 50257, 1024, 2048, 18, 16


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(WIDTH), torch.nn.LayerNorm(WIDTH)
        self.qkv, self.proj = torch.nn.Linear(WIDTH, 3 * WIDTH), torch.nn.Linear(WIDTH, WIDTH)
        self.fc, self.out = torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Embedding(CONTEXT, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(DEPTH))
        self.ln = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class Tokens(Dataset):
    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (CONTEXT + 1,), generator=torch.Generator().manual_seed(i))


def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def main(trace: bool) -> dict[str, float]:
    with torch.device("meta"):
        model = GPT()
    state = af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    step = af.compose(af.shard_data(), af.shard_params(), af.with_precision("bf16"), af.accumulate(8),
                      af.clip(1.0))(af.train_step(loss_fn))
    data = DataLoader(Tokens(), batch_size=4, shuffle=True)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start, cpu = time.perf_counter(), time.process_time()
    plan = af.plan(step, state, data, world_size=64, max_steps=10_000, epochs=None, trace=trace)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB on Linux
    return {"params": sum(p.numel() for p in model.parameters()), "seconds": seconds, "cpu_seconds": cpu_seconds,
            "extra_host_mib": grown / 1024, "per_rank_peak_gib": plan.memory[0].peak / 2**30,
            "micro_batch_gib": (plan.memory[0].micro_batch or 0) / 2**30, "errors": len(plan.errors)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-trace", action="store_true", help="skip tracing one micro-batch on fake tensors")
    print(json.dumps(main(not parser.parse_args().no_trace)))
