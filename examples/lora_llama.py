"""LoRA fine-tuning of a small Llama on a streamed dataset, resumed mid-epoch, then exported
as PEFT's adapter and as the merged model, each reloaded with peft and transformers.

    pip install 'accelfn[peft,streaming]'
    accelfn launch --nproc-per-node 2 examples/lora_llama.py --run-dir runs/lora

Everything comes from this machine: the model is built from a ``LlamaConfig`` (no download),
the data are JSON-lines files of bytes of the Python standard library's sources, read by
Hugging Face ``datasets`` in streaming mode (one shard per file; ``shard_data()`` gives each
process its files, and a resumed epoch continues each stream from its saved state instead of
re-reading it). The program:

1. trains the adapter (peft ``LoraConfig`` on the attention's q and v projections) with
   ``shard_params()`` (FSDP2), bf16 and activation checkpointing of the decoder layers
   (``checkpoint_activations()``) for ``--steps`` updates, uninterrupted, in ``A/``;
2. trains it again in ``B/``, stopped after ``--stop`` updates (mid-epoch; a checkpoint every
   ``--every-steps``), then resumed from the latest checkpoint in a freshly built state to the
   same total (``run(max_steps=...)`` takes totals), and checks that it ends bitwise equal to
   ``A``. These checkpoints are sharded, written by every rank through DCP; the frozen base
   is written once: a later checkpoint's ``dcp-frozen/`` files are hard links to the earlier
   one's, and it writes only the adapter, the optimizer state and the manifest (docs/06, "LoRA").
3. exports ``B``'s adapter (``af.save_model(..., adapters="peft")``) and merged model
   (``adapters="merged"``), and reloads them on rank 0 with ``PeftModel.from_pretrained`` and
   ``AutoModelForCausalLM.from_pretrained``: both give the same logits, and the adapter
   export holds exactly the trained adapter's tensors.

It prints one line per check, and ``OK`` at the end; ``main`` returns the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from datasets import load_dataset
from peft import LoraConfig, PeftModel, get_peft_model
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import accelfn as af

CONTEXT = 32  # bytes per training sequence
NUM_FILES = 4  # the stream's shards
SEED = 0


def write_corpus(directory: Path, *, sequences: int) -> list[str]:
    """``NUM_FILES`` JSON-lines files of ``sequences`` windows of ``CONTEXT`` bytes in all
    (``{"ids": [...]}`` per line), from the standard library's ``os.py``; written once."""
    directory.mkdir(parents=True, exist_ok=True)
    data = (Path(os.__file__)).read_bytes()
    files = [directory / f"part-{i}.jsonl" for i in range(NUM_FILES)]
    per_file = sequences // NUM_FILES
    for i, path in enumerate(files):
        if not path.exists():
            lines = [json.dumps({"ids": list(data[(i * per_file + j) * CONTEXT:(i * per_file + j + 1) * CONTEXT])})
                     for j in range(per_file)]
            part = path.with_suffix(".part")
            part.write_text("\n".join(lines) + "\n")
            part.rename(path)
    return [str(path) for path in files]


def stream(files: list[str]) -> Any:
    """The files as a Hugging Face streaming dataset of ``{"input_ids": (CONTEXT,) int64}``."""
    dataset = load_dataset("json", data_files=files, split="train", streaming=True)
    return dataset.map(lambda row: {"input_ids": row["ids"]}, remove_columns=["ids"]).with_format("torch")


def base_model() -> LlamaForCausalLM:
    """A 2-block Llama over bytes (vocabulary 256), the same on every call (seeded)."""
    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def lora_model() -> Any:
    """``base_model()`` with a LoRA adapter (r=8) on the attention's q and v projections."""
    return get_peft_model(base_model(), LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                   target_modules=["q_proj", "v_proj"]))


def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss


def train(files: list[str], run_dir: Path, *, max_steps: int, every_steps: int, batch_size: int) -> af.TrainState:
    """Builds a fresh state and runs (or resumes, from ``run_dir/ckpt``) to ``max_steps`` updates."""
    backend = af.backends.auto()
    model = lora_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    state = af.TrainState.create(model, optimizer)
    step = af.compose(
        af.shard_data(seed=SEED),
        af.shard_params(),
        af.with_precision("bf16"),
        af.checkpoint_activations(),  # the decoder layers recompute their activations in the backward
    )(af.train_step(loss_fn))
    loader = DataLoader(stream(files), batch_size=batch_size)
    checkpoints = af.Checkpoints(run_dir / "ckpt", every_steps=every_steps)
    return af.run(step, state, loader, backend=backend, epochs=10, max_steps=max_steps, checkpoints=checkpoints,
                  resume="auto", progress=False)


