"""``af.save_model``: consolidated Hugging Face-layout weights that plain tools load."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

import accelfn as af
from tests.helpers import launch as _launch
from tests.helpers.pool import Pools
from tests.helpers.sharding import Blocks, build, loader, program

EXAMPLE = _launch.ROOT / "examples" / "hf_gpt2.py"


def _read_all(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors |= safetensors.torch.load_file(path)
    return tensors


def _fresh_tied() -> Blocks:
    torch.manual_seed(123)
    return Blocks(tied=True)


def test_save_model_writes_one_file_that_loads_strictly_into_a_fresh_tied_model(tmp_path: Path) -> None:
    """Below max_shard_size the weights are one model.safetensors; load_file + strict
    load_state_dict into a fresh tied model gives equal weights, still tied."""
    state = build(sharded=False, tied=True)
    assert af.save_model(state, tmp_path / "export") == tmp_path / "export"
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["model.safetensors"]
    fresh = _fresh_tied()
    fresh.load_state_dict(safetensors.torch.load_file(tmp_path / "export" / "model.safetensors"), strict=True)
    assert fresh.out.weight is fresh.emb.weight
    for name, value in state.model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_save_model_above_max_shard_size_writes_shards_and_an_index(tmp_path: Path) -> None:
    """With max_shard_size=300 bytes the weights split into model-0000i-of-0000n files of at
    most 300 bytes of tensors each (or one larger tensor), an index maps every key to its
    file with the total size, and together they load strictly into a fresh tied model."""
    state = build(sharded=False, tied=True)
    af.save_model(state, tmp_path / "export", max_shard_size=300)
    index = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())
    weights = state.model.state_dict()
    files = sorted({*index["weight_map"].values()})
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert len(files) > 3 and sorted(index["weight_map"]) == sorted(weights)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in weights.values())
    for name in files:
        tensors = safetensors.torch.load_file(tmp_path / "export" / name)
        assert sorted(tensors) == sorted(k for k, f in index["weight_map"].items() if f == name)
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors.values()) <= 300
    fresh = _fresh_tied()
    fresh.load_state_dict(_read_all(tmp_path / "export"), strict=True)
    for name, value in weights.items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_save_model_again_replaces_the_files_of_the_earlier_export(tmp_path: Path) -> None:
    """Exporting into a folder that holds a sharded export leaves only the new file: the old
    shards and index are removed once the new weights are written."""
    state = build(sharded=False)
    af.save_model(state, tmp_path, max_shard_size=300)
    (tmp_path / "config.json").write_text("{}")
    af.save_model(state, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def _contents(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_save_model_refuses_a_checkpoint_directory_and_leaves_it_loadable(tmp_path: Path) -> None:
    """save_model into a directory af.Checkpoints wrote raises CheckpointError naming the
    checkpoint and a folder of its own; every file is unchanged and the checkpoint loads."""
    state = build(sharded=False)
    checkpoints = af.Checkpoints(tmp_path / "ckpt", every_steps=5)
    state = af.run(program(sharded=False), state, loader(), backend=af.backends.CPU(), progress=False,
                   checkpoints=checkpoints)
    latest = checkpoints.latest()
    assert latest is not None
    before = _contents(latest)
    with pytest.raises(af.CheckpointError, match=(
            rf"save_model\(\): {latest} is an accelfn checkpoint \(it holds manifest.json\); exporting into it "
            rf"would replace the checkpoint's own model.safetensors, and it would no longer load. Export to a "
            rf"folder of its own, e.g. {latest.parent / 'export'}")):
        af.save_model(state, latest)
    assert _contents(latest) == before
    assert af.load(latest, into=build(sharded=False)).step == state.step


def test_save_model_leaves_files_of_the_layouts_names_it_did_not_write(tmp_path: Path) -> None:
    """A folder holding a model.safetensors and a shard that another tool wrote: save_model
    (one file, which would replace the first and remove the second) raises CheckpointError
    naming both, and nothing changes; an earlier export of its own is still replaced."""
    state = build(sharded=False)
    tensors = {"w": torch.ones(2)}
    safetensors.torch.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    safetensors.torch.save_file(tensors, tmp_path / "model-00002-of-00002.safetensors")
    before = _contents(tmp_path)
    with pytest.raises(af.CheckpointError, match=(
            rf"save_model\(\): {tmp_path} holds model-00002-of-00002.safetensors, model.safetensors, which "
            r"save_model did not write \(another tool's export, or files of your own\)")):
        af.save_model(state, tmp_path)
    assert _contents(tmp_path) == before
    export = tmp_path / "export"
    af.save_model(state, export, max_shard_size=300)
    af.save_model(state, export)
    assert sorted(p.name for p in export.iterdir()) == ["model.safetensors"]


@pytest.mark.parametrize(("size", "error", "message"), [
    ("10 parsecs", ValueError, r"save_model\(max_shard_size='10 parsecs'\): not a size; write it as '10GB'"),
    (0, ValueError, r"save_model\(max_shard_size=0\): must be > 0 bytes"),
    (1.5, TypeError, r"save_model\(max_shard_size=\.\.\.\) takes bytes as an int or a str such as '5GB', got 1\.5"),
])
def test_save_model_refuses_a_bad_max_shard_size_before_writing(tmp_path: Path, size: object, error: type,
                                                                message: str) -> None:
    """A max_shard_size that is not a positive size is refused, naming it, and nothing is written."""
    with pytest.raises(error, match=message):
        af.save_model(build(sharded=False), tmp_path / "export", max_shard_size=size)  # type: ignore[arg-type]
    assert not (tmp_path / "export").exists()


def test_max_shard_size_strings_count_in_powers_of_1000_and_1024() -> None:
    """'5GB' is 5 * 10**9 bytes and '2MiB' 2 * 2**20, as Hugging Face counts them."""
    from accelfn.checkpoint.export import parse_size

    assert (parse_size("5GB"), parse_size("2MiB"), parse_size("500kb"), parse_size(7)) == (5 * 10**9, 2 * 2**20,
                                                                                             500_000, 7)


def test_save_model_of_gpt2_loads_with_from_pretrained(tmp_path: Path) -> None:
    """The GPT-2 example's model, exported in shards with its config, loads with
    transformers' from_pretrained with equal weights and its tied head tied again."""
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("hf_gpt2_export", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example
    try:
        spec.loader.exec_module(example)
        model = example.gpt2(16)
    finally:
        del sys.modules[spec.name]
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    af.save_model(state, tmp_path, max_shard_size="100KB")
    model.config.save_pretrained(tmp_path)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


@pytest.mark.multiprocess
def test_save_model_of_a_sharded_state_holds_its_full_weights(pool: Pools, tmp_path: Path) -> None:
    """Under 2 sharded processes, save_model writes the gathered full weights (in shards of
    300 bytes): they equal the state's full parameters and load strictly into a fresh
    tied model."""
    pool.launch("--nproc-per-node", "2", script="sharded_ckpt.py",
                script_args=("export", "--export", tmp_path / "export", "--out", tmp_path / "full.safetensors"))
    full = safetensors.torch.load_file(tmp_path / "full.safetensors")
    exported = _read_all(tmp_path / "export")
    model = {k.removeprefix("model/"): v for k, v in full.items() if k.startswith("model/")}
    assert sorted(exported) == sorted(model)
    for name, value in model.items():
        assert torch.equal(exported[name], value), name
    fresh = _fresh_tied()
    fresh.load_state_dict(exported, strict=True)
    assert fresh.out.weight is fresh.emb.weight
