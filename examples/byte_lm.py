"""A small transformer language model on the bytes of Python's own standard library.

    python examples/byte_lm.py                                # one process, a few minutes on 2 cores
    accelfn launch --nproc-per-node 2 examples/byte_lm.py     # two processes, same script
    python examples/byte_lm.py                                # again: resumes from the latest checkpoint
    python examples/byte_lm.py --width 64 --depth 2 --max-steps 300   # every Config field is a flag
    accelfn launch --nproc-per-node 2 examples/byte_lm.py --shard     # shard_params() instead of replicate()
    accelfn launch --nproc-per-node 2 examples/byte_lm.py --tp 2      # attention and MLP split over 2 ranks
    accelfn launch --nproc-per-node 4 examples/byte_lm.py --tp 2      # 2-D: FSDP2 over 2 x TP over 2
    accelfn launch --nproc-per-node 2 examples/byte_lm.py --pp 2      # 2 pipeline stages (1F1B)
    accelfn launch --nproc-per-node 4 examples/byte_lm.py --pp 2      # 2 stages x 2 data-parallel replicas

The text is real and on every machine: the ``.py`` files next to the ``os`` module, read as
bytes (a vocabulary of 256). The model is a decoder-only transformer (pre-norm blocks,
causal ``scaled_dot_product_attention``, output layer tied to the byte embedding). Training
composes ``shard_data``, ``replicate`` (or, with ``--shard``, ``shard_params``: each process
holds half of the parameters, gradients and AdamW moments, each transformer block one FSDP
unit), ``with_precision("bf16")``, ``accumulate`` and ``clip`` around a plain loss function,
saves a checkpoint every ``--every-steps`` updates (0: none) and resumes from the latest one
when started again (``resume="auto"``). It prints the
held-out loss before and after training (nats per byte, from ``af.evaluate``) and a sample
of generated text.

Measured on a 2-core machine shared with other jobs (so about one core for this one): the
default 300 updates bring the held-out loss from 5.67 nats/byte (a uniform guess over 256
bytes is 5.55) to 2.38 in 7 minutes, below 3 after the first 100 updates; ``--max-steps
600`` reaches 1.76 nats/byte (2.5 bits) in 9 minutes, and its samples look like Python.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils.data import DataLoader, Dataset

import accelfn as af


@attrs.frozen
class Config:
    """Model and training sizes; the defaults lower the loss clearly in minutes on 2 cores."""

    context: int = 128  # bytes the model sees
    width: int = 128  # model dimension
    depth: int = 4  # transformer blocks
    heads: int = 4
    batch_size: int = 16  # sequences per micro-batch and process
    accumulate: int = 2  # micro-batches per optimizer update
    lr: float = 3e-3
    max_steps: int = 300  # optimizer updates in all (a total: a resumed run stops here too)
    warmup_steps: int = 50
    max_bytes: int = 4_000_000  # how much of the standard library to read
    seed: int = 0


# -- data -------------------------------------------------------------------------------------


def stdlib_bytes(max_bytes: int) -> bytes:
    """The standard library's ``.py`` files, in sorted path order, as one byte string."""
    root = Path(os.__file__).parent
    chunks, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or size >= max_bytes:
            continue
        text = path.read_bytes()
        chunks.append(text)
        size += len(text)
    return b"".join(chunks)[:max_bytes]


class Blocks(Dataset):
    """Non-overlapping windows of ``context + 1`` bytes: ``(input (context,), target (context,))``.

    The target is the input shifted by one byte: the model predicts every next byte.
    """

    def __init__(self, data: torch.Tensor, context: int):
        self.data, self.context = data, context

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.context

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.context:(i + 1) * self.context + 1].long()
        return chunk[:-1], chunk[1:]


def datasets(config: Config) -> tuple[Blocks, Blocks]:
    """The first 95% of the bytes for training, the last 5% held out."""
    data = torch.frombuffer(bytearray(stdlib_bytes(config.max_bytes)), dtype=torch.uint8)
    cut = int(len(data) * 0.95)
    return Blocks(data[:cut], config.context), Blocks(data[cut:], config.context)


# -- model ------------------------------------------------------------------------------------


