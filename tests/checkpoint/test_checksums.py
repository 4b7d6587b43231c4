"""Checksums of tensor files: written in the pass that writes the file, verified in the pass
that reads it; XXH3-128 by default, sha256 without ``xxhash`` and in older checkpoints."""

from __future__ import annotations

import hashlib

import orjson
import pytest
import safetensors.torch
import torch
import xxhash

import accelfn as af
from accelfn.checkpoint import _tensorfiles
from accelfn.errors import CheckpointError
from tests.helpers.states import assert_same_state, build, loader, program

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2]


def _trained(cpu) -> af.TrainState:
    step = program()
    state, step_fn = cpu.prepare(step, build(0))
    for batch, last in list(cpu.batches(loader(), step, 0))[:4]:
        state, _ = step_fn(state, batch, flush=last)
    return state


def _resign(path) -> None:
    """Writes manifest.sha256 anew after an edit of manifest.json."""
    digest = hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()
    (path / "manifest.sha256").write_text(f"{digest}  manifest.json\n")


def test_the_hashed_writer_writes_safetensors_files_of_every_dtype_with_the_files_checksum(tmp_path) -> None:
    """A file streamed by the hashed writer loads with safetensors to the same tensors (every
    dtype, scalars, empty and non-contiguous tensors), and the checksum it returns, computed
    while writing, is the XXH3-128 of the file's bytes; reading it back verifies."""
    torch.manual_seed(0)
    tensors = {}
    for i, dtype in enumerate(DTYPES):
        tensors[f"t{i}"] = (torch.randn(5, 3) * 10).to(dtype)
        tensors[f"s{i}"] = torch.ones((), dtype=dtype)
        tensors[f"e{i}"] = torch.empty(0, 4, dtype=dtype)
    tensors["transposed"] = torch.randn(4, 6).t()
    digest, num_bytes = _tensorfiles.write_file(tmp_path / "f.safetensors", tensors, "xxh3_128")
    data = (tmp_path / "f.safetensors").read_bytes()
    assert (digest, num_bytes) == (xxhash.xxh3_128(data).hexdigest(), len(data))
    for read in (safetensors.torch.load_file(tmp_path / "f.safetensors"),
                 _tensorfiles.read_file(tmp_path / "f.safetensors", "xxh3_128", digest, num_bytes)):
        assert read.keys() == tensors.keys()
        for key, t in tensors.items():
            assert read[key].dtype == t.dtype and read[key].shape == t.shape, key
            assert torch.equal(read[key].reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8))


def test_without_xxhash_checkpoints_are_checked_with_sha256_and_load(cpu, tmp_path, monkeypatch) -> None:
    """Where xxhash is not installed, every tensor file's entry holds the sha256 of the file
    (and no other checksum), and the checkpoint loads to the saved state."""
    state = _trained(cpu)
    monkeypatch.setattr(_tensorfiles, "xxhash", None)
    af.save(state, tmp_path / "ckpt")
    manifest = orjson.loads((tmp_path / "ckpt" / "manifest.json").read_bytes())
    assert manifest["format_version"] == 4
    for name, entry in manifest["files"].items():
        data = (tmp_path / "ckpt" / name).read_bytes()
        assert entry == {"group": entry["group"], "num_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert_same_state(af.load(tmp_path / "ckpt", into=build(9)), state)


def test_an_xxh3_checkpoint_without_xxhash_says_what_to_install(cpu, tmp_path, monkeypatch) -> None:
    """Loading an XXH3-checked checkpoint where xxhash is not installed fails saying so."""
    af.save(_trained(cpu), tmp_path / "ckpt")
    monkeypatch.setattr(_tensorfiles, "xxhash", None)
    with pytest.raises(CheckpointError, match=r"this checkpoint's files are checked with xxh3_128, which needs the "
                                              r"xxhash package \(a dependency of accelfn\): pip install xxhash"):
        af.load(tmp_path / "ckpt", into=build(9))


@pytest.mark.parametrize("checksums", [{}, {"xxh3_128": "0" * 32, "sha256": "0" * 64}])
def test_a_file_entry_needs_exactly_one_checksum(cpu, tmp_path, checksums) -> None:
    """A manifest whose file entry has no checksum, or two, is refused, naming the entry."""
    path = af.save(_trained(cpu), tmp_path / "ckpt")
    manifest = orjson.loads((path / "manifest.json").read_bytes())
    entry = manifest["files"]["model.safetensors"]
    manifest["files"]["model.safetensors"] = {"group": entry["group"], "num_bytes": entry["num_bytes"], **checksums}
    (path / "manifest.json").write_bytes(orjson.dumps(manifest))
    _resign(path)
    with pytest.raises(CheckpointError, match=r"manifest.json: files.model.safetensors must have exactly one "
                                              r"checksum \(xxh3_128 or sha256\); the manifest is inconsistent"):
        af.load(path, into=build(9))


def test_load_copies_into_the_optimizers_own_tensors(cpu, tmp_path) -> None:
    """Loading into a state whose optimizer already has its moments copies the checkpoint's
    values into those very tensors (no fresh memory) and into the parameters."""
    path = af.save(_trained(cpu), tmp_path / "ckpt")
    target = _trained(cpu)
    moments = {(p, key): t for p, entry in target.optimizer.state.items() for key, t in entry.items()}
    for t in moments.values():
        t.add_(1)  # other values in the same tensors
    loaded = af.load(path, into=target)
    assert_same_state(loaded, _trained(cpu))
    assert {(p, key) for p, entry in loaded.optimizer.state.items() for key in entry} == moments.keys()
    assert all(loaded.optimizer.state[p][key] is t for (p, key), t in moments.items())


def _file(header: dict, data: bytes, *, pad: bool = True) -> bytes:
    text = orjson.dumps(header)
    text += b" " * (-len(text) % 8 if pad else 0)
    return len(text).to_bytes(8, "little") + text + data


GOOD = {"__metadata__": {"format": "pt"}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "I16", "shape": [2, 1], "data_offsets": [8, 12]}}


