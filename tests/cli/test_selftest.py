"""`accelfn test`: every check passes on this machine, and a check broken on purpose fails by name."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.helpers import launch as _launch

pytestmark = pytest.mark.multiprocess

TRAINING = "shard_data + replicate + accumulate(2) + clip(0.1) equals 1 process on the whole batch"
EQUALS = "+ accumulate(2) + clip(0.1) equals 1 process on the whole batch"
DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
CHECKS = [
    f"1 process: {TRAINING}",
    "1 process: checkpoint save/load round trip",
    "1 process: gather of unequal sizes",
    "cpu fp32: training lowers the loss",
    "cpu bf16: training lowers the loss",
    "cpu fp16: training lowers the loss",
    "cpu bf16-true: training lowers the loss",
    "cpu fp8: training lowers the loss",
    f"3 processes (gloo): {TRAINING}",
    "3 processes (gloo): checkpoint save/load round trip",
    "3 processes (gloo): gather of unequal sizes",
    f"3 processes (gloo): shard_data + shard_params {EQUALS}",
    f"3 processes (gloo): tensor_parallel(size=3) {EQUALS}",
    f"3 processes (gloo): pipeline(size=3, schedule='gpipe') {EQUALS}",
    *([f"3 processes (gloo): shard_data + deepspeed(ZeRO-1) {EQUALS}"] if DEEPSPEED else []),
]


def status_of(output: str, name: str) -> list[str]:
    """The statuses printed for the check ``name`` (a line is ``STATUS  NAME: DETAIL``)."""
    return [line.split("  ", 1)[0] for line in output.splitlines() if line.partition("  ")[2].startswith(f"{name}:")]


def test_every_check_passes_on_this_machine_with_the_configs_process_count(tmp_path: Path) -> None:
    """With --config naming 3 processes per node, `accelfn test` runs every check on 1 and on
    3 gloo processes (on 3: shard_params, tensor_parallel, pipeline, and deepspeed where it
    is installed, each against the 1-process reference), prints PASS for each, SKIPs CUDA and
    XLA (and DeepSpeed, saying so, where it is not installed), and exits 0; the precision and
    accumulate defaults of the user's config file stay out of the checks."""
    config = tmp_path / "three.yaml"
    config.write_text("nproc_per_node: 3\nbackend: cpu\n")
    user = tmp_path / "xdg" / "accelfn" / "config.yaml"
    user.parent.mkdir(parents=True)
    user.write_text("precision: fp16\naccumulate: 4\n")
    result = _launch.run("test", "--config", config, cwd=tmp_path, timeout_s=400,
                         env=_launch.environment(XDG_CONFIG_HOME=str(tmp_path / "xdg")))
    assert {name: status_of(result.stdout, name) for name in CHECKS} == {name: ["PASS"] for name in CHECKS}, \
        result.stdout
    assert status_of(result.stdout, "xla") == ["SKIP"]
    assert status_of(result.stdout, "deepspeed") == ([] if DEEPSPEED else ["SKIP"])
    if not torch.cuda.is_available():  # with a GPU, the CUDA checks run too
        assert status_of(result.stdout, "cuda") == ["SKIP"]
        skipped = 2 if DEEPSPEED else 3
        assert result.stdout.splitlines()[-1] == f"accelfn test: {len(CHECKS)} passed, 0 failed, {skipped} skipped"


def test_a_broken_gradient_all_reduce_fails_the_multiprocess_training_check(tmp_path: Path) -> None:
    """--fault no-allreduce trains the 2-process check without replicate(): exactly that check
    FAILs, naming the parameter difference, and the exit status is 1."""
    result = _launch.run("test", "--fault", "no-allreduce", cwd=tmp_path, timeout_s=400, check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert len(failed) == 1, result.stdout
    assert failed[0].startswith(f"FAIL  2 processes (gloo): {TRAINING}: rank 0: max |difference| ")
    assert failed[0].endswith("after 3 updates (tolerance 1e-05)")
    assert ", 1 failed, " in result.stdout.splitlines()[-1]