class Block(torch.nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP, each residual.

    The fused ``qkv`` projection's outputs are laid out head by head (``(heads, 3, head
    width)``, as Megatron-LM lays out its ``query_key_value``), so a column-wise split of
    ``qkv`` over ``t`` ranks gives each rank the queries, keys and values of ``heads / t``
    whole heads; the forward reads how many heads it holds from the projection's output, so
    the same code runs whole or split (``TP_PLAN``).
    """

    def __init__(self, width: int, heads: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"Block(width={width}, heads={heads}): the width must divide by the number of heads")
        self.head_width = width // heads
        self.norm1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.norm2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, seq, width)
        b, t, _ = x.shape
        # (batch, seq, heads here, 3, head width): every head when whole, heads / tp of them when split
        q, k, v = self.qkv(self.norm1(x)).view(b, t, -1, 3, self.head_width).unbind(3)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True)  # (batch, heads here, seq, head width)
        x = x + self.proj(attended.transpose(1, 2).flatten(2))  # split: a row-wise proj sums the ranks' heads
        return x + self.mlp(self.norm2(x))


class ByteLM(torch.nn.Module):
    """Bytes in, next-byte logits out: ``(batch, seq) int64 -> (batch, seq, 256)``.

    ``tie=False`` gives the output layer a weight of its own (a pipeline's first and last
    stages cannot share one), initialized equal to the embedding's.
    """

    def __init__(self, config: Config, tie: bool = True):
        super().__init__()
        self.embed = torch.nn.Embedding(256, config.width)
        self.position = torch.nn.Parameter(torch.zeros(config.context, config.width))
        self.blocks = torch.nn.ModuleList(Block(config.width, config.heads) for _ in range(config.depth))
        self.norm = torch.nn.LayerNorm(config.width)
        self.head = torch.nn.Linear(config.width, 256, bias=False)
        self.head.weight = self.embed.weight  # tied: one (256, width) matrix
        torch.nn.init.normal_(self.position, std=0.02)
        torch.nn.init.normal_(self.embed.weight, std=0.02)
        if not tie:
            self.head.weight = torch.nn.Parameter(self.embed.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.position[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-byte cross-entropy in nats (computed in fp32 from the bf16 logits)."""
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def pipeline_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``loss_fn`` under ``--pp`` (``af.output_loss``): the same loss, from the last stage's logits and the targets."""
    return F.cross_entropy(output.float().flatten(0, 1), targets.flatten())


def per_sequence_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of each sequence, shape ``(batch,)``, for ``af.evaluate``."""
    x, y = batch
    logits = model(x).float()
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)


@torch.inference_mode()
def generate(model: ByteLM, prompt: bytes, num_bytes: int, context: int, *, temperature: float = 0.8,
             seed: int = 0) -> bytes:
    """``num_bytes`` bytes sampled after ``prompt`` (a fixed seed: the same text every time).

    A model sharded with ``shard_params`` gathers its parameters in every forward, a
    collective: call this on every rank then (each samples the same text).
    """
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    out = torch.tensor(list(prompt), dtype=torch.int64, device=device)[None]
    was_training = model.training
    model.eval()
    for _ in range(num_bytes):
        logits = model(out[:, -context:])[0, -1].float() / temperature
        next_byte = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        out = torch.cat([out, next_byte[None]], dim=1)
    model.train(was_training)
    return bytes(out[0].tolist())


# -- training ---------------------------------------------------------------------------------


def warmup_cosine(config: Config):
    """Linear warm-up over ``warmup_steps`` updates, then cosine decay to 10% at ``max_steps``."""

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = min(1.0, (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def held_out_loss(state: af.TrainState, held_out: Blocks, backend: af.backends.Backend, num: int = 64) -> float:
    """Mean loss in nats per byte over the first ``num`` held-out sequences, all ranks together."""
    loader = DataLoader(torch.utils.data.Subset(held_out, range(min(num, len(held_out)))), batch_size=16)
    return af.evaluate(per_sequence_loss, state, loader, backend=backend).mean().item()


#: the tensor-parallel plan of ``--tp`` (Megatron-LM's): in each block the attention's fused
#: ``qkv`` projection column-wise (each rank computes ``heads / tp`` whole heads, see ``Block``) and
#: its output projection row-wise (the heads' outputs summed over the ranks); the MLP's first
#: layer column-wise and its second row-wise. One all-reduce per row-wise layer in the forward.
#: The embedding (tied to the output layer), positions and norms stay whole on every rank.
TP_PLAN = {"blocks.*.qkv": "colwise", "blocks.*.proj": "rowwise",
           "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}


def tp_plan(config: Config, tp: int) -> dict[str, str]:
    """``TP_PLAN``, after checking that ``config``'s heads divide over ``tp`` ranks.

    Raises:
        ValueError: ``config.heads`` is not a multiple of ``tp`` (a rank would hold part of a
            head, whose attention cannot be computed from part of its width).
    """
    if config.heads % tp:
        raise ValueError(
            f"--tp {tp}: tensor parallelism splits the attention by heads, and the {config.heads} heads "
            f"(--heads) cannot be divided over {tp} ranks; use a --tp that divides --heads "
            f"(one of {', '.join(str(d) for d in range(1, config.heads + 1) if config.heads % d == 0)}), "
            f"or a --heads that is a multiple of {tp}"
        )
    return dict(TP_PLAN)


def split_points(config: Config, stages: int) -> list[str]:
    """``--pp``'s split points: the blocks cut into ``stages`` runs of (nearly) equal length."""
    return [f"blocks.{config.depth * i // stages}" for i in range(1, stages)]


