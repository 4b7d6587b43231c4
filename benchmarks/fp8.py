"""FP8 against bf16 step time on one GPU: ``with_precision("fp8")`` vs ``with_precision("bf16")``.

    PYTHONPATH=$PWD python benchmarks/fp8.py                    # on a GPU of compute capability >= 8.9
    PYTHONPATH=$PWD python benchmarks/fp8.py --width 2048 --rounds 5

The model is a stack of residual MLP blocks (``x + W2 gelu(W1 x)``, ``width -> 4 width ->
width``), the shape float8 pays off on (torchao's tensorwise recipe gains where both matmul
dimensions reach a few thousand), with its output head kept in bf16 (``exclude``); AdamW, a
batch of ``tokens`` rows. Both programs run under ``compile()`` (torchao's float8 casts are
fused only when compiled; eager fp8 is slower than bf16). Rounds alternate the two programs;
each round times ``--updates`` updates after ``--warmup`` untimed ones, with
``torch.cuda.synchronize`` around the clock. Prints one row per program (median ms per update
over rounds) and the speed-up, ``bf16 / fp8``.

Without a CUDA GPU of compute capability 8.9 or newer it prints why it skipped and exits 0:
``scripts/gpu-check.sh`` runs it after the CUDA tests.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import accelfn as af


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width, bias=False)
        self.down = torch.nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1024, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).float(), y)


def skip_reason() -> str | None:
    """Why this machine cannot time fp8, or None."""
    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return f"{torch.cuda.get_device_name()} has compute capability {major}.{minor}; float8 matmuls need 8.9 or newer"
    try:
        import torchao  # noqa: F401
    except ModuleNotFoundError:
        return "torchao is not installed: pip install 'accelfn[fp8]'"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--updates", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    reason = skip_reason()
    if reason is not None:
        print(f"fp8 vs bf16 step time: skipped: {reason}")
        return 0
    backend = af.backends.CUDA()
    programs = {
        "bf16": af.compose(af.with_precision("bf16"), af.compile())(af.train_step(loss_fn)),
        "fp8": af.compose(af.with_precision("fp8", exclude=("head",)), af.compile())(af.train_step(loss_fn)),
    }
    g = torch.Generator(device="cuda").manual_seed(0)
    batch = (torch.randn(args.tokens, args.width, device="cuda", generator=g),
             torch.randint(0, 1024, (args.tokens,), device="cuda", generator=g))
    prepared = {}
    for name, step in programs.items():
        torch.manual_seed(0)
        model = Net(args.width, args.depth)
        state = af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        prepared[name] = backend.prepare(step, state)
    times: dict[str, list[float]] = {name: [] for name in programs}
    losses: dict[str, float] = {}
    for round_ in range(args.rounds):
        for name in (list(programs) if round_ % 2 == 0 else list(reversed(programs))):
            state, step_fn = prepared[name]
            for _ in range(args.warmup):
                state, _ = step_fn(state, batch)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.updates):
                state, metrics = step_fn(state, batch)
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / args.updates * 1e3)
            losses[name] = float(metrics["loss"])
            prepared[name] = (state, step_fn)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: width {args.width}, depth {args.depth}, "
          f"{args.tokens} tokens, {args.rounds} rounds x {args.updates} updates, compile()")
    print("| precision | ms/update (median) | last loss |")
    print("| --- | ---: | ---: |")
    for name in programs:
        print(f"| {name} | {statistics.median(times[name]):.2f} | {losses[name]:.4f} |")
    print(f"fp8 speed-up over bf16: {statistics.median(times['bf16']) / statistics.median(times['fp8']):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
