"""LoRA (peft) checkpoints write the frozen base once per run, and exports in PEFT's layout
and merged under the base model's names load with peft and transformers."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import safetensors.torch
import torch

import accelfn as af
from accelfn.errors import CheckpointError
from tests.helpers import lora
from tests.helpers.pool import Pools

FROZEN = "frozen.safetensors"


def _prepared(state=None):
    state = state if state is not None else lora.state()
    return af.backends.CPU().prepare(af.train_step(lora.loss_fn), state)


def _train(state, step_fn, batches):
    for batch in batches:
        state, _ = step_fn(state, batch)
    return state


def _assert_bitwise(a, b) -> None:
    for (name, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(x, y), name
    for x, y in zip(a.optimizer.state.values(), b.optimizer.state.values()):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_a_checkpoint_after_the_first_writes_only_the_adapters_optimizer_and_manifest(tmp_path: Path) -> None:
    """With a LoRA adapter, the first checkpoint writes the frozen base (frozen.safetensors);
    each later one writes exactly the bytes of its adapter (model.safetensors), optimizer
    (state.safetensors) and manifest files, its frozen file a hard link to the first's; the
    run resumed from the second checkpoint ends bitwise equal to the uninterrupted run."""
    data = lora.batches(6)
    checkpoints = af.Checkpoints(tmp_path / "ckpt")
    state, step_fn = _prepared()
    written = {}
    for i, batch in enumerate(data[:4]):
        state, _ = step_fn(state, batch)
        before = lora.io_written()
        path = checkpoints.save(state)
        written[i + 1] = (lora.io_written() - before, path)
    first, second = checkpoints.path_for(1), checkpoints.path_for(2)
    frozen_bytes = (first / FROZEN).stat().st_size
    assert frozen_bytes > 10 * (second / "model.safetensors").stat().st_size  # the base dwarfs the adapter
    assert written[1][0] >= frozen_bytes
    for step in (2, 3, 4):
        count, path = written[step]
        own = {p.name: p.stat().st_size for p in path.iterdir() if p.name != FROZEN}
        assert sorted(own) == ["manifest.json", "manifest.sha256", "model.safetensors", "state.safetensors"]
        assert count == sum(own.values()), (step, count, own)
        assert (path / FROZEN).stat().st_ino == (first / FROZEN).stat().st_ino
    assert (first / FROZEN).stat().st_nlink == 4
    keys = set(af.checkpoint._tensorfiles.read(second, af.checkpoint._format.read(second).files)["model"])
    assert keys == set(state.model.state_dict())

    uninterrupted = _train(state, step_fn, data[4:])
    resumed, resumed_fn = _prepared()
    resumed = af.load(second, into=resumed)
    assert resumed.step == 2
    resumed = _train(resumed, resumed_fn, data[2:])
    _assert_bitwise(uninterrupted, resumed)


def test_retention_keeps_the_frozen_file_of_a_deleted_checkpoint(tmp_path: Path) -> None:
    """With keep=1 each new checkpoint replaces the last; the frozen file written at step 1
    lives on in step 3's checkpoint (a link), which loads bitwise."""
    checkpoints = af.Checkpoints(tmp_path / "ckpt", keep=1)
    state, step_fn = _prepared()
    for batch in lora.batches(3):
        state, _ = step_fn(state, batch)
        checkpoints.save(state)
    assert checkpoints.steps() == [3]
    loaded = af.load(checkpoints.latest(), into=_prepared()[0])
    _assert_bitwise(state, loaded)


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_missing_or_corrupt_linked_base_file_is_refused_naming_it(tmp_path: Path, damage: str) -> None:
    """A later checkpoint whose linked frozen file is missing or corrupted is refused by a
    CheckpointError naming that file; nothing is loaded."""
    checkpoints = af.Checkpoints(tmp_path / "ckpt")
    state, step_fn = _prepared()
    for batch in lora.batches(2):
        state, _ = step_fn(state, batch)
        checkpoints.save(state)
    target = checkpoints.path_for(2) / FROZEN
    if damage == "missing":
        target.unlink()
    else:
        data = bytearray(target.read_bytes())
        data[-3] ^= 0xFF
        target.unlink()  # a new file, so that step 1's stays intact
        target.write_bytes(bytes(data))
    into = _prepared()[0]
    before = {k: v.clone() for k, v in into.model.state_dict().items()}
    with pytest.raises(CheckpointError, match=str(target)):
        af.load(checkpoints.path_for(2), into=into)
    assert all(torch.equal(before[k], v) for k, v in into.model.state_dict().items())
    af.load(checkpoints.path_for(1), into=into)  # the first is intact


