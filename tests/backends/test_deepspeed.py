"""``af.deepspeed(config)``: a real DeepSpeed engine behind the same Step (docs/DeepSpeed).

The multi-process claims share one 2-process scenario (``tests/workers/deepspeed_checks.py``);
the config checks run in this process. DeepSpeed JIT-builds a C++ op the first time a CPU
process group initializes it (``deepspeed_shm_comm``); TORCH_EXTENSIONS_DIR keeps it out of
the repository, built once per machine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import accelfn as af
from tests.helpers import deepspeed_programs as D
from tests.helpers import programs as P
from tests.helpers.pool import Pools

deepspeed = pytest.importorskip(
    "deepspeed", reason="DeepSpeed is not installed (after torch: pip install --no-build-isolation deepspeed)")

#: the first run on a machine JIT-builds DeepSpeed's shm_comm and cpu_adam ops (4 and 10 minutes
#: on the loaded 2-core CI machine; then cached in EXTENSIONS): past pytest's 300 s per test
pytestmark = pytest.mark.timeout(1800)
LAUNCH = ("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "300")
EXTENSIONS = D.EXTENSIONS


@pytest.fixture(scope="module")
def checks(pool: Pools, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The worker's training cases and checkpoint round trips, on 2 processes, in one scenario
    (DeepSpeed keeps its process groups for the life of a process)."""
    from tests.helpers import launch as L

    env = L.environment(TORCH_EXTENSIONS_DIR=EXTENSIONS)
    [rank0, rank1] = pool.call(*LAUNCH, function="deepspeed_checks:all_checks", env=env, timeout_s=1700,
                               cwd=tmp_path_factory.mktemp("deepspeed"))
    for name in rank0["train"]:
        assert rank0["train"][name]["params"] == rank1["train"][name]["params"], f"{name}: the ranks' models differ"
    return rank0


@pytest.fixture(scope="module")
def trained(checks: dict[str, Any]) -> dict[str, Any]:
    """Every training case of the worker: parameters, logged points, counters."""
    return checks["train"]


@pytest.mark.parametrize("case", sorted(D.CASES))
def test_zero_stage_equals_hand_written_loop(trained: dict[str, Any], case: str) -> None:
    """Each ZeRO stage (and stage 3 with CPU offload) on 2 processes, with and without
    accumulate(2) + clip(1.0), equals a 1-process hand-written AdamW loop to 1e-5 over 10
    updates, and reports the norms before clipping as grad_norm."""
    _, n, clip = D.CASES[case]
    expected, norms = D.hand_written(n, clip)
    got = trained[case]
    assert got["step"] == D.UPDATES
    assert got["micro_step"] == D.UPDATES * n
    for name, value in expected.items():
        torch.testing.assert_close(torch.tensor(got["params"][name], dtype=torch.float64), value.double().flatten(),
                                   rtol=0, atol=1e-5)
    if clip is not None:
        assert [p["grad_norm"] for p in got["points"]] == pytest.approx(norms, rel=1e-4)
    else:  # norms above 1: DeepSpeed's default gradient_clipping of 1.0 would have changed these
        assert min(D.hand_written(n, math.inf)[1]) > 1.0
        assert all("grad_norm" not in p for p in got["points"])


def test_stage3_offload_with_deepspeed_cpu_adam_equals_hand_written_loop(trained: dict[str, Any]) -> None:
    """ZeRO-3 with CPU offload and DeepSpeed's own fused CPU AdamW (weight decay as torch's
    AdamW) under accumulate(2) + clip(1.0) on 2 processes equals the 1-process torch AdamW
    loop to 1e-5 over 10 updates."""
    expected, norms = D.hand_written(2, D.CLIP)
    got = trained["s3_offload_cpu_adam_acc2_clip"]
    assert got["step"] == D.UPDATES
    for name, value in expected.items():
        torch.testing.assert_close(torch.tensor(got["params"][name], dtype=torch.float64), value.double().flatten(),
                                   rtol=0, atol=1e-5)
    assert [p["grad_norm"] for p in got["points"]] == pytest.approx(norms, rel=1e-4)


def test_bf16_trains_as_deepspeed_by_hand(trained: dict[str, Any]) -> None:
    """Under with_precision("bf16") DeepSpeed's bf16 engine trains (the loss of the last updates
    is below that of the first ones) and ends exactly where DeepSpeed driven by hand with the
    same config ends."""
    assert trained["s2_bf16"]["params"] == trained["s2_bf16"]["by_hand"]
    losses = [p["loss"] for p in trained["s2_bf16"]["points"]]
    assert len(losses) == D.UPDATES
    assert sum(losses[-3:]) < 0.7 * sum(losses[:3])


