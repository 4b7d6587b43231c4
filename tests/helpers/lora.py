"""A tiny Llama with a peft LoRA adapter, for the LoRA checkpoint and export tests (skipped,
with the reason, where transformers or peft is missing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="LoRA tests need transformers (pip install accelfn[peft])")
peft = pytest.importorskip("peft", reason="LoRA tests need peft (pip install accelfn[peft])")

#: a Llama-style model small enough for 2 CPU cores: 2 blocks of width 32, tied embeddings off
CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
SEED = 1234


def base() -> torch.nn.Module:
    """The base model, the same on every call (seeded)."""
    torch.manual_seed(SEED)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))


def lora(model: torch.nn.Module | None = None) -> Any:
    """``base()`` with a LoRA adapter on the attention's q and v projections (r=4), its B
    matrices seeded non-zero so that the adapter changes the logits from the first step."""
    model = peft.get_peft_model(model if model is not None else base(),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def state(model: torch.nn.Module | None = None) -> Any:
    """A TrainState of ``lora()`` with AdamW over the adapter's parameters."""
    import accelfn as af

    model = model if model is not None else lora()
    return af.TrainState.create(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))


def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The causal language-model loss of token ids ``batch`` (batch, seq)."""
    return model(input_ids=batch, labels=batch).loss


def batches(n: int, batch_size: int = 4, seq: int = 12) -> list[torch.Tensor]:
    """``n`` batches of random token ids (batch_size, seq), the same on every call."""
    g = torch.Generator().manual_seed(SEED + 2)
    return [torch.randint(0, CONFIG["vocab_size"], (batch_size, seq), generator=g) for _ in range(n)]


def probe() -> torch.Tensor:
    """Token ids (2, 10) whose logits the export tests compare."""
    return torch.randint(0, CONFIG["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(SEED + 3))


@torch.no_grad()
def logits(model: torch.nn.Module, ids: torch.Tensor | None = None) -> torch.Tensor:
    """``model``'s fp32 logits of ``probe()`` (or ``ids``) in eval mode."""
    was = model.training
    model.eval()
    try:
        return model(input_ids=probe() if ids is None else ids).logits.float()
    finally:
        model.train(was)


def reloaded(adapter: Path, merged: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of ``probe()`` of the adapter export loaded onto a fresh ``base()`` by
    ``PeftModel.from_pretrained``, and of the merged export loaded by
    ``AutoModelForCausalLM.from_pretrained``."""
    with_adapter = peft.PeftModel.from_pretrained(base(), adapter)
    merged_model = transformers.AutoModelForCausalLM.from_pretrained(merged)
    return logits(with_adapter), logits(merged_model)


def io_written() -> int:
    """The bytes this process has passed to write() and similar calls (``wchar`` of
    /proc/self/io: every thread, whatever the file system caches)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