def test_a_frozen_tensor_that_changed_is_written_again(tmp_path: Path) -> None:
    """A frozen base weight changed between checkpoints (edited by hand) gives a frozen file
    of other content, written afresh rather than linked, and the checkpoint loads it."""
    checkpoints = af.Checkpoints(tmp_path / "ckpt")
    state, step_fn = _prepared()
    data = lora.batches(2)
    state, _ = step_fn(state, data[0])
    checkpoints.save(state)
    base = state.model.get_base_model().model.layers[0].mlp.up_proj.weight
    with torch.no_grad():
        base.add_(1.0)
    state, _ = step_fn(state, data[1])
    checkpoints.save(state)
    one, two = checkpoints.path_for(1) / FROZEN, checkpoints.path_for(2) / FROZEN
    assert one.stat().st_ino != two.stat().st_ino
    loaded = af.load(checkpoints.path_for(2), into=_prepared()[0])
    _assert_bitwise(state, loaded)


def test_adapter_and_merged_exports_reload_with_peft_and_transformers(tmp_path: Path) -> None:
    """After 3 updates, save_model(adapters="peft") writes PEFT's layout, which
    PeftModel.from_pretrained loads onto a fresh base, and adapters="merged" the merged
    model with its config.json, which AutoModelForCausalLM.from_pretrained loads; each gives
    the trained model's logits (<= 1e-6, fp32); the state is untouched."""
    state, step_fn = _prepared()
    state = _train(state, step_fn, lora.batches(3))
    before = {k: v.clone() for k, v in state.model.state_dict().items()}
    expected = lora.logits(state.model)
    assert not torch.allclose(expected, lora.logits(lora.base()), atol=1e-3)  # the adapter matters
    adapter = af.save_model(state, tmp_path / "adapter", adapters="peft")
    merged = af.save_model(state, tmp_path / "merged", adapters="merged")
    assert sorted(os.listdir(adapter)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert sorted(os.listdir(merged)) == ["config.json", "model.safetensors"]
    peft_logits, merged_logits = lora.reloaded(adapter, merged)
    assert (peft_logits - expected).abs().max() <= 1e-6
    assert (merged_logits - expected).abs().max() <= 1e-6
    assert all(torch.equal(before[k], v) for k, v in state.model.state_dict().items())


def test_save_model_adapters_refuses_bad_values_and_models_without_adapters(tmp_path: Path) -> None:
    """adapters= other than None/"peft"/"merged", or for a model that is not a PeftModel,
    is a ValueError saying what is accepted; nothing is written."""
    with pytest.raises(ValueError, match="'peft'.*'merged'"):
        af.save_model(lora.state(), tmp_path / "a", adapters="lora")
    plain = lora.base()
    with pytest.raises(ValueError, match="not a peft.PeftModel"):
        af.save_model(af.TrainState.create(plain, torch.optim.SGD(plain.parameters(), lr=0.1)), tmp_path / "b",
                      adapters="merged")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.multiprocess
def test_exports_of_a_sharded_and_a_tensor_parallel_lora_model_reload_with_peft_and_transformers(
        pool: Pools, tmp_path: Path) -> None:
    """On 2 processes, under shard_params() and under tensor_parallel (MLP split, adapters
    whole), the adapter export loads with PeftModel.from_pretrained and the merged one with
    AutoModelForCausalLM.from_pretrained, each giving the trained model's logits (<= 1e-6)."""
    pool.launch("--nproc-per-node", "2", script="lora_exports.py", script_args=(tmp_path,))
    for mode in ("fsdp", "tp"):
        expected = safetensors.torch.load_file(tmp_path / mode / "logits.safetensors")["logits"]
        peft_logits, merged_logits = lora.reloaded(tmp_path / mode / "adapter", tmp_path / mode / "merged")
        assert (peft_logits - expected).abs().max() <= 1e-6, mode
        assert (merged_logits - expected).abs().max() <= 1e-6, mode


@pytest.mark.parametrize("asynchronous", [False, True])
def test_run_checkpoints_link_the_frozen_base_also_in_the_background(tmp_path: Path, asynchronous: bool) -> None:
    """run's checkpoints (every update; written in the background or not) hold one frozen
    file between them: every later checkpoint's is a hard link to the first's."""
    state = lora.state()
    step = af.train_step(lora.loss_fn)
    checkpoints = af.Checkpoints(tmp_path / "ckpt", every_steps=1, asynchronous=asynchronous)
    af.run(step, state, lora.batches(3), backend=af.backends.CPU(), epochs=1, checkpoints=checkpoints,
           progress=False)
    assert checkpoints.steps() == [1, 2, 3]
    inodes = {(checkpoints.path_for(s) / FROZEN).stat().st_ino for s in (1, 2, 3)}
    assert len(inodes) == 1


SHARD = "shard-{:05d}-model-00001-of-00001.safetensors"


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory, pool: Pools) -> Path:
    """2 processes under shard_params (``tests/workers/lora_sharded.py``): checkpoints after
    updates 1, 2 and 3, each rank's bytes written per save, a resume from step 2, and a
    checkpoint of the base edited by hand (step 5)."""
    out = tmp_path_factory.mktemp("lora_sharded")
    pool.launch("--nproc-per-node", "2", script="lora_sharded.py", script_args=(out,))
    return out