def test_sgd_under_zero_trains_as_hand_written_loop(checks: dict[str, Any]) -> None:
    """SGD (momentum, weight decay), which DeepSpeed's ZeRO has not tested and asserts on,
    trains at ZeRO-2 on 2 processes (accelfn allows it: its update is elementwise) to the
    1-process torch SGD loop within 1e-5 over 10 updates, its learning rate driven by
    DeepSpeed's WarmupLR as the TrainState's scheduler: the lr logged per update is the one
    the hand-written loop's update used."""
    expected_lrs: list[float] = []
    expected, _ = D.hand_written(1, None, sgd_warmup=True, lrs=expected_lrs)
    got = checks["sgd_warmup"]
    for name, value in expected.items():
        torch.testing.assert_close(torch.tensor(got["params"][name], dtype=torch.float64), value.double().flatten(),
                                   rtol=0, atol=1e-5)
    assert got["lrs"] == pytest.approx(expected_lrs, rel=1e-12)
    assert len(set(got["lrs"])) == 7  # the warm-up's six rates, then its plateau


def test_deepspeed_scheduler_in_the_train_state_resumes_bitwise(checks: dict[str, Any]) -> None:
    """DeepSpeed's WarmupLR given as the TrainState's scheduler (what the refusal of a config
    "scheduler" section asks for) is checkpointed: 3 updates, af.save and a resume end
    bitwise where the whole run ends, the resumed updates at the whole run's rates (the
    warm-up is not restarted)."""
    got = checks["sgd_warmup"]
    assert got["steps"] == [3, D.UPDATES]
    assert got["resumed"] == got["params"]
    assert got["resumed_lrs"] == got["lrs"][3:]


def test_untested_optimizer_is_allowed_only_when_elementwise() -> None:
    """At ZeRO stages 1-3, torch's elementwise optimizers (SGD, RMSprop, ...) get
    zero_allow_untested_optimizer; DeepSpeed's tested ones, stage 0 and a config that sets the
    key are left alone; any other optimizer is refused by prepare, before an engine or a
    process group is made, naming it and the option."""
    from accelfn.distributed.deepspeed import ENGINE_ATTRIBUTE, optimizer_options

    model = D.make_model()
    zero2 = {"zero_optimization": {"stage": 2}}
    assert optimizer_options(D.make_sgd(model), zero2) == {"zero_allow_untested_optimizer": True}
    assert optimizer_options(torch.optim.RMSprop(model.parameters()), zero2) == {
        "zero_allow_untested_optimizer": True}
    assert optimizer_options(D.make_optimizer(model), zero2) == {}
    assert optimizer_options(D.make_sgd(model), {"zero_optimization": {"stage": 0}}) == {}
    assert optimizer_options(D.make_sgd(model), {**zero2, "zero_allow_untested_optimizer": False}) == {}

    class Shaped(torch.optim.SGD):  # a subclass may read the parameters' shapes in its step
        pass

    state = af.TrainState.create(model, Shaped(model.parameters(), lr=0.1))
    step = af.deepspeed(zero2)(af.train_step(P.mse))
    with pytest.raises(TypeError, match=r"ZeRO stage 2: DeepSpeed has not tested Shaped with ZeRO.*"
                                        r'"zero_allow_untested_optimizer": true'):
        af.backends.CPU().prepare(step, state)
    assert not hasattr(model, ENGINE_ATTRIBUTE)


# -- the config and its composition (one process, no engine) --------------------------------


def test_contradicting_accumulation_is_refused_naming_both() -> None:
    """A config whose gradient_accumulation_steps contradicts accumulate(n) is refused, naming both."""
    ds = af.deepspeed({"gradient_accumulation_steps": 4})
    with pytest.raises(af.TransformError, match=r"gradient_accumulation_steps=4.*accumulate\(2\)"):
        af.compose(ds, af.accumulate(2))(af.train_step(P.mse))
    af.compose(ds, af.accumulate(4))(af.train_step(P.mse))  # agreeing is fine


