"""Adapters (``peft``) in exports: a fine-tuned model's adapters alone, in PEFT's own layout,
or merged into its base model, under the base model's own names.

``peft`` wraps a model (``PeftModel``) and names its tensors after the wrapping
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``): what a
checkpoint holds, but what neither ``PeftModel.from_pretrained`` nor ``from_pretrained`` reads.
Both exports here go through peft's own functions, never through renaming of ours:

* **the adapters** (``"peft"``): ``peft.get_peft_model_state_dict`` picks the adapter's tensors
  and names them as peft saves them; they go to ``adapter_model.safetensors``, and the
  adapter's ``LoraConfig`` (``inference_mode=True``, as ``PeftModel.save_pretrained`` writes it)
  to ``adapter_config.json``, through the config's own ``save_pretrained``.
* **the merged model** (``"merged"``): ``merge_and_unload`` on a CPU copy of the model (the
  state is never touched): the base model with each adapter's update added to its weights,
  under the base model's own ``state_dict`` names, and its ``config.json`` for a
  ``transformers`` model. The copy is ``copy.deepcopy`` of the model with every tensor replaced
  by a CPU copy; a model whose tensors are DTensors (``shard_params``, ``tensor_parallel``),
  which FSDP forbids to copy, is built again from its config on the meta device (a
  ``transformers`` model: its class and ``config``; ``peft.get_peft_model`` with the same
  adapter config) and filled with the full tensors (``load_state_dict(assign=True)``).

References:
    https://huggingface.co/docs/peft (``get_peft_model_state_dict``, ``merge_and_unload``,
    ``PeftModel.save_pretrained``).
"""

from __future__ import annotations

import copy
import importlib
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from accelfn.distributed import is_dtensor
from accelfn.distributed.fsdp import original_class

#: what ``adapters=`` takes: the adapters alone (PEFT's layout), or merged into the base model
KINDS = ("peft", "merged")
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
CONFIG = "config.json"


def _peft() -> ModuleType:
    try:
        return importlib.import_module("peft")
    except ImportError:
        raise ImportError("save_model(adapters=...) exports through peft's own functions: pip install peft "
                          "(or accelfn[peft])") from None


def check(model: Any, adapters: Any) -> str:
    """The name of the adapter of ``model`` (unwrapped: a ``peft.PeftModel``, which peft's
    functions take, typed ``Any`` here as peft is optional) that ``adapters=`` exports.

    Raises:
        ValueError: ``adapters`` is not one of ``KINDS``, or the model has no adapter (it is
            not a ``peft.PeftModel``).
        ImportError: peft is not installed.
    """
    if adapters not in KINDS:
        raise ValueError(f"save_model(adapters={adapters!r}): must be None (the model as it is), 'peft' (the "
                         "adapters alone, in PEFT's layout: adapter_model.safetensors + adapter_config.json) or "
                         "'merged' (the adapters merged into the base model, under its own names)")
    peft = _peft()
    if not isinstance(model, peft.PeftModel):
        raise ValueError(f"save_model(adapters={adapters!r}): the state's model is a {type(model).__name__}, not a "
                         "peft.PeftModel: it has no adapters to export. Export it with adapters=None")
    name = model.active_adapter
    if not isinstance(name, str):
        raise ValueError(f"save_model(adapters={adapters!r}): the model has several active adapters {name}; "
                         "activate one (model.set_adapter(name)) and export each in turn")
    return name


def adapter_tensors(model: Any, name: str) -> list[tuple[str, torch.Tensor]]:
    """The tensors of adapter ``name`` under PEFT's names (``get_peft_model_state_dict``), in
    ``state_dict`` order; DTensors stay DTensors (the caller gathers them)."""
    local = model.state_dict()
    return list(_peft().get_peft_model_state_dict(model, state_dict=local, adapter_name=name).items())


def write_adapter_config(directory: Path, model: Any, name: str, write: Any) -> None:
    """Writes adapter ``name``'s config as ``directory/adapter_config.json`` as
    ``PeftModel.save_pretrained`` does (``inference_mode=True``; the config's own
    ``save_pretrained``), through ``write(path, data)`` (atomic)."""
    config = copy.deepcopy(model.peft_config[name])
    config.inference_mode = True
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        config.save_pretrained(scratch)
        write(directory / ADAPTER_CONFIG, (Path(scratch) / ADAPTER_CONFIG).read_bytes())


def _cpu_copy(model: Any, full: Mapping[str, torch.Tensor], name: str) -> Any:
    """A CPU copy of the PeftModel ``model`` holding the tensors ``full`` (its whole
    ``state_dict``, CPU tensors)."""
    if not any(is_dtensor(t) for t in [*model.parameters(), *model.buffers()]):
        memo: dict[int, Any] = {}
        for t in [*model.parameters(), *model.buffers()]:  # no device copy of the model, ever
            clone = t.detach().to("cpu", copy=True)
            memo[id(t)] = torch.nn.Parameter(clone, requires_grad=t.requires_grad) if isinstance(
                t, torch.nn.Parameter) else clone
        return copy.deepcopy(model, memo)
    base = model.get_base_model()
    config = getattr(base, "config", None)
    if config is None:
        raise ValueError(f"save_model(adapters='merged'): the model's parameters are sharded (DTensors) and its "
                         f"base model, a {type(base).__name__}, has no config (it is not a transformers model) to "
                         "build a copy from; export adapters='peft' and merge after loading it")
    with torch.device("meta"):
        fresh = original_class(base)(copy.deepcopy(config))
    clone = _peft().get_peft_model(fresh, copy.deepcopy(model.peft_config[name]), adapter_name=name)
    clone.load_state_dict(dict(full), strict=True, assign=True)
    return clone


def merged(model: Any, full: Mapping[str, torch.Tensor], name: str) -> tuple[
        list[tuple[str, torch.Tensor]], Any]:
    """The base model with adapter ``name`` merged (``merge_and_unload`` on a CPU copy holding
    ``full``): its ``state_dict`` under the base model's names, and its ``transformers`` config
    (or None)."""
    base = _cpu_copy(model, full, name).merge_and_unload()
    return [(k, t) for k, t in base.state_dict().items() if not t.is_meta], getattr(base, "config", None)
