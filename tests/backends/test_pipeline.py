"""pipeline over gloo: 2 stages on 2 pooled processes, and 2 stages x 2 data-parallel replicas
on 4, against a hand-written one-process loop (tests/helpers/pipeline.py).

One pooled scenario per world size (tests/workers/pp_checks.py) trains under GPipe and 1F1B
with ``accumulate(4)`` and ``clip(1.0)``; the tests compare its parts with the loop here.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import accelfn as af
from tests.helpers import pipeline as H
from tests.helpers.pool import Pools

pytestmark = pytest.mark.multiprocess

SCHEDULES = ["gpipe", "1f1b"]


def _launch(n: int) -> tuple[str, ...]:
    return ("--backend", "cpu", "--nproc-per-node", str(n), "--timeout-s", "60")


def _check_equal(results: list[dict[str, Any]], tensors: list[dict[str, torch.Tensor]], world: int) -> None:
    """Every rank's stage equals the loop's parameters and AdamW moments (1e-5); the logged
    grad norms and losses are the loop's unsharded ones; the scheduler stepped once per update."""
    data_world = world // 2
    state, norms, losses = H.hand_written(data_world=data_world)
    reference = {f"param.{n}": p.detach() for n, p in state.model.named_parameters()}
    names = {id(p): n for n, p in state.model.named_parameters()}
    for p, moments in state.optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            reference[f"{key}.{names[id(p)]}"] = moments[key]
    stage_names = [["inp.", "blocks.0.", "blocks.1."], ["blocks.2.", "blocks.3.", "out."]]
    for rank in range(world):
        got = tensors[rank]
        stage = rank // data_world
        mine = {k for k in reference if any(k.split(".", 1)[1].startswith(s) for s in stage_names[stage])}
        assert set(got) == mine, (rank, sorted(got))
        for key in mine:
            torch.testing.assert_close(got[key], reference[key], rtol=1e-5, atol=1e-5, msg=f"rank {rank} {key}")
    main = results[0]
    assert main["step"] == len(norms) >= 9
    assert H.close(main["grad_norms"], norms), (main["grad_norms"], norms)
    assert H.close(main["losses"], losses), (main["losses"], losses)
    assert main["lrs"] == [H.LR * H.factor(s) for s in range(len(norms))]
    assert math.isclose(main["lr_now"], H.LR * H.factor(len(norms)))


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_equals_a_hand_written_one_process_loop(pool: Pools, tmp_path: Any, world: int) -> None:
    """2 stages (x 2 replicas on 4 processes), GPipe and 1F1B, accumulate(4), clip(1.0): each
    rank holds only its stage, whose parameters and AdamW moments equal the 1-process loop's
    after every update of 3 epochs (windows of 16 samples and the epoch's 8 left over)."""
    results = pool.call(*_launch(world), function="pp_checks:train", out=str(tmp_path), schedules=SCHEDULES,
                        timeout_s=300)
    for schedule in SCHEDULES:
        tensors = [load_file(tmp_path / f"{schedule}-rank{r}.safetensors") for r in range(world)]
        _check_equal([r[schedule] for r in results], tensors, world)


def test_pipeline_refuses_what_it_does_not_support() -> None:
    """Compose-time errors: the (model, batch) loss form, and the transforms pipeline() does not take."""
    with pytest.raises(af.errors.TransformError, match="loss_fn\\(output, targets\\)"):
        af.pipeline(H.SPLIT, size=2)(af.train_step(lambda model, batch: model(batch).sum()))
    step = af.train_step(H.loss)
    for other in (af.tensor_parallel({"blocks.0": "colwise"}, size=2), af.shard_params(), af.invariant()):
        with pytest.raises(af.errors.TransformError, match="pipeline"):
            af.compose(af.pipeline(H.SPLIT, size=2), other)(step)
    with pytest.raises(ValueError, match="3 stages on 2 ranks"):
        af.pipeline(["blocks.1", "blocks.2"], size=2)