@pytest.mark.parametrize(("other", "words"), [
    (af.clip(0.5), r"gradient_clipping=1.0 contradicts clip\(0.5\)"),
    (af.with_precision("fp16"), r"enables bf16.*with_precision\('fp16'\)"),
    (af.replicate(), r"own data-parallel engine.*Remove replicate\(\)"),
    (af.shard_params(), r"Remove shard_params\(\)"),
    (af.clip_value(0.1), r"no value clipping"),
])
def test_contradicting_transforms_are_refused(other: Any, words: str) -> None:
    """Transforms that contradict the config, or that DeepSpeed's engine replaces, are refused."""
    ds = af.deepspeed({"gradient_clipping": 1.0, "bf16": {"enabled": True}})
    with pytest.raises(af.TransformError, match=words):
        af.compose(ds, other)(af.train_step(P.mse))


def test_config_is_validated_at_construction(tmp_path: Path) -> None:
    """deepspeed() reads JSON and HJSON files and rejects bad stages, files and types at once."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    assert af.deepspeed(path).stage == 3
    hjson_path = tmp_path / "ds.hjson"
    hjson_path.write_text("{\n  # comment\n  zero_optimization: {stage: 2}\n}\n")
    assert af.deepspeed(str(hjson_path)).stage == 2
    with pytest.raises(ValueError, match="stage must be one of"):
        af.deepspeed({"zero_optimization": {"stage": 4}})
    with pytest.raises(ValueError, match="no such file"):
        af.deepspeed(tmp_path / "missing.json")
    with pytest.raises(TypeError, match="takes a dict or the path"):
        af.deepspeed(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gradient_clipping must be"):
        af.deepspeed({"gradient_clipping": -1})


def test_engine_config_fills_in_transforms_and_never_clips_unasked() -> None:
    """Without clip and without gradient_clipping the engine's config clips nothing (0.0, not
    DeepSpeed's 1.0); clip, accumulate, precision and the batch size fill the config in."""
    from accelfn.transforms.deepspeed import engine_config

    ds = af.deepspeed({"zero_optimization": {"stage": 2}})
    plain = engine_config(ds, num_micro_batches=1, clip=None, precision="fp32", micro_batch_size=3, world_size=2)
    assert plain["gradient_clipping"] == 0.0
    assert plain["train_batch_size"] == 6
    filled = engine_config(ds, num_micro_batches=2, clip=af.clip(0.5), precision="bf16", micro_batch_size=3,
                           world_size=2)
    assert (filled["gradient_clipping"], filled["gradient_accumulation_steps"], filled["bf16"]) == (
        0.5, 2, {"enabled": True})
    assert filled["train_batch_size"] == 12


# -- checkpoints (one 2-process scenario) --------------------------------------------------


@pytest.fixture(scope="module")
def saved(checks: dict[str, Any]) -> dict[str, Any]:
    """Each stage's save / resume results of the worker."""
    return checks["checkpoints"]


@pytest.mark.parametrize("stage", ["s1", "s2", "s3", "s3_bf16"])
def test_mid_epoch_resume_is_bitwise_and_pickle_free(saved: dict[str, Any], stage: str) -> None:
    """At each ZeRO stage (and stage 3 in bf16), 3 updates + af.save + a resume (with pickle.load and torch.load made
    to raise) in fresh processes end bitwise where the uninterrupted 10 updates end, and
    every file of the checkpoint is JSON, a checksum or safetensors (no pickle, no zip)."""
    got = saved[stage]
    assert got["steps"] == [3, D.UPDATES]
    assert got["resumed"] == got["whole"]
    assert sorted(got["files"]) == ["manifest.json", "manifest.sha256", "model.safetensors", "state.safetensors"]
    assert not [name for name, magic in got["files"].items() if magic.startswith("80") or magic == "504b"]


def test_stage3_checkpoint_loads_into_one_unsharded_process(saved: dict[str, Any]) -> None:
    """A ZeRO-3 checkpoint of 2 processes loads into a plain 1-process state with its whole
    parameters and AdamW state; af.save_model of the ZeRO-3 state exports the same weights."""
    from safetensors.torch import load_file

    got = saved["s3"]
    model = D.make_model(seed=1)
    state = af.load(got["path"], into=af.TrainState.create(model, D.make_optimizer(model)))
    assert state.step == 3
    for name, value in model.state_dict().items():
        assert value.double().flatten().tolist() == got["saved"][name]
    assert {tuple(s) for s in (sorted(v) for v in state.optimizer.state_dict()["state"].values())} == {
        ("exp_avg", "exp_avg_sq", "step")}
    exported = load_file(str(Path(got["path"]).parent / "export_s3" / "model.safetensors"))
    assert {k: v.double().flatten().tolist() for k, v in exported.items()} == got["saved"]