def _own_files(path: Path, rank: int) -> dict[str, int]:
    """The files rank ``rank`` writes into the sharded checkpoint ``path`` but its frozen ones:
    its ``dcp/`` shard file, and for rank 0 every file outside the DCP folders."""
    files = {f"dcp/{SHARD.format(rank + 1)}": (path / "dcp" / SHARD.format(rank + 1)).stat().st_size}
    if rank == 0:
        files |= {p.name: p.stat().st_size for p in path.iterdir() if p.is_file()}
    return files


@pytest.mark.multiprocess
def test_a_sharded_checkpoint_after_the_first_writes_the_frozen_base_by_no_rank(sharded_run: Path) -> None:
    """Under shard_params on 2 processes, the first checkpoint's ranks write their shards of
    the frozen base (dcp-frozen/); in each later one, every rank writes only its adapter and
    optimizer shards (dcp/) and rank 0 the manifest, plus the few KB of gloo messages a save
    exchanges (far below a rank's 0.6 MB of base), and every dcp-frozen/ file is a hard link
    to the first checkpoint's; the manifest places the frozen tensors apart, with every
    rank's checksum."""
    ckpt = sharded_run / "ckpt"
    first = ckpt / "step_00000001"
    for rank in (0, 1):
        written = {int(k): v for k, v in json.loads((sharded_run / f"written-{rank}.json").read_text()).items()}
        frozen = first / "dcp-frozen" / SHARD.format(rank + 1)
        assert frozen.stat().st_size > 500_000
        assert written[1] >= sum(_own_files(first, rank).values()) + frozen.stat().st_size
        for step in (2, 3):
            path = ckpt / f"step_{step:08d}"
            own = sum(_own_files(path, rank).values())
            assert own <= written[step] < own + frozen.stat().st_size // 4, (rank, step, written[step], own)
            assert (path / "dcp-frozen" / SHARD.format(rank + 1)).stat().st_ino == frozen.stat().st_ino
        assert frozen.stat().st_nlink == 3  # steps 1, 2, 3 (step 5's base was edited)
    manifest = json.loads((ckpt / "step_00000002" / "manifest.json").read_text())
    frozen_table = manifest["sharded"]["frozen"]
    assert len(frozen_table["checksums"]) == 2 and frozen_table["checksums"][0] != frozen_table["checksums"][1]
    assert all("lora_" not in name for name in frozen_table["model"])
    assert all("lora_" in name for name in manifest["sharded"]["model"] if name.endswith(".weight")
               and ("q_proj" in name or "v_proj" in name) and "base_layer" not in name)
    assert sorted(os.listdir(ckpt / "step_00000002")) == ["dcp", "dcp-frozen", "manifest.json", "manifest.sha256"]


@pytest.mark.multiprocess
def test_a_sharded_lora_run_resumed_from_its_second_checkpoint_is_bitwise_the_uninterrupted_run(
        sharded_run: Path) -> None:
    """The 2-process run resumed from step 2 (its base read from the linked dcp-frozen/ files)
    ends with bitwise the model and optimizer state of the uninterrupted run."""
    expected = safetensors.torch.load_file(sharded_run / "uninterrupted.safetensors")
    resumed = safetensors.torch.load_file(sharded_run / "resumed.safetensors")
    assert sorted(resumed) == sorted(expected)
    assert [k for k in expected if not torch.equal(expected[k], resumed[k])] == []


def _wide_state() -> af.TrainState:
    """The worker's LoRA model (``lora_sharded.WIDE``), unsharded in this process."""
    from tests.workers.lora_sharded import WIDE

    torch.manual_seed(lora.SEED)
    base = lora.transformers.LlamaForCausalLM(lora.transformers.LlamaConfig(**{**lora.CONFIG, **WIDE}))
    return lora.state(lora.lora(base))


@pytest.mark.multiprocess
def test_a_sharded_checkpoint_whose_base_was_edited_writes_it_again_and_loads_it(sharded_run: Path) -> None:
    """A frozen weight edited by hand gives other checksums: step 5's dcp-frozen/ files are
    written afresh (not links), and the checkpoint loads in one unsharded process with the
    edited model."""
    ckpt = sharded_run / "ckpt"
    for rank in (0, 1):
        edited = ckpt / "step_00000005" / "dcp-frozen" / SHARD.format(rank + 1)
        assert edited.stat().st_ino != (ckpt / "step_00000001" / "dcp-frozen" / SHARD.format(rank + 1)).stat().st_ino
        assert edited.stat().st_nlink == 1
    loaded = af.load(ckpt / "step_00000005", into=_wide_state())
    expected = safetensors.torch.load_file(sharded_run / "edited.safetensors")
    model = {f"model/{k}": v for k, v in loaded.model.state_dict().items()}
    assert sorted(model) == sorted(k for k in expected if k.startswith("model/"))
    assert [k for k in model if not torch.equal(model[k], expected[k])] == []


