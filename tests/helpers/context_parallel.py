"""The small causal transformer of the ``context_parallel`` tests (tests/workers/cp_checks.py and
their one-process references): token and position embeddings (positions read from the batch,
so a rank's part of a sequence keeps its own), 2 pre-norm blocks of causal
``scaled_dot_product_attention`` with 2 heads, and a linear head."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import accelfn as af

VOCAB = 32
WIDTH = 16
HEADS = 2
LENGTH = 16  # 4 parts of 4 under context_parallel(size=2), load balanced
NUM_SEQUENCES = 8
BATCH = 4  # sequences per update, over every data shard
LR = 0.5  # SGD: the first update's gradient is (before - after) / LR, to ~1e-7
UPDATES = 2  # NUM_SEQUENCES / BATCH
IGNORE = -100


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(WIDTH), torch.nn.LayerNorm(WIDTH)
        self.qkv, self.proj = torch.nn.Linear(WIDTH, 3 * WIDTH), torch.nn.Linear(WIDTH, WIDTH)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
                                       torch.nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, seq, width)
        q, k, v = self.qkv(self.norm1(x)).unflatten(-1, (3, HEADS, WIDTH // HEADS)).unbind(2)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).flatten(2))
        return x + self.mlp(self.norm2(x))


class Transformer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.position = torch.nn.Embedding(LENGTH, WIDTH)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def make_state() -> af.TrainState:
    torch.manual_seed(0)
    model = Transformer()
    return af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=LR))


def sequences(length: int = LENGTH) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens, positions, targets)``, each ``(NUM_SEQUENCES, length)``; about a third of the
    targets ignored, unevenly over the sequences' parts (so per-part means differ from the mean)."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (NUM_SEQUENCES, length + 1), generator=g)
    targets = tokens[:, 1:].clone()
    targets[torch.rand(targets.shape, generator=g) < torch.linspace(0.0, 0.7, length)] = IGNORE
    positions = torch.arange(length).expand(NUM_SEQUENCES, length).clone()
    return tokens[:, :-1], positions, targets


def mean_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The mean cross entropy over every target (none ignored)."""
    tokens, positions, targets = batch
    logits = model(tokens, positions)
    return F.cross_entropy(logits.flatten(0, 1), targets.clamp_min(0).flatten())


def counted_loss(model: torch.nn.Module, batch: Any) -> af.Loss:
    """The summed cross entropy over the targets not ignored, and their number."""
    tokens, positions, targets = batch
    logits = model(tokens, positions)
    total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")
    return af.Loss(total=total, count=(targets != IGNORE).sum())


LOSSES = {"mean": mean_loss, "counted": counted_loss}


def reference(loss: str) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, full attention: the losses of ``UPDATES`` SGD updates over batches of
    ``BATCH`` sequences in order, the first update's gradients, and the final parameters."""
    state = make_state()
    model, optimizer = state.model, state.optimizer
    data = sequences()
    losses: list[float] = []
    first: dict[str, torch.Tensor] = {}
    for u in range(UPDATES):
        batch = tuple(t[u * BATCH:(u + 1) * BATCH] for t in data)
        out = LOSSES[loss](model, batch)
        value = out.total / out.count if isinstance(out, af.Loss) else out
        value.backward()
        losses.append(float(value.detach()))
        if u == 0:
            first = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return losses, first, {n: p.detach().clone() for n, p in model.named_parameters()}


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a sharded one gathered: a collective on every rank)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}
