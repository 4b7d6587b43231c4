"""pipeline over gloo: 2 stages on 2 pooled processes, and 2 stages x 2 data-parallel replicas
on 4, against a hand-written one-process loop (tests/helpers/pipeline.py).

One pooled scenario per world size (tests/workers/pp_checks.py) trains under GPipe and 1F1B
with ``accumulate(4)`` and ``clip(1.0)``; the tests compare its parts with the loop here.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import accelfn as af
from accelfn.distributed.pipeline import cut
from tests.helpers import pipeline as H
from tests.helpers.pool import Pools
from tests.helpers.tracking import Recorder

pytestmark = pytest.mark.multiprocess

#: the modules of each pipe position's stages (interleaved: stages 0 and 2, 1 and 3)
STAGES = {"gpipe": [["blocks.0", "blocks.1", "inp"], ["blocks.2", "blocks.3", "out"]],
          "1f1b": [["blocks.0", "blocks.1", "inp"], ["blocks.2", "blocks.3", "out"]],
          "interleaved_1f1b": [["blocks.0", "blocks.2", "inp"], ["blocks.1", "blocks.3", "out"]]}


def _launch(n: int) -> tuple[str, ...]:
    return ("--backend", "cpu", "--nproc-per-node", str(n), "--timeout-s", "60")


def _check_equal(results: list[dict[str, Any]], tensors: list[dict[str, torch.Tensor]], world: int,
                 stages: list[list[str]]) -> None:
    """Every rank holds the modules ``stages`` lists for its pipe position, and they equal the
    loop's parameters and AdamW moments (1e-5), and af.evaluate's outputs over the data are
    the loop's model's, in order, on every rank; the logged grad norms and losses are the
    loop's unsharded ones; the scheduler stepped once per update."""
    data_world = world // 2
    state, norms, losses = H.hand_written(data_world=data_world)
    reference = {f"param.{n}": p.detach() for n, p in state.model.named_parameters()}
    names = {id(p): n for n, p in state.model.named_parameters()}
    for p, moments in state.optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            reference[f"{key}.{names[id(p)]}"] = moments[key]
    with torch.no_grad():
        outputs = state.model(H.data().tensors[0])
    for rank in range(world):
        got = dict(tensors[rank])
        torch.testing.assert_close(got.pop("evaluated"), outputs, rtol=1e-5, atol=1e-5, msg=f"rank {rank} evaluate")
        expected = stages[rank // data_world]
        assert sorted({n.rsplit(".", 1)[0] for n in results[rank]["names"]}) == expected, (rank, results[rank]["names"])
        mine = {k for k in reference if k.split(".", 1)[1] in results[rank]["names"]}
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
    """2 stages (x 2 replicas on 4 processes, replicate()), GPipe and 1F1B (on 2 processes also
    interleaved 1F1B, 4 stages), accumulate(4), clip(1.0): each rank holds only its stages,
    whose parameters and AdamW moments equal the 1-process loop's after the 15 (4 processes:
    9) updates of 3 epochs, windows of 16 (32) samples and the epoch's 8 left over; the logged
    grad norms and losses are the loop's, and the scheduler stepped once per update. With an
    af.Loss of ragged item counts (1F1B, one epoch; on 4 processes each replica's own counts),
    the parameters, logged loss and item-weighted metric are the loop's that divides each
    window's summed loss by its items. The 1F1B state's checkpoint is written by each rank,
    its stage only (replicas once), and loads bitwise into one plain process and back into
    the same layout."""
    schedules = ["gpipe", "1f1b", "interleaved_1f1b"] if world == 2 else ["gpipe", "1f1b"]
    results = pool.call(*_launch(world), function="pp_checks:train", out=str(tmp_path), schedules=schedules,
                        timeout_s=300)
    for schedule in schedules:
        tensors = [load_file(tmp_path / f"{schedule}-rank{r}.safetensors") for r in range(world)]
        _check_equal([r[schedule] for r in results], tensors, world, STAGES[schedule])
    _check_written_by_stage(tmp_path / "ckpt", world)  # the 1F1B state, saved: into one plain process
    assert results[0]["reloaded_step"] == results[0]["1f1b"]["step"]
    for r in range(world):  # and into the same layout: each rank reads its stage, wherever DCP wrote it
        reloaded, ran = load_file(tmp_path / f"reloaded-rank{r}.safetensors"), load_file(
            tmp_path / f"1f1b-rank{r}.safetensors")
        assert reloaded.keys() == ran.keys() - {"evaluated"} and all(torch.equal(v, ran[k]) for k, v in reloaded.items())
    state = af.load(tmp_path / "ckpt", into=H.make_state())
    assert state.step == results[0]["1f1b"]["step"] == state.scheduler.last_epoch  # type: ignore[union-attr]
    saved: dict[str, torch.Tensor] = {}
    for r in range(world):
        saved |= {k: v for k, v in load_file(tmp_path / f"1f1b-rank{r}.safetensors").items() if k != "evaluated"}
    held = _held(state)
    assert held.keys() == saved.keys() and all(torch.equal(held[k], saved[k]) for k in saved)
    state, losses, maes, _ = H.hand_written_items(summed=True, data_world=world // 2)  # an af.Loss
    assert H.close(results[0]["items"]["losses"], losses), (results[0]["items"]["losses"], losses)
    assert H.close(results[0]["items"]["maes"], maes), (results[0]["items"]["maes"], maes)
    params = dict(state.model.named_parameters())
    for rank in range(world):
        for key, value in load_file(tmp_path / f"items-rank{rank}.safetensors").items():
            if key.startswith("param."):
                torch.testing.assert_close(value, params[key[len("param."):]].detach(), rtol=1e-5, atol=1e-5)


def test_pipeline_refuses_what_it_does_not_support() -> None:
    """Compose-time errors: the transforms pipeline() does not take, a number of stages its schedule cannot place."""
    step = af.train_step(af.output_loss(H.loss))
    for other in (af.tensor_parallel({"blocks.0": "colwise"}, size=2), af.shard_params(), af.invariant()):
        with pytest.raises(af.errors.TransformError, match="pipeline"):
            af.compose(af.pipeline(H.SPLIT, size=2), other)(step)
    with pytest.raises(ValueError, match="3 stages on 2 ranks"):
        af.pipeline(["blocks.1", "blocks.2"], size=2)


@pytest.mark.parametrize("loss_fn", [lambda m, b: H.loss(m(b[0]), b[1]),  # issue 37's case: passed, then failed
                                     lambda model, batch: model(batch).sum(),  # inside the schedule on one rank
                                     H.loss])  # named (output, targets), but not said so: never guessed
def test_pipeline_refuses_a_loss_not_spelled_output_loss_when_applied(loss_fn: Any) -> None:
    """pipeline() applied to a step whose loss is a plain callable (called loss_fn(model, batch)
    everywhere else), whatever its parameters are named, raises a TransformError naming
    af.output_loss; af.output_loss(fn) is taken, and a non-callable given to it is refused."""
    with pytest.raises(af.errors.TransformError, match=r"af\.train_step\(af\.output_loss\(fn\)\) with fn\(output, "
                                                       r"targets\)"):
        af.pipeline(H.SPLIT, size=2)(af.train_step(loss_fn))
    step = af.pipeline(H.SPLIT, size=2)(af.train_step(af.output_loss(loss_fn)))
    assert step.loss_fn == af.OutputLoss(loss_fn) and af.output_loss(step.loss_fn) is step.loss_fn
    with pytest.raises(TypeError, match=r"output_loss\(fn\) needs a callable"):
        af.output_loss("mse")  # type: ignore[arg-type]


def test_an_output_loss_without_pipeline_is_refused_before_anything_changes() -> None:
    """af.output_loss(fn) in a program without pipeline() (which would call it as fn(model, batch))
    is refused by prepare, af.run and af.plan with a TransformError naming the fix, before the
    model is placed or the state gets a transform's entry."""
    step = af.compose(af.shard_data(), af.accumulate(2))(af.train_step(af.output_loss(H.loss)))
    state = H.make_state()
    params = [p.detach().clone() for p in state.model.parameters()]
    for attempt in (lambda: af.backends.CPU().prepare(step, state),
                    lambda: af.run(step, state, H.loader(), backend=af.backends.CPU(), progress=False),
                    lambda: af.plan(step, state, H.loader(), world_size=2)):
        with pytest.raises(af.errors.TransformError, match=r"af\.output_loss\(fn\).*this program has none.*"
                                                           r"loss_fn\(model, batch\)"):
            attempt()
    assert state.step == 0 and not state.transforms_state
    assert all(torch.equal(a, b) for a, b in zip(params, state.model.parameters()))


class _TiedLM(torch.nn.Module):
    """A traceable LM whose output layer is its embedding (tied)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.head = torch.nn.Linear(16, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def _gpt2() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64,
                                                                n_positions=16))


@pytest.mark.parametrize(("model", "split_points", "size", "error"), [
    (H.Net, ["blocks.7"], 2, r"Net has no module 'blocks\.7' \(it has 'blocks\.0', 'blocks\.1', 'blocks\.2', "
                              r"'blocks\.3'\)"),
    (H.Net, ["block.2"], 2, r"no module 'block\.2' \(it has 'blocks\.2', "),
    (H.Net, ["inp"], 2, r"\['inp'\]\): stage 0 would be empty: the model runs nothing before 'inp', the first module"),
    (H.Net, ["blocks.3", "blocks.1", "blocks.2"], 2, r"the forward uses 'blocks\.1' before 'blocks\.3'; list the split "
                                                     r"points in the order the forward runs them"),
    (_TiedLM, ["blocks.2"], 2, r"the parameter 'head\.weight' is used by stages 0 and 1 \(a weight tied across stages"),
    (_gpt2, ["transformer.h.1"], 2, r"cannot trace GPT2LMHeadModel .*a transformers model's forward takes keyword "
                                    r"arguments.*tied weights \(lm_head\.weight = transformer\.wte\.weight\)"),
], ids=["no-such-index", "no-such-name", "first-module", "out-of-order", "tied", "hf-gpt2"])
def test_split_points_a_model_cannot_be_cut_at_are_refused_by_name(model: Any, split_points: list[str], size: int,
                                                                   error: str) -> None:
    """The cut of pipeline(), which prepare checks on every rank before anything changes, refuses
    by name (ValueError): a split point that is no module (the modules it may have meant listed),
    one at the first module the forward runs (an empty first stage), split points out of the
    forward's order, a weight tied across stages, and a transformers GPT-2 (untraceable, tied)."""
    schedule = "interleaved_1f1b" if len(split_points) + 1 > size else "gpipe"
    with pytest.raises(ValueError, match=error):
        cut(model(), af.pipeline(split_points, size=size, schedule=schedule))


def test_split_points_that_cannot_cut_the_model_are_refused_on_every_rank_before_any_update(pool: Pools) -> None:
    """On 2 processes, af.run of a pipeline whose split point is no module, is the first module
    the forward runs (an empty stage: it trained before), or comes out of the forward's order
    raises ValueError naming it on both ranks, within the scenario's time, no update applied."""
    expected = {"nosuch": r"Net has no module 'blocks\.7'", "first": r"stage 0 would be empty",
                "order": r"the forward uses 'blocks\.1' before 'blocks\.3'"}
    for result in pool.call(*_launch(2), function="pp_checks:misuse", timeout_s=120):
        for variant, pattern in expected.items():
            raised = result[variant]["raised"]
            assert raised is not None and raised.startswith("ValueError: pipeline(split_points="), raised
            assert re.search(pattern, raised) and result[variant]["updates"] == 0


def _part(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def test_pipeline_checkpoints_resume_load_into_one_process_and_export(pool: Pools, tmp_path: Any) -> None:
    """2 stages on 2 processes, 1F1B: a run stopped after 7 updates (mid-epoch), checkpointed
    and resumed by a fresh state ends bitwise as the uninterrupted run (each rank's parameters
    and AdamW moments); the checkpoint loads into one unsharded process with the stopped
    run's parameters and moments, bitwise, from both stages; af.save_model of the pipelined
    state loads into a fresh model with load_state_dict(strict=True) (and, in files of at
    most 1 KiB, holds the same tensors, each once), and af.evaluate of the
    pipelined state gives that model's outputs, each sample once and in order, on both ranks."""
    results = pool.call(*_launch(2), function="pp_checks:checkpoints", out=str(tmp_path), timeout_s=300)
    main = results[0]
    assert main["steps"] == [15, 7, 15] and main["stopped_epoch_micro_step"] == 8
    assert main["lr"][0] == main["lr"][1]
    tensors = [load_file(tmp_path / f"ckpt-rank{r}.safetensors") for r in range(2)]
    for rank in range(2):
        whole, resumed = _part(tensors[rank], "whole."), _part(tensors[rank], "resumed.")
        assert whole.keys() == resumed.keys() and whole
        assert all(torch.equal(whole[k], resumed[k]) for k in whole), rank
    _check_written_by_stage(tmp_path / "ckpt" / "step_00000007", 2)
    state = af.load(tmp_path / "ckpt" / "step_00000007", into=H.make_state())
    assert state.step == 7 and state.epoch_micro_step == 8
    stopped = _part(tensors[0], "stopped.") | _part(tensors[1], "stopped.")
    loaded = _held(state)
    assert loaded.keys() == stopped.keys()
    assert all(torch.equal(loaded[k], stopped[k]) for k in stopped)
    assert state.scheduler.last_epoch == 7  # type: ignore[union-attr]  # made with one
    model = H.Net()
    model.load_state_dict(load_file(tmp_path / "export" / "model.safetensors"), strict=True)
    index = orjson.loads((tmp_path / "export-files" / "model.safetensors.index.json").read_bytes())
    split = [load_file(tmp_path / "export-files" / f) for f in sorted(set(index["weight_map"].values()))]
    assert len(split) > 2 and sum(map(len, split)) == len(model.state_dict())  # each tensor in one file
    joined = {k: v for part in split for k, v in part.items()}
    assert all(torch.equal(joined[k], v) for k, v in model.state_dict().items())
    whole = _part(tensors[0], "whole.") | _part(tensors[1], "whole.")
    assert all(torch.equal(p.detach(), whole[f"param.{n}"]) for n, p in model.named_parameters())
    x, y = H.data().tensors  # af.evaluate of the pipelined state: every sample once, in order, on both ranks
    with torch.no_grad():
        expected = model(x)
    for rank in range(2):
        evaluated = load_file(tmp_path / f"evaluated-rank{rank}.safetensors")
        assert evaluated["out"].shape == (H.NUM_SAMPLES, 1)
        torch.testing.assert_close(evaluated["out"], expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(evaluated["error"], (expected - y).abs(), rtol=1e-6, atol=1e-6)
    _check_loss_forms(results, tmp_path)


def _held(state: af.TrainState) -> dict[str, torch.Tensor]:
    """A plain state's parameters and AdamW moments, named as pp_checks._tensors names them."""
    held = {f"param.{n}": p.detach() for n, p in state.model.named_parameters()}
    names = {id(p): n for n, p in state.model.named_parameters()}
    for p, moments in state.optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            held[f"{key}.{names[id(p)]}"] = moments[key]
    return held


def _check_written_by_stage(path: Path, world: int) -> None:
    """The pipelined checkpoint is sharded (DCP files, the manifest's ``sharded`` table of the
    whole model, no model tensor of its own) and each rank wrote its own tensors only: no key
    (parameter or AdamW moment) in two ranks' files (data-parallel replicas' written once),
    each of the ``world`` files holding only its rank's stage's model keys, all of them
    together the whole model's; so rank 0 never received another stage's tensors."""
    manifest = orjson.loads((path / "manifest.json").read_bytes())
    whole = list(H.Net().state_dict())
    assert list(manifest["sharded"]["model"]) == whole and manifest["model"] == {}
    files = sorted((path / "dcp").iterdir())
    assert [f.name for f in files] == [f"shard-{r:05d}-model-00001-of-00001.safetensors" for r in range(1, world + 1)]
    keys = []
    for f in files:
        with safe_open(f, "pt") as opened:
            keys.append(set(opened.keys()))
    assert all(not keys[i] & keys[j] for i in range(world) for j in range(i))
    assert sorted(set().union(*keys) & set(whole)) == sorted(whole)
    stages = [{k for k in whole if any(k.startswith(f"{m}.") for m in modules)} for modules in STAGES["1f1b"]]
    for rank in range(world):  # a pipeline's stages are world // 2 ranks apart
        assert keys[rank] & set(whole) <= stages[rank // (world // 2)], (rank, keys[rank])


def _check_loss_forms(results: list[dict[str, Any]], tmp_path: Any) -> None:
    """An af.Loss with ragged counts (3 micro-batches without items): the parameters equal the
    loop that divides each window's summed loss by its item count (1e-5), the logged loss is
    the window's total over its count, the metric the item-weighted mean; (loss, metrics):
    the metric is the window's sample-weighted mean. Logged alike on both ranks."""
    for name, summed in (("items", True), ("mean_metrics", False)):
        state, losses, maes, empty = H.hand_written_items(summed=summed)
        assert empty == (3 if summed else 0)
        params = dict(state.model.named_parameters())
        for rank in range(2):
            logged = results[rank]["logged"][name]
            assert logged["step"] == len(losses) == 5
            assert H.close(logged["losses"], losses), (name, rank, logged["losses"], losses)
            assert H.close(logged["maes"], maes), (name, rank, logged["maes"], maes)
            got = load_file(tmp_path / f"{name}-rank{rank}.safetensors")
            assert any(k.startswith("param.") for k in got)
            for key, value in got.items():
                if key.startswith("param."):
                    torch.testing.assert_close(value, params[key[len("param."):]].detach(), rtol=1e-5, atol=1e-5)


def test_pipeline_fp16_equals_one_process_fp16(pool: Pools, tmp_path: Any) -> None:
    """with_precision("fp16") under pipeline (2 stages on 2 processes, 1F1B, accumulate(4),
    clip(1.0), 2 epochs): the same loss scales, skipped updates and grad norms as the same
    program on one process without pipeline, and the same parameters (1e-4: fp16 activations)."""
    results = pool.call(*_launch(2), function="pp_checks:fp16", out=str(tmp_path), timeout_s=300)
    step = af.compose(af.shard_data(seed=H.P.SHARD_SEED), af.accumulate(H.ACCUMULATE), af.clip(H.CLIP),
                      af.with_precision("fp16"))(af.train_step(lambda model, batch: H.loss(model(batch[0]), batch[1])))
    recorder = Recorder()
    state = af.run(step, H.make_state(), H.loader(), backend=af.backends.CPU(), epochs=2, progress=False,
                   trackers=[recorder])
    main = results[0]
    assert main["scales"] == [float(p["loss_scale"]) for _, p in recorder.points]
    assert main["skipped"] == [int(p["skipped"]) for _, p in recorder.points] and 0 < sum(main["skipped"])
    assert H.close(main["grad_norms"], [float(p["grad_norm"]) for _, p in recorder.points if "grad_norm" in p])
    assert main["step"] == state.step > 0
    params = dict(state.model.named_parameters())
    for rank in range(2):
        for key, value in load_file(tmp_path / f"fp16-rank{rank}.safetensors").items():
            if key.startswith("param."):
                torch.testing.assert_close(value, params[key[len("param."):]].detach(), rtol=1e-4, atol=1e-4)