@pytest.mark.parametrize("damage", ["gap", "overlap", "size", "dtype", "shape", "trailing byte", "short data",
                                    "header length", "not an object", "offsets"])
def test_a_header_that_does_not_describe_its_file_is_refused_even_when_the_checksum_matches(tmp_path, damage) -> None:
    """The reader checks a header as safetensors' own reader does: known dtypes, shapes of
    ints >= 0, byte ranges that fit their shapes and tile the data exactly. A file that
    fails (here written with the checksum the manifest would hold, so only the header can
    refuse it) is "a safetensors header that does not parse"; the undamaged file reads."""
    data = bytes(range(12))
    header = orjson.loads(orjson.dumps(GOOD))
    if damage == "gap":
        header["b"]["data_offsets"] = [10, 14]
        data += b"\0\0"
    elif damage == "overlap":
        header["b"]["data_offsets"] = [6, 10]
    elif damage == "size":
        header["a"]["shape"] = [3]
    elif damage == "dtype":
        header["a"]["dtype"] = "F33"
    elif damage == "shape":
        header["b"]["shape"] = [-2, -1]
    elif damage == "trailing byte":
        data += b"\0"
    elif damage == "short data":
        data = data[:-1]
    elif damage == "not an object":
        header = [header]
    elif damage == "offsets":
        header["a"]["data_offsets"] = [0]
    blob = _file(header, data)
    if damage == "header length":
        blob = (len(blob)).to_bytes(8, "little") + blob[8:]
    path = tmp_path / "f.safetensors"
    path.write_bytes(blob)
    with pytest.raises(CheckpointError, match="a safetensors header that does not parse"):
        _tensorfiles.read_file(path, "xxh3_128", xxhash.xxh3_128(blob).hexdigest(), len(blob))
    good = _file(GOOD, bytes(range(12)))
    path.write_bytes(good)
    read = _tensorfiles.read_file(path, "xxh3_128", xxhash.xxh3_128(good).hexdigest(), len(good))
    assert torch.equal(read["a"], torch.frombuffer(bytearray(range(8)), dtype=torch.float32))
    assert torch.equal(read["b"], torch.tensor([[8 + 9 * 256], [10 + 11 * 256]], dtype=torch.int16))


def test_a_file_safetensors_wrote_reads_to_its_tensors_and_writing_them_leaves_the_file_as_it_was(tmp_path) -> None:
    """A file written by ``safetensors.torch.save_file`` (metadata, its own layout) reads to
    the same tensors; they map the file copy-on-write, so writing into one changes neither
    the file nor a second read of it."""
    tensors = {"w": torch.randn(3, 4), "i": torch.arange(5), "h": torch.randn(7).half(), "s": torch.tensor(2.5)}
    path = tmp_path / "f.safetensors"
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
    blob = path.read_bytes()
    digest = xxhash.xxh3_128(blob).hexdigest()
    read = _tensorfiles.read_file(path, "xxh3_128", digest, len(blob))
    assert read.keys() == tensors.keys() and all(torch.equal(read[k], v) for k, v in tensors.items())
    read["w"].fill_(0)
    assert path.read_bytes() == blob
    assert torch.equal(_tensorfiles.read_file(path, "xxh3_128", digest, len(blob))["w"], tensors["w"])
