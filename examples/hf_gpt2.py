"""A Hugging Face GPT-2, built from a config (no download), trained by accelfn on raw bytes.

    pip install transformers
    python examples/hf_gpt2.py
    accelfn launch --nproc-per-node 2 examples/hf_gpt2.py

Any ``transformers`` model that computes its loss when given ``labels`` trains with
``loss_fn = lambda model, batch: model(**batch).loss``: the batch is the dict of keyword
arguments, moved to the device by the backend. The tokens here are the bytes of a few of
the Python standard library's source files (a vocabulary of 256, so no tokenizer either).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel

import accelfn as af


def loss_fn(model, batch):
    return model(**batch).loss


class ByteBlocks(Dataset):
    """Windows of ``context`` bytes as GPT-2 keyword arguments: ``input_ids`` and ``labels``
    (the model shifts the labels itself), each of shape ``(context,)``."""

    def __init__(self, data: torch.Tensor, context: int):
        self.data, self.context = data, context

    def __len__(self) -> int:
        return len(self.data) // self.context

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.data[i * self.context:(i + 1) * self.context].long()
        return {"input_ids": ids, "labels": ids}


def stdlib_bytes(names: tuple[str, ...] = ("os.py", "argparse.py", "functools.py", "textwrap.py")) -> torch.Tensor:
    root = Path(os.__file__).parent
    return torch.frombuffer(bytearray(b"".join((root / name).read_bytes() for name in names)), dtype=torch.uint8)


def gpt2(context: int) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 over bytes; dropout off, so runs are reproducible."""
    config = GPT2Config(vocab_size=256, n_positions=context, n_embd=64, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def main(*, steps: int = 200, context: int = 64, batch_size: int = 8, progress: bool = True) -> tuple[af.TrainState, list[float]]:
    """Trains for ``steps`` optimizer updates; returns the state and the logged losses."""
    backend = af.backends.auto()
    torch.manual_seed(0)
    loader = DataLoader(ByteBlocks(stdlib_bytes(), context), batch_size=batch_size, shuffle=True)
    model = gpt2(context)
    state = af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    step = af.compose(af.shard_data(), af.replicate(), af.accumulate(2), af.clip(1.0))(af.train_step(loss_fn))

    class Losses:
        def __init__(self) -> None:
            self.values: list[float] = []

        def log(self, metrics, step):
            self.values.append(metrics["loss"])

        def close(self) -> None:
            pass

    losses = Losses()
    state = af.run(step, state, loader, backend=backend, epochs=1000, max_steps=steps, trackers=[losses],
                   log_every=10, progress=progress)
    if losses.values:
        backend.print(f"loss {losses.values[0]:.3f} after 10 updates, {losses.values[-1]:.3f} after {state.step}")
    return state, losses.values


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    main(steps=parser.parse_args().steps)
