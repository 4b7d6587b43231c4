"""Worker for tests/checkpoint/test_lora.py: a LoRA Llama (``tests.helpers.lora``) trained 2
updates on 2 ranks under ``shard_params()`` and under ``tensor_parallel`` (the MLP split,
the adapters on the attention whole), then exported by ``af.save_model(adapters="peft")`` and
``adapters="merged"``.

Usage: accelfn launch --nproc-per-node 2 lora_exports.py OUT

For each of ``fsdp`` and ``tp``, ``OUT/<mode>/adapter`` and ``OUT/<mode>/merged`` are the
exports, and rank 0 writes the trained model's logits of ``lora.probe()`` (a forward of every
rank) to ``OUT/<mode>/logits.safetensors``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from safetensors.torch import save_file

import accelfn as af
from tests.helpers import lora

#: Megatron's MLP split (gate and up by output features, down by input features); the LoRA
#: layers (q_proj, v_proj) stay whole
TP_PLAN = {f"base_model.model.model.layers.*.mlp.{name}": style
           for name, style in (("gate_proj", "colwise"), ("up_proj", "colwise"), ("down_proj", "rowwise"))}


def main(out: Path) -> None:
    backend = af.backends.auto()
    for mode, parallel in (("fsdp", af.shard_params()), ("tp", af.tensor_parallel(TP_PLAN, size=2))):
        state, step_fn = backend.prepare(af.compose(parallel)(af.train_step(lora.loss_fn)), lora.state())
        for batch in lora.batches(2):
            state, _ = step_fn(state, batch)
        logits = lora.logits(state.model)
        af.save_model(state, out / mode / "adapter", adapters="peft", backend=backend)
        af.save_model(state, out / mode / "merged", adapters="merged", backend=backend)
        if backend.is_main_process:
            save_file({"logits": logits.contiguous()}, out / mode / "logits.safetensors")
        backend.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
