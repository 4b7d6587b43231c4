"""``tensor_parallel("auto")`` on a peft model: the transformers model's plan found under
peft's wrapping, and adapter layers refused by name with what to do instead."""

from __future__ import annotations

import pytest

import accelfn as af
from accelfn.distributed.tensor_parallel import resolve
from tests.helpers import lora


def test_auto_plan_of_a_peft_model_refuses_its_adapter_layers_by_name() -> None:
    """On a PeftModel (LoRA on q_proj, v_proj), "auto" takes the Llama's own plan under
    base_model.model (not a pattern that matches nothing) and refuses the LoRA layers it
    would split, naming them and saying which layers to split instead."""
    with pytest.raises(ValueError, match=r"'base_model\.model\.model\.layers\.\*\.self_attn\.q_proj' is 'colwise' and "
                                         r"matches 'base_model\.model\.model\.layers\.0\.self_attn\.q_proj' \(Linear\)"
                                         r".*peft adapter layers.*mlp\.gate_proj"):
        resolve(af.tensor_parallel("auto", size=2), lora.lora())

