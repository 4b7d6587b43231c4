"""Checkpoints on disk: pickle-free, verified, atomic under SIGKILL, strict, tidy."""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import orjson
import pytest
import safetensors
import torch
import xxhash

import accelfn as af
from accelfn.checkpoint._format import PER_RANK, SHARED, Manifest
from accelfn.errors import CheckpointError
from tests.helpers.states import assert_same_state, build, loader, program
from tests.workers.save_child import make_model

# these tests stop the 15-update job of ``states.build`` part-way (``max_steps``) to resume or inspect
# it: the plan of such a run rightly warns that its cosine schedule stops part-way, and that is expected
pytestmark = pytest.mark.filterwarnings(r"ignore:\[scheduler-not-finished\]:accelfn.errors.PlanWarning")

ROOT = Path(__file__).resolve().parents[2]


def _trained(cpu, *transforms: af.Transform, micro_batches: int = 5) -> af.TrainState:
    """A state mid-window (5 micro-batches of accumulate(2)) with AdamW moments and an extra object."""
    step = program(*transforms)
    state, step_fn = cpu.prepare(step, build(0, extra=True))
    for batch, last in list(cpu.batches(loader(), step, 0))[:micro_batches]:
        state, _ = step_fn(state, batch, flush=last)
    state.extra["counter"].seen = 4
    return state


def _forbid_unpickling(monkeypatch) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("a checkpoint must never be unpickled")

    class ForbiddenUnpickler:
        def __init__(self, *args, **kwargs):
            forbidden()

    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", ForbiddenUnpickler)
    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(torch.serialization, "load", forbidden)


def test_load_never_unpickles_and_no_file_is_a_pickle(cpu, tmp_path, monkeypatch) -> None:
    """With pickle.load/loads/Unpickler and torch.load patched to raise, a checkpoint with
    optimizer, scheduler, extra, fp16 loss scale and open-window gradients loads exactly;
    every file is JSON or safetensors (no pickle or torch.save zip)."""
    state = _trained(cpu, af.with_precision("fp16"))
    path = af.save(state, tmp_path / "ckpt")
    _forbid_unpickling(monkeypatch)
    loaded = af.load(path, into=build(99, extra=True))
    assert_same_state(loaded, state)
    assert loaded.extra["counter"].seen == 4
    names = sorted(p.name for p in path.iterdir())
    assert names == ["manifest.json", "manifest.sha256", "model.safetensors", "rank_00000.safetensors",
                     "state.safetensors"]
    for file in path.iterdir():
        head = file.read_bytes()[:2]
        assert head[:1] != b"\x80" and head != b"PK", f"{file.name} looks like a pickle"
        if file.suffix == ".json":
            orjson.loads(file.read_bytes())
        elif file.suffix == ".sha256":
            assert file.read_text() == f"{hashlib.sha256((path / 'manifest.json').read_bytes()).hexdigest()}  " \
                                       "manifest.json\n"
        else:
            with safetensors.safe_open(file, framework="pt") as f:
                assert list(f.keys())


def test_manifest_records_versions_world_and_checksums(cpu, tmp_path) -> None:
    """manifest.json holds the format and library versions, world size, counters, the
    program's transforms when saved by run, and the true xxh3-128 and size of every tensor file
    (no other checksum); manifest.sha256 holds the manifest's own."""
    checkpoints = af.Checkpoints(tmp_path, every_steps=2)
    af.run(program(), build(0), loader(), backend=cpu, epochs=1, max_steps=2, checkpoints=checkpoints, progress=False)
    path = checkpoints.latest()
    manifest = orjson.loads((path / "manifest.json").read_bytes())
    assert manifest["format_version"] == 4
    digest = hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()
    assert (path / "manifest.sha256").read_text() == f"{digest}  manifest.json\n"
    assert manifest["accelfn_version"] == af.__version__ and manifest["torch_version"] == torch.__version__
    assert manifest["world_size"] == 1
    assert manifest["counters"] == {"step": 2, "micro_step": 4, "epoch": 0, "epoch_micro_step": 4}
    assert [t["type"] for t in manifest["transforms"]] == ["ShardData", "Accumulate", "Clip"]
    assert len(manifest["ranks"][0]["rng"]["fields"]["torch_cpu"]) == 2 * 5056
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"group": entry["group"], "num_bytes": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}