@pytest.mark.multiprocess
@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_missing_or_corrupt_linked_frozen_shard_file_is_refused_naming_it(sharded_run: Path, tmp_path: Path,
                                                                         damage: str) -> None:
    """Step 2's linked dcp-frozen/ file of rank 1, missing or with one byte flipped (a new
    file: step 1's stays intact), makes the load a CheckpointError naming that file before
    anything changes; step 1 still loads."""
    ckpt = tmp_path / "ckpt"
    for step in (1, 2):  # copied with the links kept (cp -a)
        (ckpt / f"step_{step:08d}" / "dcp-frozen").mkdir(parents=True)
    for source in (sharded_run / "ckpt").glob("step_0000000[12]/**/*"):
        target = ckpt / source.relative_to(sharded_run / "ckpt")
        if source.is_dir():
            target.mkdir(exist_ok=True)
        elif "dcp-frozen" in source.parts and "step_00000002" in source.parts:
            os.link(ckpt / "step_00000001" / "dcp-frozen" / source.name, target)
        else:
            target.write_bytes(source.read_bytes())
    target = ckpt / "step_00000002" / "dcp-frozen" / SHARD.format(2)
    assert target.stat().st_nlink == 2
    if damage == "missing":
        target.unlink()
    else:
        data = bytearray(target.read_bytes())
        data[-3] ^= 0xFF
        target.unlink()
        target.write_bytes(bytes(data))
    into = _wide_state()
    before = {k: v.clone() for k, v in into.model.state_dict().items()}
    with pytest.raises(CheckpointError, match=str(target)):
        af.load(ckpt / "step_00000002", into=into)
    assert all(torch.equal(before[k], v) for k, v in into.model.state_dict().items())
    af.load(ckpt / "step_00000001", into=into)


@pytest.mark.multiprocess
def test_a_tensor_parallel_lora_checkpoint_links_its_frozen_base_and_loads_bitwise(sharded_run: Path) -> None:
    """Under tensor_parallel (the MLP split, the rest whole) on 2 processes, the second
    checkpoint's dcp-frozen/ files are the first's (hard links), and the first loads into a
    fresh tensor-parallel state with bitwise the model and optimizer state it saved."""
    first, second = sharded_run / "tp" / "step_00000001", sharded_run / "tp" / "step_00000002"
    names = sorted(p.name for p in (first / "dcp-frozen").iterdir())
    assert names and names == sorted(p.name for p in (second / "dcp-frozen").iterdir())
    for name in names:
        assert (second / "dcp-frozen" / name).stat().st_ino == (first / "dcp-frozen" / name).stat().st_ino
    saved = safetensors.torch.load_file(sharded_run / "tp-saved.safetensors")
    loaded = safetensors.torch.load_file(sharded_run / "tp-loaded.safetensors")
    assert sorted(saved) == sorted(loaded)
    assert [k for k in saved if not torch.equal(saved[k], loaded[k])] == []


def test_the_sharded_frozen_table_round_trips_and_its_bad_values_are_named() -> None:
    """The manifest's sharded.frozen record (FrozenShards) round-trips through the manifest's
    converter, is omitted where there is none (older manifests read the same), and a wrong
    algorithm or checksum is refused naming the field."""
    from accelfn.checkpoint._manifest import FrozenShards, ShardedTables, ShardedTensor, dumps, loads

    frozen = FrozenShards(model={"w": ShardedTensor(shape=(4, 2), dtype="float32")}, algorithm="xxh3_128",
                          checksums=("0a", "ff"))
    tables = ShardedTables(model={}, aliases={}, optimizer={}, grads={}, frozen=frozen)
    assert loads(dumps(tables), ShardedTables) == tables
    plain = ShardedTables(model={}, aliases={}, optimizer={}, grads={})
    assert "frozen" not in json.loads(dumps(plain)) and loads(dumps(plain), ShardedTables) == plain
    for field, value, expected in [("algorithm", "md5", "frozen.algorithm: 'md5'"),
                                   ("checksums", ["0a", "xyz"], "frozen.checksums[1]: 'xyz'"),
                                   ("checksums", "0a", "frozen.checksums: '0a'")]:
        data = json.loads(dumps(tables))
        data["frozen"][field] = value
        with pytest.raises(CheckpointError, match=re.escape(expected)):
            loads(json.dumps(data).encode(), ShardedTables)