def full_tensors(state: af.TrainState, *, trainable: bool) -> dict[str, torch.Tensor]:
    """The model's (trainable, or all) parameters as full CPU tensors (a collective under shard_params)."""
    found = {}
    for name, p in state.model.named_parameters():
        if p.requires_grad or not trainable:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            found[name] = full.detach().cpu().clone()
    return found


def main(run_dir: str, *, steps: int = 4, stop: int = 2, every_steps: int = 2, batch_size: int = 4,
         sequences: int = 64) -> dict[str, Any]:
    """Runs the three parts; returns what they found (see the module's docstring)."""
    root = Path(run_dir)
    backend = af.backends.auto()
    with backend.main_process_first():  # rank 0 writes the files; the others find them there
        files = write_corpus(root / "data", sequences=sequences)
    steps_per_epoch = sequences // (batch_size * backend.world_size)
    assert stop < steps <= steps_per_epoch, "the resume must fall mid-epoch"

    uninterrupted = train(files, root / "A", max_steps=steps, every_steps=steps, batch_size=batch_size)
    expected = full_tensors(uninterrupted, trainable=False)
    train(files, root / "B", max_steps=stop, every_steps=every_steps, batch_size=batch_size)  # "interrupted"
    resumed = train(files, root / "B", max_steps=steps, every_steps=every_steps, batch_size=batch_size)
    got = full_tensors(resumed, trainable=False)
    bitwise = all(torch.equal(got[k], v) for k, v in expected.items())
    backend.print(f"resumed at step {stop} of {steps} (mid-epoch of {steps_per_epoch}): bitwise equal to the "
                  f"uninterrupted run: {bitwise}")

    seen: set[int] = set()
    new_bytes, frozen = {}, {}
    for path in sorted((root / "B" / "ckpt").glob("step_*")):  # each file counted where it first appears
        stats = [f.stat() for f in path.rglob("*") if f.is_file()]
        new_bytes[path.name] = sum(st.st_size for st in stats if st.st_ino not in seen)
        seen |= {st.st_ino for st in stats}
        frozen[path.name] = {f.stat().st_ino for f in (path / "dcp-frozen").iterdir()}
    first, *later = frozen.values()
    backend.print(f"checkpoints, bytes of new files: {new_bytes}; the base written once (later dcp-frozen/ files "
                  f"are hard links to the first's): {bool(later) and all(inodes == first for inodes in later)}")
    adapter = af.save_model(resumed, root / "export" / "adapter", adapters="peft", backend=backend)
    merged = af.save_model(resumed, root / "export" / "merged", adapters="merged", backend=backend)
    trained = full_tensors(resumed, trainable=True)
    found: dict[str, Any] = {"bitwise": bitwise}
    if backend.is_main_process:
        probe = torch.randint(0, 256, (2, CONTEXT), generator=torch.Generator().manual_seed(1))
        with_adapter = PeftModel.from_pretrained(base_model(), adapter).eval()
        whole = AutoModelForCausalLM.from_pretrained(merged).eval()
        same_adapter = all(torch.equal(p, trained[n]) for n, p in with_adapter.named_parameters() if "lora_" in n)
        with torch.no_grad():
            gap = (with_adapter(input_ids=probe).logits - whole(input_ids=probe).logits).abs().max().item()
        print(f"adapter export holds the trained adapter: {same_adapter}; PeftModel.from_pretrained and "
              f"AutoModelForCausalLM.from_pretrained (merged) logits differ by {gap:.2e}", flush=True)
        found |= {"same_adapter": same_adapter, "logits_gap": gap}
        if bitwise and same_adapter and gap <= 1e-5:
            print("OK", flush=True)
    return found


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/lora")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--stop", type=int, default=2)
    parser.add_argument("--every-steps", type=int, default=2)
    args = parser.parse_args()
    main(args.run_dir, steps=args.steps, stop=args.stop, every_steps=args.every_steps)
