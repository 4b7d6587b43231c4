"""Sharded (FSDP2) checkpoints: DCP files in safetensors, bitwise resume, resharding, no pickle.

The sharded runs are 2 gloo processes of the session's worker pool (``tests/helpers/pool.py``),
or 3 of the pool of 3 (the 60 s one other modules use too); the SIGTERM test's is a real
``accelfn launch`` job; their states are
built by ``tests.helpers.sharding`` (``shard`` is FSDP2 ``fully_shard`` per block, then the
root). One module fixture runs the jobs the tests share.
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import accelfn as af
from tests.helpers import launch as _launch
from tests.helpers.corrupt import Files, Mutation, header_edits, signed
from tests.helpers.pool import Pools
from tests.helpers.sharding import assert_same, build, full_state, loader, program

pytestmark = pytest.mark.multiprocess
WORKER = "sharded_ckpt.py"
SHARDS = ("dcp/shard-00001-model-00001-of-00001.safetensors", "dcp/shard-00002-model-00001-of-00001.safetensors")
#: the files of the frozen parameter (the model's embedding, ``helpers.sharding.build``)
FROZEN = tuple(name.replace("dcp/", "dcp-frozen/") for name in SHARDS)


THREE = ("--backend", "cpu", "--nproc-per-node", "3", "--timeout-s", "60")


def _launch_worker(pool: Pools, nproc: int, *args: object) -> None:
    """The worker on ``nproc`` processes (2 or 3), in the pool of as many."""
    pool.launch(*(THREE if nproc == 3 else ("--nproc-per-node", str(nproc))), script=WORKER, script_args=args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, pool: Pools) -> Path:
    """2 sharded processes: ``full.safetensors`` of 10 uninterrupted updates (2 epochs);
    ``stopped.safetensors`` of a run stopped after 3 updates (mid-epoch), with its checkpoint
    ``checkpoints/step_00000003``; ``resumed.safetensors`` of that run resumed to the end,
    saving every 3 updates and keeping 2."""
    out = tmp_path_factory.mktemp("sharded")
    _launch_worker(pool, 2, "train", "--out", out / "full.safetensors")
    common = ("--checkpoints", out / "checkpoints", "--every-steps", 3, "--keep", 2)
    _launch_worker(pool, 2, "train", "--out", out / "stopped.safetensors", "--max-steps", 3, *common)
    shutil.copytree(out / "checkpoints" / "step_00000003", out / "step3")
    _launch_worker(pool, 2, "train", "--out", out / "resumed.safetensors", "--resume", "auto", *common)
    return out


def test_sigterm_saves_a_sharded_checkpoint_and_the_restarted_job_ends_bitwise(runs: Path, tmp_path: Path) -> None:
    """SIGTERM to rank 1 mid-epoch (in its 4th micro-batch) makes both sharded processes save
    one checkpoint and stop; restarted by accelfn launch --max-restarts 1, the job resumes from it and ends
    bitwise like the uninterrupted run."""
    done = _launch.launch("--nproc-per-node", "2", "--max-restarts", "1", script=WORKER, check=False, script_args=(
        "train", "--out", tmp_path / "done.safetensors", "--checkpoints", tmp_path / "checkpoints",
        "--every-steps", 100, "--resume", "auto", "--sigterm", "1:4"))
    _launch.assert_ok(done)
    assert "SIGTERM received; saved" in done.stderr
    assert af.Checkpoints(tmp_path / "checkpoints").steps() == [5]  # the ranks agree one update later
    assert_same(safetensors.torch.load_file(tmp_path / "done.safetensors"),
                safetensors.torch.load_file(runs / "full.safetensors"))


def test_asynchronous_checkpoints_of_a_sharded_state_are_the_synchronous_ones(pool: Pools, runs: Path,
                                                                              tmp_path: Path) -> None:
    """Checkpoints(asynchronous=True) writes a sharded state synchronously (every rank writes its
    own shards): stopped after 3 updates, the run leaves a checkpoint with bitwise the tensors
    of each rank's shard file and the counters of the one the synchronous run wrote at that
    step (DCP orders its metadata in the headers at random, so the bytes differ)."""
    _launch_worker(pool, 2, "train", "--out", tmp_path / "stopped.safetensors", "--max-steps", 3, "--checkpoints",
                   tmp_path / "checkpoints", "--every-steps", 3, "--asynchronous")
    written = tmp_path / "checkpoints" / "step_00000003"
    for name in (*SHARDS, *FROZEN):
        assert_same(safetensors.torch.load_file(written / name), safetensors.torch.load_file(runs / "step3" / name))
    assert (json.loads((written / "manifest.json").read_bytes())["counters"]
            == json.loads((runs / "step3" / "manifest.json").read_bytes())["counters"])


def test_a_snapshot_of_a_sharded_state_restores_it_in_memory(pool: Pools, tmp_path: Path) -> None:
    """af.snapshot of a sharded state after 2 updates, restored after 2 more, gives back bitwise
    the state it took (parameters, optimizer state, counters), and training on from it repeats
    updates 3 and 4 bitwise."""
    _launch_worker(pool, 2, "snapshot", "--out", tmp_path / "snap.safetensors")
    tensors = safetensors.torch.load_file(tmp_path / "snap.safetensors")

    def part(prefix: str) -> dict[str, torch.Tensor]:
        return {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}

    assert_same(part("restored/"), part("at_snapshot/"))
    assert_same(part("again/"), part("first/"))
    assert not all(torch.equal(v, part("first/")[k]) for k, v in part("at_snapshot/").items())


def test_a_window_fsdp_holds_unsharded_resumes_bitwise_on_as_many_processes(pool: Pools, tmp_path: Path) -> None:
    """Saved after a micro-batch that skipped FSDP2's reduce-scatter, each rank's unsharded
    window gradients are kept in its own file; loaded into fresh sharded states, the window
    ends bitwise like the uninterrupted one, and one process refuses the checkpoint."""
    _launch_worker(pool, 2, "window", "--save", tmp_path / "mid", "--out", tmp_path / "window.safetensors")
    tensors = safetensors.torch.load_file(tmp_path / "window.safetensors")
    whole = {k.removeprefix("whole/"): v for k, v in tensors.items() if k.startswith("whole/")}
    assert_same({k.removeprefix("resumed/"): v for k, v in tensors.items() if k.startswith("resumed/")}, whole)
    manifest = json.loads((tmp_path / "mid" / "manifest.json").read_bytes())
    used = sorted(set(build(sharded=False).model.state_dict()) - {"emb.weight"})  # the untied embedding is unused
    assert [sorted(rank["grads"]) for rank in manifest["ranks"]] == [used, used]
    assert sorted(manifest["files"]) == sorted([*SHARDS, *FROZEN, "rank_00000.safetensors", "rank_00001.safetensors"])
    with pytest.raises(af.CheckpointError, match="saved by 2 processes in the middle of an accumulation window"):
        af.load(tmp_path / "mid", into=build(sharded=False))


def test_a_rank_failing_to_write_its_shards_leaves_the_old_checkpoint(pool: Pools, runs: Path, tmp_path: Path) -> None:
    """When rank 1 cannot write its shards (disk full) while replacing a checkpoint, both
    ranks raise a CheckpointError naming rank 1 and its error, the old checkpoint is
    untouched and no temporary directory is left."""
    shutil.copytree(runs / "step3", tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").rglob("*") if p.is_file()}
    _launch_worker(pool, 2, "fail", "--load", tmp_path / "ckpt", "--out", tmp_path / "unused.safetensors")
    for rank in (0, 1):
        assert (tmp_path / f"error{rank}.txt").read_text() == (
            f"{tmp_path / 'ckpt'}: a rank failed to write its shards: rank 1: OSError: [Errno 28] No space left "
            "on device" if rank == 0 else
            f"{tmp_path / 'ckpt'}: the checkpoint was not written: rank 1: OSError: [Errno 28] No space left on device")
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "error0.txt", "error1.txt"]


def _refuse_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("something was unpickled while loading a checkpoint")

    for name in ("load", "loads"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)


def test_a_sharded_run_resumed_on_two_processes_is_bitwise_the_uninterrupted_run(runs: Path) -> None:
    """Saved mid-epoch by 2 sharded processes and resumed by 2, a run ends with bitwise the
    parameters, optimizer state and counters of the uninterrupted run; keep=2 leaves the last two."""
    resumed = safetensors.torch.load_file(runs / "resumed.safetensors")
    assert_same(resumed, safetensors.torch.load_file(runs / "full.safetensors"))
    assert resumed["counters"].tolist() == [10, 10, 2, 0]
    assert af.Checkpoints(runs / "checkpoints").steps() == [6, 9]


def test_each_rank_writes_its_own_safetensors_file_and_no_file_is_a_pickle(runs: Path) -> None:
    """A sharded checkpoint is a JSON manifest, its sha256 line and one DCP safetensors file per
    rank in dcp/ and one in dcp-frozen/ (the frozen embedding, apart): every file parses as JSON, a sha256 line or safetensors, none starts as a pickle or
    a torch.save archive does, and DCP's pickled ``.metadata`` is absent."""
    files = sorted(str(p.relative_to(runs / "step3")) for p in (runs / "step3").rglob("*") if p.is_file())
    assert files == sorted([*SHARDS, *FROZEN, "manifest.json", "manifest.sha256"])
    for name in files:
        data = (runs / "step3" / name).read_bytes()
        assert not data.startswith(b"\x80") and not data.startswith(b"PK\x03\x04"), name  # pickle PROTO, zip
        if name.endswith(".json"):
            manifest = json.loads(data)
        elif name.endswith(".sha256"):
            assert data.decode().endswith("  manifest.json\n")
        else:
            (length,) = struct.unpack("<Q", data[:8])
            header = json.loads(data[8:8 + length])
            ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
            assert 8 + length + max(ends) == len(data), name  # nothing but the tensors after the header
    assert manifest["world_size"] == 2 and manifest["format_version"] == 7
    assert sorted(manifest["files"]) == sorted([*SHARDS, *FROZEN])
    assert "blocks.0.weight" in manifest["sharded"]["model"] and "emb.weight" not in manifest["sharded"]["model"]
    assert list(manifest["sharded"]["frozen"]["model"]) == ["emb.weight"]


