"""Worker for tests/checkpoint/test_lora.py: a LoRA Llama (``tests.helpers.lora``) under
``shard_params()`` on 2 ranks, checkpointed after each of its first 3 updates, then resumed
from the second checkpoint.

Usage: accelfn launch --nproc-per-node 2 lora_sharded.py OUT

The base is ``lora.CONFIG`` widened to 128 (1.2 MB of frozen fp32 tensors, 0.6 MB a rank),
so that it dwarfs the few KB of gloo messages a save exchanges (they count as written too).
``OUT/ckpt`` is the ``Checkpoints`` directory (steps 1, 2, 3). Each rank writes
``OUT/written-<rank>.json``: the bytes it passed to write() during each save (``wchar`` of
/proc/self/io: its files and its gloo messages), by step. Rank 0 writes the full model and optimizer state after 5 uninterrupted updates to
``OUT/uninterrupted.safetensors``, and after the resume from step 2 (a freshly built state,
3 more updates) to ``OUT/resumed.safetensors``. Then the uninterrupted run's base is edited
by hand (1 added to layer 0's ``up_proj`` weight) and saved as step 5; rank 0 writes that
state to ``OUT/edited.safetensors``.

Last, under ``tensor_parallel`` (``lora_exports.TP_PLAN``: the MLP split, the rest whole), the
small LoRA model is checkpointed after each of 2 updates into ``OUT/tp`` and step 1 is loaded
into a freshly built state; rank 0 writes the state after update 1 and the loaded one to
``OUT/tp-saved.safetensors`` and ``OUT/tp-loaded.safetensors``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

import accelfn as af
from tests.helpers import lora
from tests.workers.lora_exports import TP_PLAN

WIDE = dict(hidden_size=128, intermediate_size=256)


def _prepared(backend: Any) -> tuple[af.TrainState, Any]:
    torch.manual_seed(lora.SEED)
    base = lora.transformers.LlamaForCausalLM(lora.transformers.LlamaConfig(**{**lora.CONFIG, **WIDE}))
    return backend.prepare(af.compose(af.shard_params())(af.train_step(lora.loss_fn)), lora.state(lora.lora(base)))


def _full(state: af.TrainState) -> dict[str, torch.Tensor]:
    """The model's and optimizer's tensors, full (a collective), by ``model/<name>`` and ``optimizer/<i>/<key>``."""
    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone().contiguous()

    tensors = {f"model/{k}": full(v) for k, v in state.model.state_dict().items()}
    for i, entry in state.optimizer.state_dict()["state"].items():
        tensors |= {f"optimizer/{i}/{k}": full(v) for k, v in entry.items() if isinstance(v, torch.Tensor)}
    return tensors


def main(out: Path) -> None:
    backend = af.backends.auto()
    data = lora.batches(5)
    checkpoints = af.Checkpoints(out / "ckpt")
    state, step_fn = _prepared(backend)
    written = {}
    for i, batch in enumerate(data):
        state, _ = step_fn(state, batch)
        if i < 3:
            before = lora.io_written()
            checkpoints.save(state, backend)
            written[i + 1] = lora.io_written() - before
    uninterrupted = _full(state)
    edited = next(p for name, p in state.model.named_parameters() if "layers.0.mlp.up_proj.weight" in name)
    with torch.no_grad():
        edited.add_(1.0)
    checkpoints.save(state, backend)
    edited_state = _full(state)
    resumed, resumed_fn = _prepared(backend)
    resumed = af.load(checkpoints.path_for(2), into=resumed, backend=backend)
    assert resumed.step == 2
    for batch in data[2:]:
        resumed, _ = resumed_fn(resumed, batch)
    again = _full(resumed)
    (out / f"written-{backend.rank}.json").write_text(json.dumps(written))
    if backend.is_main_process:
        safetensors.torch.save_file(uninterrupted, out / "uninterrupted.safetensors")
        safetensors.torch.save_file(again, out / "resumed.safetensors")
        safetensors.torch.save_file(edited_state, out / "edited.safetensors")
    _tensor_parallel(backend, out)
    backend.barrier()


def _tensor_parallel(backend: Any, out: Path) -> None:
    def prepared() -> tuple[af.TrainState, Any]:
        return backend.prepare(af.compose(af.tensor_parallel(TP_PLAN, size=2))(af.train_step(lora.loss_fn)),
                               lora.state())

    checkpoints = af.Checkpoints(out / "tp")
    state, step_fn = prepared()
    for i, batch in enumerate(lora.batches(2)):
        state, _ = step_fn(state, batch)
        checkpoints.save(state, backend)
        if i == 0:
            saved = _full(state)
    loaded = _full(af.load(checkpoints.path_for(1), into=prepared()[0], backend=backend))
    if backend.is_main_process:
        safetensors.torch.save_file(saved, out / "tp-saved.safetensors")
        safetensors.torch.save_file(loaded, out / "tp-loaded.safetensors")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