def test_every_snapshot_field_is_written() -> None:
    """Every Snapshot field has a place in a checkpoint: shared ones as Manifest fields,
    per-rank ones in each rank's entry (both derived from attrs.fields)."""
    assert set(SHARED) | set(PER_RANK) == {f.name for f in attrs.fields(af.Snapshot)}
    assert set(SHARED) <= {f.name for f in attrs.fields(Manifest)}


@pytest.mark.parametrize("where", ["header length", "header", "first tensor byte", "middle", "last byte"])
@pytest.mark.parametrize("name", ["model.safetensors", "state.safetensors", "rank_00000.safetensors"])
def test_one_flipped_byte_fails_naming_the_file(cpu, tmp_path, name, where) -> None:
    """Flipping one byte anywhere in a tensor file (its header's length, its header, its
    tensors' bytes) makes load fail with a message naming that file, before the target
    state changes."""
    path = af.save(_trained(cpu), tmp_path / "ckpt")
    file = path / name
    data = bytearray(file.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    position = {"header length": 0, "header": header_end // 2, "first tensor byte": header_end,
                "middle": (header_end + len(data)) // 2, "last byte": len(data) - 1}[where]
    data[position] ^= 0x01
    file.write_bytes(bytes(data))
    target = build(99, extra=True)
    before = [p.clone() for p in target.model.parameters()]
    with pytest.raises(CheckpointError) as error:
        af.load(path, into=target)
    digest = "xxh3_128 [0-9a-f]{32}"  # or, for a header that no longer parses, what says so
    found = f"(a safetensors header that does not parse|{digest})" if where.startswith("header") else digest
    assert re.fullmatch(f"{re.escape(str(file))}: {found} does not match the manifest's xxh3_128 [0-9a-f]{{32}}; "
                        "the file is corrupted or was changed after the checkpoint was written", str(error.value))
    assert all(torch.equal(a, b) for a, b in zip(before, target.model.parameters()))


def test_missing_tensor_file_is_named(cpu, tmp_path) -> None:
    """A checkpoint whose tensor file was deleted fails to load, naming the file."""
    path = af.save(_trained(cpu), tmp_path / "ckpt")
    (path / "state.safetensors").unlink()
    with pytest.raises(CheckpointError, match="state.safetensors: the tensor file is missing"):
        af.load(path, into=build(99, extra=True))


def _wait_for_write_to_start(parent: Path, name: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(p.name.startswith(f".{name}.tmp-") for p in parent.iterdir()):
        assert time.monotonic() < deadline, "the save never started"
        time.sleep(0.0005)


def test_sigkill_during_save_leaves_the_old_or_the_new_checkpoint(tmp_path) -> None:
    """A process SIGKILLed at moments spread over a save of a ~100 MB state over an existing
    checkpoint (from the start of the write to past its end) always leaves a checkpoint that
    loads and is entirely the old state or entirely the new one; the next save cleans up."""
    path = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    model = make_model()
    target = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    jitter = random.Random(7)
    outcomes = []
    child = subprocess.Popen([sys.executable, str(ROOT / "tests" / "workers" / "save_child.py"), str(path)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    try:
        for fraction in (0.0, 0.25, 0.5, 0.75, 1.0):
            child.stdin.write("round\n")
            child.stdin.flush()
            ready = child.stdout.readline().split()
            assert ready and ready[0] == "ready", ready
            child.stdin.write("go\n")
            child.stdin.flush()
            saver = child.stdout.readline().split()
            assert saver and saver[0] == "child", saver
            _wait_for_write_to_start(tmp_path, "ckpt")
            time.sleep(float(ready[1]) * fraction * jitter.uniform(0.8, 1.2))
            with contextlib.suppress(ProcessLookupError):  # it finished (and was reaped) first
                os.kill(int(saver[1]), signal.SIGKILL)
            assert child.stdout.readline().split() == ["ended"]  # the saver is gone
            state = af.load(path, into=target)
            values = {float(v) for p in state.model.parameters() for v in p.detach().unique()}
            assert (values, state.step) in (({1.0}, 1), ({2.0}, 2)), (fraction, values, state.step)
            outcomes.append(state.step)
    finally:
        child.stdin.close()
        child.wait(timeout=60)
        child.stdout.close()
    af.save(target, path)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert outcomes[0] == 1  # killed as the write began: the old checkpoint


def test_tied_weights_are_stored_once_and_stay_tied(tmp_path) -> None:
    """An embedding tied to the output layer is one tensor in model.safetensors, referenced by
    both names, and after loading into a fresh tied model both are the same tensor with the
    saved values."""

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    torch.manual_seed(0)
    source = Tied()
    state = af.TrainState.create(source, torch.optim.AdamW(source.parameters()))
    path = af.save(state, tmp_path / "ckpt")
    with safetensors.safe_open(path / "model.safetensors", framework="pt") as f:
        assert list(f.keys()) == ["embed.weight"]
    manifest = orjson.loads((path / "manifest.json").read_bytes())
    assert manifest["model"] == {"embed.weight": {"__tensor__": "embed.weight"},
                                 "head.weight": {"__tensor__": "embed.weight"}}
    torch.manual_seed(1)
    target = Tied()
    af.load(path, into=af.TrainState.create(target, torch.optim.AdamW(target.parameters())))
    assert target.head.weight is target.embed.weight
    assert torch.equal(target.embed.weight, source.embed.weight)


def test_loading_into_another_model_names_keys_shapes_and_dtypes(tmp_path) -> None:
    """Loading into a different architecture fails with the checkpoint path and every
    missing, unexpected, shape- and dtype-mismatched key."""
    path = af.save(build(0), tmp_path / "ckpt")
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"fc1": torch.nn.Linear(6, 16).double(), "fc2": torch.nn.Linear(16, 4),
                                 "extra": torch.nn.Linear(1, 1)})
    target = af.TrainState.create(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(CheckpointError) as error:
        af.load(path, into=target)
    message = str(error.value)
    assert str(path) in message
    assert "missing from the checkpoint (2): extra.weight, extra.bias" in message
    assert "model 'fc1.weight': dtype torch.float32 in the checkpoint, torch.float64 here" in message
    assert "model 'fc2.weight': shape (3, 16) in the checkpoint, (4, 16) here" in message
    assert "optimizer: parameter groups of sizes [4] in the checkpoint, [6] here" in message


def test_save_refuses_to_replace_a_directory_it_did_not_write(tmp_path) -> None:
    """Saving onto a non-empty directory that is not a checkpoint raises and keeps its files."""
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="is not an accelfn checkpoint; refusing to replace it"):
        af.save(build(0), tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"


def test_interrupted_replace_is_found_and_completed(tmp_path) -> None:
    """After a crash between the two renames of a replace (target gone, new and old set aside),
    load finds the new checkpoint, and the next save completes and tidies the directory."""
    old, new = build(0).replace(step=1, micro_step=1), build(5).replace(step=2, micro_step=2)
    af.save(old, tmp_path / "a")
    af.save(new, tmp_path / "b")
    (tmp_path / "a").rename(tmp_path / ".ckpt.old-0123456789abcdef")
    (tmp_path / "b").rename(tmp_path / ".ckpt.tmp-fedcba9876543210")
    assert af.load(tmp_path / "ckpt", into=build(9)).step == 2
    af.save(build(7).replace(step=3, micro_step=3), tmp_path / "ckpt")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert af.load(tmp_path / "ckpt", into=build(9)).step == 3


def test_unfinished_writes_are_ignored_and_cleaned_up(cpu, tmp_path) -> None:
    """A half-written checkpoint (no manifest) is neither loaded nor listed; Checkpoints
    removes it with the next save."""
    checkpoints = af.Checkpoints(tmp_path, every_steps=1)
    af.run(program(), build(0), loader(), backend=cpu, epochs=1, max_steps=1, checkpoints=checkpoints,
           progress=False)
    (tmp_path / ".step_00000009.tmp-0123456789abcdef").mkdir()
    (tmp_path / ".step_00000009.tmp-0123456789abcdef" / "model.safetensors").write_bytes(b"partial")
    (tmp_path / "step_00000007").mkdir()  # a bare directory: no manifest, not a checkpoint
    assert checkpoints.steps() == [1]
    with pytest.raises(CheckpointError, match="no manifest.json"):
        af.load(tmp_path / "step_00000007", into=build(0))
    checkpoints.save(build(0).replace(step=2, micro_step=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000002", "step_00000007"]


def test_run_arguments_are_checked_before_the_state_is_touched(cpu, tmp_path) -> None:
    """Bad checkpoints/resume arguments raise before the program is prepared: no transform
    state is added and no parameter moves."""
    state = build(0)
    step = program(af.with_precision("fp16"))
    with pytest.raises(ValueError, match="resume='auto'.*checkpoints="):
        af.run(step, state, loader(), backend=cpu, resume="auto")
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*pass checkpoints=af\.Checkpoints\(directory\) "
                                              r"and resume='auto'\)$"):
        af.run(step, state, loader(), backend=cpu, resume=tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*pass resume='auto'\)$"):
        af.run(step, state, loader(), backend=cpu, resume=tmp_path / "nowhere",
               checkpoints=af.Checkpoints(tmp_path / "ckpt"))
    with pytest.raises(TypeError, match="af.Checkpoints"):
        af.run(step, state, loader(), backend=cpu, checkpoints=str(tmp_path))
    with pytest.raises(TypeError, match="'auto' or the path"):
        af.run(step, state, loader(), backend=cpu, resume=7)
    assert "loss_scale" not in state.transforms_state


def test_resuming_with_other_transforms_warns(cpu, tmp_path) -> None:
    """Resuming a checkpoint written by a program with other transforms warns, naming both."""
    checkpoints = af.Checkpoints(tmp_path, every_steps=1)
    af.run(program(), build(0), loader(), backend=cpu, max_steps=1, checkpoints=checkpoints, progress=False)
    other = af.compose(af.shard_data(seed=3), af.accumulate(4))(af.train_step(program().loss_fn))
    with pytest.warns(UserWarning, match="'num_micro_batches': 2.*'num_micro_batches': 4"):
        af.run(other, build(0), loader(), backend=cpu, max_steps=2, checkpoints=checkpoints, resume="auto",
               progress=False)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"every_steps": 0}, ValueError, r"every_steps=0\): must be >= 1"),
    ({"every_steps": 2.5}, TypeError, "every_steps=...\\) must be an int"),
    ({"every_seconds": -1.0}, ValueError, "finite number > 0"),
    ({"keep": True}, TypeError, "keep=...\\) must be an int"),
])
def test_checkpoints_arguments_are_validated(tmp_path, kwargs, error, match) -> None:
    """Checkpoints() rejects counts out of range or of the wrong type, naming the argument."""
    with pytest.raises(error, match=match):
        af.Checkpoints(tmp_path, **kwargs)


@pytest.mark.parametrize(("every_seconds", "expected"), [(1e-6, [1, 2, 3, 4, 5]), (3600.0, [])])
def test_every_seconds_saves_when_a_new_period_began(cpu, tmp_path, every_seconds, expected) -> None:
    """Checkpoints(every_seconds=s) saves after an update only if a new period of s seconds
    began since the last save: after every update for a microsecond, never within an hour."""
    checkpoints = af.Checkpoints(tmp_path, every_seconds=every_seconds)
    af.run(program(), build(0), loader(), backend=cpu, epochs=1, checkpoints=checkpoints, progress=False)
    assert checkpoints.steps() == expected