def test_a_sharded_checkpoint_loads_into_one_unsharded_process_with_the_same_full_state(
        runs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loaded into one unsharded process (nothing unpickled), the checkpoint of 2 sharded
    processes gives bitwise the full parameters, optimizer state and counters they saved."""
    _refuse_unpickling(monkeypatch)
    state = af.load(runs / "step3", into=build(sharded=False))
    assert_same(full_state(state), safetensors.torch.load_file(runs / "stopped.safetensors"))
    assert state.scheduler.last_epoch == 3


def test_an_unsharded_checkpoint_loads_into_two_sharded_processes(pool: Pools, tmp_path: Path) -> None:
    """A checkpoint of one unsharded process loads into 2 sharded processes (pickle refused
    there) with bitwise its full parameters, optimizer state and counters."""
    with pytest.warns(af.PlanWarning, match=r"^\[shard-params-one-process\]"):  # trained unsharded, as said
        state = af.run(program(), build(sharded=False), loader(), backend=af.backends.CPU(af.backends.LaunchEnv()),
                       epochs=1, max_steps=4, progress=False)
    af.save(state, tmp_path / "unsharded")
    _launch_worker(pool, 2, "load", "--load", tmp_path / "unsharded", "--out", tmp_path / "loaded.safetensors")
    assert_same(safetensors.torch.load_file(tmp_path / "loaded.safetensors"), full_state(state))


def test_a_checkpoint_of_two_sharded_processes_loads_into_three(pool: Pools, runs: Path, tmp_path: Path) -> None:
    """Resharding: 3 sharded processes load the checkpoint 2 wrote (other shard boundaries,
    an empty shard) with bitwise the full state saved, and save it again in 3 shards."""
    _launch_worker(pool, 3, "load", "--load", runs / "step3", "--out", tmp_path / "loaded.safetensors",
                   "--save", tmp_path / "again")
    assert_same(safetensors.torch.load_file(tmp_path / "loaded.safetensors"),
                safetensors.torch.load_file(runs / "stopped.safetensors"))
    assert len(list((tmp_path / "again" / "dcp").iterdir())) == 3
    assert_same(full_state(af.load(tmp_path / "again", into=build(sharded=False))),
                safetensors.torch.load_file(runs / "stopped.safetensors"))


def _flipped(source: Path, target: Path, name: str) -> Path:
    shutil.copytree(source, target)
    path = target / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("name", [*SHARDS, *FROZEN])
def test_a_flipped_byte_in_any_shard_file_is_refused_naming_the_file(runs: Path, tmp_path: Path, name: str) -> None:
    """One flipped bit in a rank's shard file: load refuses, naming the file and its
    checksum mismatch, before anything in the state changed."""
    path = _flipped(runs / "step3", tmp_path / "ckpt", name)
    state = build(sharded=False)
    before = full_state(state)
    with pytest.raises(af.CheckpointError, match=rf"^{path}: xxh3_128 [0-9a-f]{{32}} does not match the manifest's"):
        af.load(tmp_path / "ckpt", into=state)
    assert_same(full_state(state), before)


def test_every_rank_refuses_a_shard_file_another_rank_verified(pool: Pools, runs: Path, tmp_path: Path) -> None:
    """The ranks split the checksum work; a corrupted file that rank 1 verified is refused by
    both ranks, each naming it."""
    path = _flipped(runs / "step3", tmp_path / "ckpt", SHARDS[1])
    _launch_worker(pool, 2, "load", "--load", tmp_path / "ckpt", "--out", tmp_path / "loaded.safetensors")
    for rank in (0, 1):
        assert (tmp_path / f"error{rank}.txt").read_text().startswith(f"{path}: xxh3_128 ")
    assert not (tmp_path / "loaded.safetensors").exists()


def test_a_sharded_checkpoint_that_does_not_fit_the_state_is_refused_before_anything_changes(runs: Path) -> None:
    """Checked against the manifest's record of global shapes before DCP reads anything: a
    model with a wider first layer gets every differing shape named, and keeps its values."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"inp": torch.nn.Linear(7, 8)})
    state = af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(af.CheckpointError) as refused:
        af.load(runs / "step3", into=state)
    message = str(refused.value)
    assert message.startswith(f"{runs / 'step3'}: the checkpoint does not match the state it is loaded into:")
    assert "model: unexpected in the checkpoint (11): blocks.0.weight, blocks.0.bias, blocks.1.weight" in message
    assert "model 'inp.weight': shape (8, 6) in the checkpoint, (8, 7) here" in message
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize("folder", ["dcp", "dcp-frozen"])
def test_a_file_in_dcp_the_manifest_does_not_list_is_refused(runs: Path, tmp_path: Path, folder: str) -> None:
    """DCP's reader reads every safetensors file in ``dcp/`` (and ``dcp-frozen/``), so one the
    manifest does not list (a leftover, a planted file) is refused by name."""
    shutil.copytree(runs / "step3", tmp_path / "ckpt")
    shutil.copy(tmp_path / "ckpt" / SHARDS[0], tmp_path / "ckpt" / folder / "shard-00003-model-00001-of-00001.safetensors")
    with pytest.raises(af.CheckpointError, match=rf"{tmp_path / 'ckpt' / folder}: files the manifest does not list: "
                                                 r"shard-00003-model-00001-of-00001\.safetensors;"):
        af.load(tmp_path / "ckpt", into=build(sharded=False))


def _table_edits(files: Files) -> list[Mutation]:
    """Every edit of a tensor in the manifest's sharded tables (the frozen one's too): its shape
    with another dimension, reversed, of one element made ``[1, 1, 1, 1, 1]`` or negative,
    another dtype, one torch does not know, a key unknown, the entry gone; and of the frozen
    table's checksums and algorithm; the checksum recomputed."""
    manifest = json.loads(files["manifest.json"])
    entries = [("model", k) for k in manifest["sharded"]["model"]]
    entries += [("frozen", "model", k) for k in manifest["sharded"]["frozen"]["model"]]
    entries += [("optimizer", p, k) for p, states in manifest["sharded"]["optimizer"].items() for k in states]
    edits = []
    for where in entries:
        meta = manifest["sharded"]
        for key in where:
            meta = meta[key]
        shapes = [meta["shape"] + [1], meta["shape"][::-1], [1] * 5 if not meta["shape"] else [-1] + meta["shape"][1:]]
        changes: list[tuple[str, Any]] = [("shape", s) for s in shapes if s != meta["shape"]]
        changes += [("dtype", "float64"), ("dtype", "int32"), ("dtype", "nonsense"), ("zz", 1), ("delete", None)]
        for field, value in changes:
            edited = json.loads(files["manifest.json"])
            node = edited["sharded"]
            for key in where[:-1]:
                node = node[key]
            if field == "delete":
                del node[where[-1]]
            else:
                node[where[-1]][field] = value
            edits.append((f"sharded.{'.'.join(where)} {field} {value!r}",
                          signed(files, {"manifest.json": json.dumps(edited).encode()})))
    frozen_edits: list[tuple[str, Any]] = [
        ("checksums", ["zz", "0"]), ("checksums", ["0"]), ("checksums", "0"), ("checksums", [1, 2]),
        ("algorithm", "md5"), ("algorithm", None), ("zz", 1), ("model", []), ("delete", None)]
    for field, value in frozen_edits:
        edited = json.loads(files["manifest.json"])
        if field == "delete":
            del edited["sharded"]["frozen"]
        else:
            edited["sharded"]["frozen"][field] = value
        edits.append((f"sharded.frozen {field} {value!r}", signed(files, {"manifest.json": json.dumps(edited).encode()})))
    return edits


def _tensors(state: af.TrainState) -> dict[str, Any]:
    """Copies of the model's tensors, the optimizer's state and param groups, and the counters."""
    optimizer = state.optimizer.state_dict()
    return {"model": {k: v.clone() for k, v in state.model.state_dict().items()},
            "state": {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
                      for i, entry in optimizer["state"].items()},
            "groups": optimizer["param_groups"], "counters": (state.step, state.micro_step, state.epoch)}


def _same_tensors(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def same(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        return x == y

    return same(a, b)


def test_corrupted_sharded_checkpoints_are_refused_and_change_nothing(runs: Path, tmp_path: Path) -> None:
    """90 seeded corruptions of a sharded checkpoint (the headers of its DCP files, dcp-frozen/'s
    too, edited; its manifest's sharded tables edited, checksums recomputed) loaded into one unsharded process:
    each raises a CheckpointError before the state changes, or loads exactly the saved state;
    DCP never reads a chunk the manifest does not place as it says."""
    path = tmp_path / "ckpt"
    shutil.copytree(runs / "step3", path)
    files = {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}
    rng = random.Random(7)
    tables = _table_edits(files)
    frozen = [edit for edit in tables if edit[0].startswith("sharded.frozen")]
    mutations = [*header_edits(rng, files, sorted(SHARDS), 30), *header_edits(rng, files, sorted(FROZEN), 20),
                 *rng.sample([edit for edit in tables if edit not in frozen], 30), *frozen]
    expected = safetensors.torch.load_file(runs / "stopped.safetensors")
    wrong = []
    for what, changed in mutations:
        for name, data in changed.items():
            (path / name).write_bytes(data)
        state = build(sharded=False)
        before = _tensors(state)
        try:
            loaded = af.load(path, into=state)
        except af.CheckpointError:
            if not _same_tensors(_tensors(state), before):
                wrong.append(f"{what}: the failed load changed the state")
        except Exception as e:  # nothing but CheckpointError
            wrong.append(f"{what}: {type(e).__name__}: {e}")
        else:
            now = full_state(loaded)
            if sorted(now) != sorted(expected) or any(not torch.equal(now[k], expected[k]) for k in expected):
                wrong.append(f"{what}: loaded a state other than the saved one")
        finally:
            for name in changed:
                (path / name).write_bytes(files[name])
    assert not wrong, "\n".join(wrong)
