"""Scenarios of tests/distributed/test_meta_models.py, run on 2 ranks by the worker pool: models
built on the meta device, materialized shard by shard by ``prepare``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import accelfn as af


class Net(torch.nn.Module):
    """``Linear(4, width)``, ``depth`` blocks of LayerNorm + a 2-layer MLP, ``Linear(width, 1)``."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, 2 * width), torch.nn.Tanh(),
                                torch.nn.Linear(2 * width, width)) for _ in range(depth))
        self.out = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


PLAN = {"blocks.*.1": "colwise", "blocks.*.3": "rowwise"}


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in
            model.state_dict().items()}


def initial(out: str, weights: str) -> dict[str, Any]:
    """Net built on meta after manual_seed(0), prepared under shard_params() and under
    tensor_parallel(PLAN, size=2): the gathered parameters of each, saved to
    ``OUT/meta_rank{r}.safetensors`` (``fsdp.*``, ``tp.*``), then the same after
    ``af.load_model`` of ``weights`` (``fsdp_loaded.*``, ``tp_loaded.*``), and what each rank holds."""
    from safetensors.torch import save_file

    backend = af.backends.auto()
    tensors: dict[str, torch.Tensor] = {}
    result: dict[str, Any] = {}
    for name, transform in (("fsdp", af.shard_params()), ("tp", af.tensor_parallel(PLAN, size=2))):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = Net()
        state = af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        state, _ = backend.prepare(transform(af.train_step(lambda m, b: m(b).square().mean())), state)
        tensors |= {f"{name}.{k}": v for k, v in _full(state.model).items()}
        af.load_model(state, weights)
        tensors |= {f"{name}_loaded.{k}": v for k, v in _full(state.model).items()}
        result[name] = {"local_numel": sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                           for p in state.model.parameters()),
                        "on_meta": any(t.is_meta for t in state.model.parameters())}
    save_file(tensors, Path(out) / f"meta_rank{backend.rank}.safetensors")
    return result


def big(width: int, depth: int) -> dict[str, Any]:
    """A ``depth``-block MLP of ``width``-wide Linear layers built on meta, trained for one AdamW
    update under shard_params(): this process's peak RSS (its high-water mark reset first) and
    the full model's parameter and AdamW-state bytes."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak RSS, to the RSS now
    before = _status_kib("VmRSS") * 1024
    backend = af.backends.auto()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                      for _ in range(depth)])
    numel = sum(p.numel() for p in model.parameters())
    state = af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    step = af.shard_params(units=lambda name, m: isinstance(m, torch.nn.Sequential) and name != "")(
        af.train_step(lambda m, b: m(b).square().mean()))
    state, step_fn = backend.prepare(step, state)
    state, metrics = step_fn(state, torch.randn(2, width))
    return {"numel": numel, "full_bytes": numel * 4 * 3, "rss_at_start": before,
            "peak_rss": _status_kib("VmHWM") * 1024, "step": state.step, "loss": float(metrics["loss"]),
            "local_numel": sum(p.to_local().numel() for p in state.model.parameters())}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(field)


def llama_config() -> Any:
    """A tiny transformers Llama config with tied input/output embeddings (no download)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True, bos_token_id=0,
                       eos_token_id=0, pad_token_id=0)


TOKENS = (4, 16)  # the batch whose logits the tests compare, drawn from a generator seeded 3


def llama(out: str, weights: str) -> dict[str, Any]:
    """A tied transformers Llama built on meta, prepared under shard_params() and under
    tensor_parallel("auto", size=2): its rotary buffers, norm weights and the spread of its
    linear and embedding weights after prepare (its own init), whether the tie holds; then
    ``af.load_model`` of ``weights`` (what save_pretrained wrote) and the logits of ``TOKENS``
    to ``OUT/llama_rank{r}.safetensors`` (``fsdp.logits``, ``tp.logits``)."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    backend = af.backends.auto()
    tokens = torch.randint(0, 64, TOKENS, generator=torch.Generator().manual_seed(3))
    tensors: dict[str, torch.Tensor] = {}
    result: dict[str, Any] = {}
    for name, transform in (("fsdp", af.shard_params()), ("tp", af.tensor_parallel("auto", size=2))):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = LlamaForCausalLM(llama_config())
        state = af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        state, _ = backend.prepare(transform(af.train_step(lambda m, b: m(input_ids=b[0], labels=b[0]).loss)), state)
        full = _full(state.model)
        buffers = dict(state.model.named_buffers())
        linear = torch.cat([v.flatten() for k, v in full.items() if k.endswith("proj.weight")])
        result[name] = {
            "on_meta": any(t.is_meta for t in [*state.model.parameters(), *state.model.buffers()]),
            "inv_freq": buffers["model.rotary_emb.inv_freq"].tolist(),
            "original_inv_freq": buffers["model.rotary_emb.original_inv_freq"].tolist(),
            "norms_are_ones": all(bool((v == 1).all()) for k, v in full.items() if k.endswith("norm.weight")),
            "linear_std": float(linear.std()), "linear_mean": float(linear.mean()),
            "embedding_std": float(full["model.embed_tokens.weight"].std()),
            "tied": state.model.lm_head.weight is state.model.model.embed_tokens.weight,
        }
        af.load_model(state, weights)
        with torch.no_grad():
            tensors[f"{name}.logits"] = state.model(input_ids=tokens).logits.detach().clone()
    save_file(tensors, Path(out) / f"llama_rank{backend.rank}.safetensors")
    return result
