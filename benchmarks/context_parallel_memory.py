"""Peak memory per rank of one long sequence under ``context_parallel(size=1)`` and ``size=2``.

    accelfn launch --nproc-per-node 2 benchmarks/context_parallel_memory.py [--length 16384] [--width 512]

A causal transformer (width 512, 4 blocks of 8 heads, ``scaled_dot_product_attention`` with
``is_causal=True``, positions read from the batch) trains 3 updates on batches of one
sequence of ``--length`` tokens, under ``shard_params()`` alone (each rank holds every token of
its own sequence: CP = 1) and under ``context_parallel(size=2)`` + ``shard_params()`` (the two
ranks split one sequence: CP = 2). Printed per run: the plan's activation peak of one
micro-batch (``af.plan``, traced on fake tensors: a rank's part of each sequence) and, on CUDA,
the measured peak (``torch.cuda.max_memory_allocated``, rank 0, after the first update).
Under bf16 on CUDA, fp32 elsewhere. On the CPU only the planned column is filled (a quick check
of the script itself: ``--length 64 --width 32``).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import accelfn as af

HEADS, DEPTH, VOCAB = 8, 4, 256
WIDTH = 512  # --width


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(WIDTH), torch.nn.LayerNorm(WIDTH)
        self.qkv, self.proj = torch.nn.Linear(WIDTH, 3 * WIDTH), torch.nn.Linear(WIDTH, WIDTH)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
                                       torch.nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).unflatten(-1, (3, HEADS, -1)).transpose(1, 3).unbind(2)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))
        return x + self.mlp(self.norm2(x))


class LM(torch.nn.Module):
    def __init__(self, length: int) -> None:
        super().__init__()
        self.embed, self.position = torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Embedding(length, WIDTH)
        self.blocks = torch.nn.Sequential(*(Block() for _ in range(DEPTH)))
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens) + self.position(positions)))


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    tokens, positions, targets = batch
    return F.cross_entropy(model(tokens, positions).flatten(0, 1), targets.flatten())


def measure(size: int, length: int, backend: af.backends.Backend) -> tuple[float, float | None]:
    """(planned activation MiB, measured peak MiB or None) of one run under CP = ``size``."""
    torch.manual_seed(0)
    model = LM(length)
    state = af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    n = 3 * backend.world_size // size  # 3 updates on every rank
    tokens = torch.randint(0, VOCAB, (n, length + 1))
    data = TensorDataset(tokens[:, :-1], torch.arange(length).expand(n, -1), tokens[:, 1:])
    loader = DataLoader(data, batch_size=1)
    precision = "bf16" if backend.device.type == "cuda" else "fp32"
    transforms = [af.shard_data(), af.shard_params(), af.with_precision(precision)]
    if size > 1:
        transforms.append(af.context_parallel(size=size))
    step = af.compose(*transforms)(af.train_step(loss_fn))
    plan = af.plan(step, state, loader, backend=backend, epochs=1)
    assert plan.memory is not None
    planned = plan.memory[0].micro_batch / 2**20
    if backend.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(backend.device)
    af.run(step, state, loader, backend=backend, epochs=1, progress=False)
    if backend.device.type != "cuda":
        return planned, None
    return planned, torch.cuda.max_memory_allocated(backend.device) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    global WIDTH
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--width", type=int, default=WIDTH)
    args = parser.parse_args()
    length, WIDTH = args.length, args.width
    backend = af.backends.auto()
    rows = [(size, *measure(size, length, backend)) for size in (1, 2)]
    backend.print(f"one sequence of {length} tokens, width {WIDTH}, {DEPTH} blocks, shard_params over "
                  f"{backend.world_size} {backend.device.type} ranks")
    backend.print("| CP | planned activations / rank (MiB) | measured peak / rank (MiB) |")
    backend.print("| ---: | ---: | ---: |")
    for size, planned, peak in rows:
        backend.print(f"| {size} | {planned:.1f} | {'-' if peak is None else f'{peak:.0f}'} |")


if __name__ == "__main__":
    main()
