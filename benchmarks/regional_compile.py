"""Regional compilation (``af.compile(regions=True)``) against whole-model compilation
(``af.compile()``) and eager: the cold-start compile time and the step time of a small
GPT-style model of repeated blocks, on the CPU, with inductor.

Usage: PYTHONPATH=$PWD python benchmarks/regional_compile.py [--blocks 12] [--steps 20] [--recompute]

Each contestant runs in a fresh process (no TorchDynamo or inductor cache shared: inductor's
on-disk caches are switched off), prepares the same state and program, and times its steps:
``compile_s`` is the first step's time less the median step (what compiling cost), ``step_ms``
the median of the steps after the first three. ``cpu`` columns are the process's CPU time (the
figure to compare on a shared machine), the others wall time. One torch thread, and inductor
compiles in the process itself (no compile workers), so that the CPU time is all of it.
Prints one table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

WIDTH, HEADS, CONTEXT, VOCAB, BATCH = 128, 4, 64, 256, 4


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
    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(blocks))
        self.ln = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())


def one(contestant: str, blocks: int, steps: int, recompute: bool) -> dict[str, float]:
    """Runs one contestant in this process; its times."""
    import accelfn as af

    torch.set_num_threads(1)  # as the other benchmarks: one torch thread per process
    torch._inductor.config.fx_graph_cache = False
    torch._inductor.config.autotune_local_cache = False
    torch._inductor.config.compile_threads = 1  # compiled in this process: its CPU time counts all of it
    torch.manual_seed(0)
    model = GPT(blocks)
    state = af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    transforms = [af.checkpoint_activations()] if recompute else []
    if contestant == "whole":
        transforms.append(af.compile())
    elif contestant == "regional":
        transforms.append(af.compile(regions=True))
    state, step_fn = af.backends.CPU().prepare(af.compose(*transforms)(af.train_step(loss_fn)), state)
    batch = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=torch.Generator().manual_seed(1))
    walls, cpus = [], []
    for _ in range(steps):
        wall, cpu = time.perf_counter(), time.process_time()
        state, _ = step_fn(state, batch)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    step, step_cpu = statistics.median(walls[3:]), statistics.median(cpus[3:])
    return {"compile_s": walls[0] - step, "compile_cpu_s": cpus[0] - step_cpu, "step_ms": 1000 * step,
            "step_cpu_ms": 1000 * step_cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--recompute", action="store_true", help="with af.checkpoint_activations() in every program")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.blocks, args.steps, args.recompute)))
        return
    rows = {}
    for contestant in ("eager", "whole", "regional"):
        extra = ["--recompute"] if args.recompute else []
        out = subprocess.run([sys.executable, __file__, "--one", contestant, "--blocks", str(args.blocks),
                              "--steps", str(args.steps), *extra], check=True, capture_output=True, text=True)
        rows[contestant] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{args.blocks} blocks of width {WIDTH}, batch {BATCH} x {CONTEXT} tokens, "
          f"{args.steps} steps{', checkpoint_activations()' if args.recompute else ''}\n")
    print("| | compile s (CPU) | compile s (wall) | ms/step (CPU) | ms/step (wall) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    names = {"eager": "eager", "whole": "`af.compile()`", "regional": "`af.compile(regions=True)`"}
    for contestant, r in rows.items():
        compile_cpu = "" if contestant == "eager" else f"{r['compile_cpu_s']:.1f}"
        compile_wall = "" if contestant == "eager" else f"{r['compile_s']:.1f}"
        print(f"| {names[contestant]} | {compile_cpu} | {compile_wall} | {r['step_cpu_ms']:.1f} | {r['step_ms']:.1f} |")


if __name__ == "__main__":
    main()