def main(config: Config = Config(), *, run_dir: str = "runs/byte_lm", every_steps: int = 100,
         progress: bool = True, sample_bytes: int = 300,
         shard: bool = False, tp: int = 1, pp: int = 1) -> tuple[af.TrainState, dict[str, float]]:
    """Trains (or resumes) and returns the final state and the held-out losses before/after.

    ``shard=True`` trains with ``shard_params()`` instead of ``replicate()``; ``tp > 1`` splits
    each block's attention (by heads) and MLP over groups of ``tp`` ranks (``tensor_parallel``,
    ``TP_PLAN``; ``config.heads`` must divide by ``tp``), with ``shard_params()``
    over the data dimension when there are more processes than ``tp`` (2-D); ``pp > 1`` cuts
    the blocks into ``pp`` pipeline stages (``pipeline``, 1F1B, the output layer untied), with
    ``replicate()`` over the data dimension when there are more processes than ``pp``, and
    evaluates and samples the exported whole model; ``every_steps=0`` saves no checkpoints
    (and so resumes from none).
    """
    plan = tp_plan(config, tp) if tp > 1 else None  # before anything runs
    backend = af.backends.auto()
    torch.manual_seed(config.seed)
    train, held_out = datasets(config)
    loader = DataLoader(train, batch_size=config.batch_size, shuffle=True)

    model = ByteLM(config, tie=pp == 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(config))
    state = af.TrainState.create(model, optimizer, scheduler=scheduler)

    if plan is not None:  # replicate() does not take DTensors: data parallel over the data dimension is FSDP2
        parallel = [af.tensor_parallel(plan, size=tp)] + ([af.shard_params()] if backend.world_size > tp else [])
    elif pp > 1:  # stage s on ranks s*d .. s*d+d-1: its d replicas over the data dimension
        parallel = [af.pipeline(split_points(config, pp), size=pp)]
        parallel += [af.replicate()] if backend.world_size > pp else []
    else:
        parallel = [af.shard_params() if shard else af.replicate()]
    step = af.compose(
        af.shard_data(seed=config.seed),
        *parallel,
        af.with_precision("bf16"),
        af.accumulate(config.accumulate),
        af.clip(1.0),
    )(af.train_step(af.output_loss(pipeline_loss) if pp > 1 else loss_fn))

    before = held_out_loss(state, held_out, backend)
    backend.print(f"{len(train)} training sequences of {config.context} bytes; held-out loss "
                  f"{before:.3f} nats/byte before training, at initialization (uniform guess: "
                  f"{math.log(256):.3f}; a resumed run then continues from its checkpoint)")
    checkpoints = af.Checkpoints(f"{run_dir}/ckpt", every_steps=every_steps, keep=2) if every_steps else None
    state = af.run(step, state, loader, backend=backend, epochs=1000, max_steps=config.max_steps,
                   checkpoints=checkpoints, resume="auto" if checkpoints else None,
                   trackers=[af.TensorBoard(f"{run_dir}/tb")], progress=progress, log_every=10)
    trained = state
    if pp > 1:  # each rank holds its stages only: evaluate and sample the whole model, exported and loaded
        af.save_model(state, f"{run_dir}/model", backend=backend)
        whole = ByteLM(config, tie=False)
        whole.load_state_dict(load_file(f"{run_dir}/model/model.safetensors"), strict=True)
        trained = af.TrainState.create(whole, torch.optim.SGD(whole.parameters(), lr=0.0))
    after = held_out_loss(trained, held_out, backend)
    backend.print(f"held-out loss {after:.3f} nats/byte ({after / math.log(2):.2f} bits/byte) "
                  f"after {state.step} optimizer updates")
    if sample_bytes and (shard or tp > 1 or backend.is_main_process):  # a sharded or split forward needs every rank
        text = generate(trained.model, b"def ", sample_bytes, config.context)
        backend.print("sample:\n" + text.decode("utf-8", errors="replace"))
    return state, {"before": before, "after": after}


def parse_args() -> tuple[Config, argparse.Namespace]:
    """The command line: every Config field as a flag (``--context 64``), and the run's paths."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field in attrs.fields(Config):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default,
                            metavar=field.name.upper(), help=f"(default {field.default})")
    parser.add_argument("--every-steps", type=int, default=100, help="checkpoint every this many updates (0: never)")
    parser.add_argument("--shard", action="store_true", help="shard_params() (FSDP2) instead of replicate()")
    parser.add_argument("--tp", type=int, default=1,
                        help="split each block's attention (by heads) and MLP over this many ranks")
    parser.add_argument("--pp", type=int, default=1, help="cut the blocks into this many pipeline stages")
    parser.add_argument("--run-dir", default="runs/byte_lm", help="checkpoints and TensorBoard logs")
    parser.add_argument("--sample-bytes", type=int, default=300, help="bytes of text to generate at the end")
    args = parser.parse_args()
    return Config(**{f.name: getattr(args, f.name) for f in attrs.fields(Config)}), args


if __name__ == "__main__":
    config, args = parse_args()
    main(config, run_dir=args.run_dir, every_steps=args.every_steps, sample_bytes=args.sample_bytes, shard=args.shard,
         tp=args.tp, pp=args.pp)
