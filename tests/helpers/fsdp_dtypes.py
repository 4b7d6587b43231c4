"""Two FSDP2 dtype cases under shard_params + bf16 (torch issues pytorch#186998, #196996) and
their one-process references with bf16 autocast.

``unfreeze``: two blocks frozen for a first ``run`` (epoch 0), unfrozen for a second (epoch 1).
``aux``: accumulate(2) where an auxiliary head is used only on each window's last micro-batch.
The data: 8 micro-batches of 8 samples; rank ``r`` of ``W`` reads rows ``r::W`` of each.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class Unfreeze(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
        self.out = torch.nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.out(h)


class Aux(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 8)
        self.head = torch.nn.Linear(8, 1)
        self.aux = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        out = self.head(h)
        return out + self.aux(h) if use_aux else out


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "aux":
        return Aux()
    model = Unfreeze()
    model.blocks.requires_grad_(False)
    return model


def micro_batches(kind: str) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    if kind == "aux":  # the flag: use the auxiliary head (the window's second micro-batch)
        return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g), torch.full((8,), k % 2))
                for k in range(8)]
    x, y = torch.randn(64, 4, generator=g), torch.randn(64, 2, generator=g)
    return [(x[i:i + 8], y[i:i + 8]) for i in range(0, 64, 8)]


def rank_batches(kind: str, rank: int, world_size: int) -> list[tuple[torch.Tensor, ...]]:
    return [tuple(t[rank::world_size] for t in batch) for batch in micro_batches(kind)]


def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    if len(batch) == 3:
        x, y, flag = batch
        return F.mse_loss(model(x, bool(flag[0])).float(), y)
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def reference(kind: str) -> dict[str, torch.Tensor]:
    """SGD(lr=0.2) on the whole micro-batches in one process, forwards under bf16 autocast."""
    model = build(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    batches = micro_batches(kind)
    epochs, window = (1, 2) if kind == "aux" else (2, 1)
    for epoch in range(epochs):
        if epoch == 1:
            model.blocks.requires_grad_(True)  # type: ignore[union-attr]
        for k in range(0, len(batches), window):
            for batch in batches[k:k + window]:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = loss_fn(model, batch)
                (loss / window).backward()
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
