"""replicate(comm_hook=...): torch's DDP communication hooks on 2 real processes, each equal
to a hand-written DDP loop with the same hook; the 16-bit compression hooks within their
documented bound of the uncompressed gradient; PowerSGD's state in the TrainState, resumed
bitwise from a checkpoint; the hook checked when replicate is built."""

from __future__ import annotations

from typing import Any

import pytest
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

import accelfn as af
from tests.helpers.pool import Pools

OWN = ("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60")


@pytest.fixture(scope="module")
def ranks(pool: Pools, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's results of tests/workers/comm_hooks.py:check."""
    out = tmp_path_factory.mktemp("comm_hooks")
    return pool.call(*OWN, function="comm_hooks:check", out=str(out), cwd=out, timeout_s=300)


@pytest.mark.multiprocess
def test_every_hook_trains_as_the_hand_written_ddp_loop_with_that_hook(ranks):
    """Without a hook, and with fp16, bf16 and PowerSGD compression, 8 updates on 2 processes
    give bitwise the parameters of a hand-written DDP loop registering the same hook; each
    compressing hook changes them (it is in use)."""
    for result in ranks:
        assert result["none_equals_hand_ddp_loop"]
        for name in ("fp16", "powersgd") + (("bf16",) if "bf16_equals_hand_ddp" in result else ()):
            assert result[f"{name}_equals_hand_ddp"], name
            assert result[f"{name}_differs_from_uncompressed"], name


@pytest.mark.multiprocess
def test_compression_hooks_stay_within_the_documented_bound(ranks):
    """The first averaged gradient under fp16_compress_hook (u = 2**-11, plus fp16's
    subnormal spacing) and bf16_compress_hook (u = 2**-8) differs from the uncompressed one
    by at most 3 u mean_r |g_r| per element (docs/10), g_r each rank's own gradient."""
    for result in ranks:
        assert 0 < result["fp16_error_over_bound"] <= 1
        if "bf16_error_over_bound" in result:  # CUDA (NCCL) only
            assert 0 < result["bf16_error_over_bound"] <= 1


@pytest.mark.multiprocess
def test_powersgd_state_is_in_the_train_state_and_resumes_bitwise(ranks):
    """PowerSGD's state rides in transforms_state['comm_hook'] (8 iterations, the one bucket
    compressed); saved at step 4 and loaded into a new state, the run ends bitwise where the
    uninterrupted one does, and without that state (a fresh hook state) it does not."""
    for result in ranks:
        assert result["powersgd_iter"] == 8 and result["powersgd_compressed"] == [0]
        assert result["powersgd_saved_iter"] == 4
        assert result["powersgd_resumed_bitwise"]
        assert result["powersgd_without_its_state_differs"]


@pytest.mark.multiprocess
def test_bf16_hook_over_gloo_is_refused_before_training(pool, tmp_path):
    """Over gloo (CPU), torch's bf16_compress_hook is refused when run prepares the step, with a
    NotImplementedError naming the hook, the process group and torch's reason (it needs NCCL),
    on both ranks."""
    messages = pool.call(*OWN, function="comm_hooks:bf16_refused_over_gloo", cwd=tmp_path, timeout_s=120)
    for message in messages:
        assert message.startswith("replicate(comm_hook=torch.distributed.algorithms.ddp_comm_hooks.default_hooks."
                                  "bf16_compress_hook) on a gloo process group: DDP refused it ("), message
        assert "NCCL" in message


def test_comm_hook_and_comm_state_are_checked_when_replicate_is_built():
    """A comm_hook that is not callable, comm_state that is not a mapping of numbers, or
    comm_state without a hook fail at construction, naming the argument."""
    with pytest.raises(TypeError, match=r"replicate\(comm_hook=\.\.\.\) must be None or a DDP communication hook"):
        af.replicate(comm_hook="bf16")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"replicate\(comm_state=\.\.\.\) must be a mapping of PowerSGDState"):
        af.replicate(comm_hook=powersgd.powerSGD_hook, comm_state=[("start_powerSGD_iter", 2)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"replicate\(comm_state=\.\.\.\) must be a mapping of option names"):
        af.replicate(comm_hook=powersgd.powerSGD_hook, comm_state={"start_powerSGD_iter": "2"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"replicate\(comm_state=\{'start_powerSGD_iter': 2\}\) configures a PowerSGD"):
        af.replicate(comm_state={"start_powerSGD_iter": 2})
    assert af.replicate(comm_hook=default_hooks.bf16_compress_hook) == af.replicate(
        comm_hook=default_hooks.bf16_compress_hook)
