"""``af.deepspeed(config)``: a config section that would act behind the program's back is
refused when the transform is built or composed, naming the section and the fix.

DeepSpeed itself is not needed for these (the transform never imports it); the engine's
behaviour with the schedule and optimizers the messages point to is tested in
``tests/backends/test_deepspeed.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import accelfn as af
from accelfn.transforms.deepspeed import engine_config, launch_config
from tests.helpers.programs import mse

#: the shape of the ZeRO-2 template in transformers' docs
HF_TEMPLATE: dict[str, Any] = {
    "fp16": {"enabled": "auto", "loss_scale": 0}, "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": "auto"},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto"}
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.1, "warmup_num_steps": 6}}
ADAMW = {"type": "AdamW", "params": {"lr": 3e-4}}


@pytest.mark.parametrize(("section", "value", "words"), [
    ("scheduler", WARMUP, r'"scheduler" section \(WarmupLR\(warmup_min_lr=0, warmup_max_lr=0.1, '
                          r"warmup_num_steps=6\)\).*no checkpoint holds it.*a resumed run would start it again.*"
                          r"scheduler=deepspeed.runtime.lr_schedules.WarmupLR\(optimizer"),
    ("optimizer", ADAMW, r'"optimizer" section \(AdamW\(lr=0.0003\)\) would not be used.*TrainState\'s optimizer'),
])
def test_optimizer_and_scheduler_sections_are_refused_naming_the_fix(tmp_path: Path, section: str, value: Any,
                                                                      words: str) -> None:
    """A config with an "optimizer" or "scheduler" section (which DeepSpeed would ignore, or
    build outside the TrainState and restart on resume) is refused when deepspeed() reads it,
    from a dict, a file and a launch's --deepspeed file alike."""
    config = {"zero_optimization": {"stage": 2}, section: value}
    with pytest.raises(ValueError, match=words):
        af.deepspeed(config)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=words):
        af.deepspeed(path)
    with pytest.raises(ValueError, match=words):
        launch_config(path, zero_stage=1)


def test_auto_values_are_refused_naming_each() -> None:
    """The Hugging Face Trainer's "auto" values are refused, each named: those accelfn fills
    from the program are to be removed, the others given numbers."""
    with pytest.raises(ValueError) as caught:
        af.deepspeed(HF_TEMPLATE)
    message = str(caught.value)
    assert ("found at fp16.enabled, bf16.enabled, zero_optimization.reduce_bucket_size, gradient_accumulation_steps, "
            "gradient_clipping, train_batch_size, train_micro_batch_size_per_gpu") in message
    assert ("remove fp16.enabled, bf16.enabled, gradient_accumulation_steps, gradient_clipping, train_batch_size, "
            "train_micro_batch_size_per_gpu: accelfn fills them") in message
    assert "give zero_optimization.reduce_bucket_size numbers" in message
    with pytest.raises(ValueError, match=r"found at zero_optimization.offload_optimizer.buffer_count\b"):
        af.deepspeed({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu",
                                                                              "buffer_count": "auto"}}})


@pytest.mark.parametrize(("config", "precision", "words"), [
    ({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, af.with_precision("bf16"),
     r"torch_autocast section \(enabled: true\).*with_precision\('bf16'\); keep one"),
    ({"fp16": {"enabled": True, "loss_scale": 128}}, af.with_precision("fp16"),
     r"fp16.loss_scale=128 is a static loss scale.*with_precision\('fp16'\) \(a dynamic one\)"),
    ({"fp16": {"initial_scale_power": 8}}, af.with_precision("fp16", init_scale=2.0**10),
     r"fp16.initial_scale_power=8 contradicts with_precision\('fp16', ...\)'s 10"),
    ({"fp16": {"loss_scale_window": 100}}, af.with_precision("fp16", growth_interval=50),
     r"fp16.loss_scale_window=100 contradicts .* 50"),
    ({}, af.with_precision("fp16", init_scale=1000.0), r"power of two.*init_scale=1000.0\) is none"),
    ({}, af.with_precision("fp16", growth_factor=4.0), r"grows and backs off by a factor of 2.*growth_factor=4.0"),
    ({}, af.with_precision("fp16", max_consecutive_skips=3), r"max_consecutive_skips=3\) cannot be given"),
])
def test_precision_options_the_config_contradicts_are_refused(config: dict[str, Any], precision: Any,
                                                              words: str) -> None:
    """with_precision composed with a config whose autocast or fp16 loss scale says otherwise,
    or with loss-scale options DeepSpeed's scaler has no counterpart for, is refused."""
    with pytest.raises(af.TransformError, match=words):
        af.compose(af.deepspeed(config), precision)(af.train_step(mse))


def test_fp16_loss_scale_options_reach_the_engine_config() -> None:
    """with_precision("fp16", init_scale=2**10, growth_interval=50) is DeepSpeed's
    initial_scale_power 10 and loss_scale_window 50; without options DeepSpeed's defaults
    are left alone, and a config that says the same composes."""
    step = af.compose(af.deepspeed({"fp16": {"loss_scale_window": 50}}),
                      af.with_precision("fp16", init_scale=2.0**10, growth_interval=50))(af.train_step(mse))
    ds = step.find(type(af.deepspeed({})))
    policy = step.find(type(af.with_precision("fp16"))).policy
    config = engine_config(ds, num_micro_batches=1, clip=None, precision="fp16", micro_batch_size=2, world_size=1,
                           scaling=policy.scaling)
    assert config["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 10, "loss_scale_window": 50}
    plain = engine_config(ds, num_micro_batches=1, clip=None, precision="fp16", micro_batch_size=2, world_size=1,
                          scaling=af.with_precision("fp16").policy.scaling)
    assert plain["fp16"] == {"enabled": True, "loss_scale": 0, "loss_scale_window": 50}
