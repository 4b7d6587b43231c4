"""``af.invariant()``: the same run, bit for bit, on 1, 2, 4 and 8 processes (and 1 vs 3 vs 2).

Module fixtures train every variant once per topology (in this process, in the worker pools'
jobs of 2 and 4 processes, and in one real launch of 8 processes: their subject is the
training, not the launch) and the tests compare the hashes of the whole state after every
update (tests/workers/invariant.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import accelfn as af
from accelfn.checkpoint._codec import Encoder, decode
from accelfn.data.blocks import block_indices, block_loader
from accelfn.distributed.canonical import blocks
from accelfn.transforms.invariant import Layout, Node, TreeWindow, fold, push
from tests.helpers import launch as _launch
from tests.helpers.pool import Pools
from tests.workers import invariant as worker

POOL = ("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60")  # the pools other modules use too
POOL4 = ("--backend", "cpu", "--nproc-per-node", "4", "--timeout-s", "60")
POOL3 = ("--backend", "cpu", "--nproc-per-node", "3", "--timeout-s", "60")


def _read(out: Path, name: str) -> Any:
    return json.loads((out / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("invariant")


def _out(root: Path, name: str) -> Path:
    out = root / name
    out.mkdir(exist_ok=True)
    return out


@pytest.fixture(scope="module")
def one(root: Path) -> Path:
    """Every variant on 1 x acc(8), in this process."""
    out = _out(root, "w1")
    worker.train(str(out))
    return out


@pytest.fixture(scope="module")
def two(pool: Pools, root: Path) -> Path:
    """Every variant on 2 x acc(4) (the pool's workers), and the AdamW and sharded variants
    killed at update 14 (of epoch 0), micro-batch 2 of its window (saved to w2/first and
    w2/sharded_first)."""
    out = _out(root, "w2")
    pool.call(*POOL, function="invariant:train", out=str(out), timeout_s=280)
    pool.call(*POOL, function="invariant:segment", out=str(out), name="first", stop=[14, 2], timeout_s=120)
    pool.call(*POOL, function="invariant:segment", out=str(out), name="sharded_first", variant="sharded",
              stop=[14, 2], timeout_s=120)
    return out


@pytest.fixture(scope="module")
def second(root: Path, two: Path) -> Path:
    """w2/first resumed on 1 x acc(8), killed at update 27 (of epoch 1), micro-batch 5 (saved to
    chain/second); w2/sharded_first at update 27, micro-batch 1 (chain/sharded_second)."""
    out = _out(root, "chain")
    worker.segment(str(out), "second", resume=str(two / "first"), stop=[27, 5])
    worker.segment(str(out), "sharded_second", "sharded", resume=str(two / "sharded_first"), stop=[27, 1])
    return out


def _launch_job(w: int, out: Path, *args: Any) -> None:
    done = _launch.launch("--backend", "cpu", "--nproc-per-node", str(w), "--timeout-s", "120",
                          script="invariant.py", script_args=("--out", out, *args), timeout_s=280)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture(scope="module")
def four(pool: Pools, root: Path, second: Path) -> Path:
    """Every variant on 4 x acc(2) (the pool of 4), which also resumes chain/second to the end."""
    out = _out(root, "w4")
    pool.launch(*POOL4, script="invariant.py", timeout_s=280, script_args=(
        "--out", out, "--segment", f"third:adamw:{second / 'second'}",
        "--segment", f"sharded_third:sharded:{second / 'sharded_second'}"))
    return out


@pytest.fixture(scope="module")
def eight(root: Path) -> Path:
    """The SGD and AdamW variants on 8 x acc(1) (one launch)."""
    out = _out(root, "w8")
    _launch_job(8, out, "--variants", "sgd,adamw")
    return out


def _same_run(reference: dict[str, Any], other: dict[str, Any]) -> None:
    assert other["hashes"] == reference["hashes"]
    assert other["points"] == reference["points"]  # logged (step, loss, grad_norm)
    assert other["empty_micro_batches"] == reference["empty_micro_batches"]


VARIANTS = pytest.mark.parametrize("variant", ["sgd", "adamw", "loss_bf16", "clip_value", "sharded"])


@pytest.mark.multiprocess
@VARIANTS
def test_two_processes_train_the_same_bits_as_one(one: Path, two: Path, variant: str) -> None:
    """Under invariant() the whole state after each of 40 updates over 2 epochs (SGD with a loss_fn
    drawing from Python's random and NumPy and a dataset augmenting in __getitem__ without workers, or AdamW with a
    scheduler; dropout and clip(1.0); af.Loss with empty micro-batches under bf16;
    clip_value with skip_nonfinite; AdamW and clip(0.5) under shard_params(), the state
    compared whole) and the logged loss and grad_norm are identical on 1 x acc(8) and 2 x acc(4)."""
    reference = _read(one, variant)
    assert len(reference["hashes"]) == worker.UPDATES == 40 and len(set(reference["hashes"])) == 40
    assert len(reference["points"]) == 40
    assert all((p[2] is None) == (variant == "clip_value") for p in reference["points"])  # grad_norm under clip
    assert reference["outer_rng_untouched"]  # random and NumPy: keyed per micro-batch inside, put back after
    if variant == "loss_bf16":
        assert reference["empty_micro_batches"] > 0  # micro-batches whose af.Loss count is 0
    if variant == "sharded":  # one process trains unsharded; two hold FSDP2 shards (DTensors)
        assert not reference["dtensors"] and _read(two, variant)["dtensors"]
        assert sum(p[2] > 0.5 for p in reference["points"]) > 20  # clip(0.5) scales most updates
    _same_run(reference, _read(two, variant))


@pytest.mark.multiprocess
@VARIANTS
def test_four_processes_train_the_same_bits_as_one(one: Path, four: Path, variant: str) -> None:
    """The same on 4 x acc(2): every update's state and logged loss and grad_norm."""
    assert _read(four, variant)["dtensors"] == (variant == "sharded")
    _same_run(_read(one, variant), _read(four, variant))


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ["sgd", "adamw"])
def test_eight_processes_train_the_same_bits_as_one(one: Path, eight: Path, variant: str) -> None:
    """The same on 8 x acc(1) (no accumulation at all)."""
    _same_run(_read(one, variant), _read(eight, variant))


@pytest.mark.multiprocess
def test_without_invariant_the_topologies_differ(one: Path, two: Path, four: Path) -> None:
    """The controls (the same samples per update, replicate() or shard_params() with
    accumulate(A), without invariant()) give other states and logged losses on 2 and 4
    processes than on 1."""
    for control, out in ((c, o) for c in ("control", "shard_control") for o in (two, four)):
        reference, other = _read(one, control), _read(out, control)
        assert len(other["hashes"]) == len(reference["hashes"]) == worker.CONTROL_UPDATES
        assert other["hashes"][0] != reference["hashes"][0]
        assert [p[1] for p in other["points"]] != [p[1] for p in reference["points"]]


@pytest.mark.multiprocess
def test_a_job_killed_mid_window_resumes_on_other_topologies(one: Path, two: Path, second: Path,
                                                              four: Path) -> None:
    """2 x acc(4) saved at update 14, micro-batch 2 of its window, resumed on 1 x acc(8),
    saved at update 27 (past the epoch boundary at 20), micro-batch 5, resumed on 4 x acc(2):
    every update's state equals the uninterrupted run's. The same under shard_params() (sharded on 2 and 4, saved on 1 at
    micro-batch 1: on 4, rank 0 pushes the saved leaf and still runs that micro-batch's
    forward and backward, whose FSDP2 all-gathers the other ranks run too)."""
    for variant, prefix in (("adamw", ""), ("sharded", "sharded_")):
        full = _read(one, variant)["hashes"]
        first, middle = _read(two, f"{prefix}first"), _read(second, f"{prefix}second")
        third = _read(four, f"{prefix}third")
        assert (len(first), len(middle), len(third)) == (14, 13, 13)
        assert first + middle + third == full


@pytest.mark.multiprocess
def test_resume_with_another_global_batch_is_refused(second: Path) -> None:
    """Resuming an invariant() checkpoint with another micro-batch size or another number of
    micro-batches per update raises a TransformError naming both layouts, before a forward."""
    checkpoint = second / "second"
    step, state, loader, _ = worker.build("adamw", 1, micro_batches=4)
    with pytest.raises(af.TransformError, match=r"8 micro-batches per update.*resumes with 2 and 4"):
        af.run(step, state, loader, backend=af.backends.CPU(), epochs=2, progress=False, resume=checkpoint)
    step, state, _, _ = worker.build("adamw", 1)
    loader = torch.utils.data.DataLoader(worker.Samples(), batch_size=3, shuffle=True)
    with pytest.raises(af.TransformError, match="micro-batches of 2 samples.*resumes with 3 and 8"):
        af.run(step, state, loader, backend=af.backends.CPU(), epochs=2, progress=False, resume=checkpoint)


@pytest.mark.multiprocess
def test_three_and_two_processes_match_one_over_1000_updates(pool: Pools, tmp_path: Path) -> None:
    """1 x acc(6), 3 x acc(2) (W not a power of two: the ranks' subtrees are complete and the
    blocks of W are folded as one rank folds) and 2 x acc(3) (A not a power of two: the
    subtrees inside each block are gathered and pushed in order) train the same bits, for
    1000 updates on 3 processes and the first 300 on 2."""
    reference = worker.long_run(str(tmp_path))
    pool.call(*POOL3, function="invariant:long_run", out=str(tmp_path), timeout_s=400)
    assert len(reference) == 10 and json.loads((tmp_path / "long3.json").read_text()) == reference
    pool.call(*POOL, function="invariant:long_run", out=str(tmp_path), updates=300, timeout_s=200)
    assert json.loads((tmp_path / "long2.json").read_text()) == reference[:3]


def test_batch_norm_is_refused_before_any_forward(cpu: af.backends.CPU) -> None:
    """prepare() under invariant() refuses a BatchNorm (and a user-listed type) naming the layer."""
    calls = []

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        calls.append(1)
        return model(batch).sum()

    for layer, spec in ((torch.nn.BatchNorm1d(4), af.invariant()),
                        (torch.nn.Tanh(), af.invariant(batch_coupled=(torch.nn.Tanh,)))):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), layer)
        state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(af.TransformError, match=f"layer '1' \\({type(layer).__name__}\\)"):
            cpu.prepare(spec(af.train_step(loss_fn)), state)
    assert calls == []


def test_invariant_validates_and_conflicts() -> None:
    """invariant() checks its arguments and refuses shard_params() with offloading or HSDP,
    and split batches."""
    with pytest.raises(ValueError, match="seed"):
        af.invariant(seed=-1)
    with pytest.raises(TypeError, match="batch_coupled"):
        af.invariant(batch_coupled=[torch.nn.BatchNorm1d])
    base = af.train_step(lambda m, b: m(b).sum())
    af.compose(af.invariant(), af.shard_params())(base)
    for sharding in (af.shard_params(offload=True), af.shard_params(shard_size=2)):
        with pytest.raises(af.TransformError, match="offload=True.*shard_size"):
            af.compose(af.invariant(), sharding)(base)
    with pytest.raises(af.TransformError, match="split_batches"):
        af.compose(af.invariant(), af.shard_data(split_batches=True))(base)


def test_binary_counter_is_the_pairwise_tree() -> None:
    """Pushing leaves one by one and folding gives ((0+1)+(2+3))+(4+5) for six leaves; a
    rank's two subtrees of four give the tree of eight, and two blocks of three leaves
    pushed node by node the tree of six, bit for bit."""
    values = torch.randn(8, 1000, dtype=torch.float32) * torch.logspace(-3, 3, 1000)

    def leaf(i: int) -> Node:
        return Node(i, 0, values[i].clone(), torch.zeros(2, dtype=torch.float64))

    nodes: tuple[Node, ...] = ()
    for i in range(6):
        nodes = push(nodes, leaf(i))
    assert [n.height for n in nodes] == [2, 1]
    v = values
    assert torch.equal(fold(nodes).grads, ((v[0] + v[1]) + (v[2] + v[3])) + (v[4] + v[5]))
    halves = []
    for start in (0, 4):
        stack: tuple[Node, ...] = ()
        for i in range(start, start + 4):
            stack = push(stack, leaf(i))
        halves.append(fold(stack))
    eight = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]))
    assert torch.equal(halves[0].grads + halves[1].grads, eight)
    assert not torch.equal(sum(v[i] for i in range(8)), eight)  # the order matters at all
    assert blocks(8) == [(0, 8)] and blocks(6) == [(0, 4), (4, 2)] and blocks(3) == [(0, 2), (2, 1)]
    # a block of three leaves (3, 4, 5) keeps 3 apart from 4 (not siblings); its nodes and the
    # other block's, pushed in order, give the tree of six
    block: tuple[Node, ...] = ()
    for i in (3, 4, 5):
        block = push(block, leaf(i))
    assert [(n.start, n.height) for n in block] == [(3, 0), (4, 1)]
    first: tuple[Node, ...] = ()
    for i in (0, 1, 2):
        first = push(first, leaf(i))
    merged: tuple[Node, ...] = ()
    for node in (*first, *block):
        merged = push(merged, node)
    assert torch.equal(fold(merged).grads, ((v[0] + v[1]) + (v[2] + v[3])) + (v[4] + v[5]))


def test_blocks_are_the_same_micro_batches_on_every_world_size() -> None:
    """Update u reads global micro-batches [u L, (u+1) L), rank r the contiguous block of A;
    the incomplete last global batch is not read."""
    whole = block_indices(37, batch_size=2, rank=0, world_size=1, num_micro_batches=8, shuffle=True, seed=3, epoch=1)
    assert [k for k, _ in whole] == list(range(16))  # 2 updates of 16 samples; 5 samples dropped
    for w in (2, 4, 8):
        ranks = [block_indices(37, batch_size=2, rank=r, world_size=w, num_micro_batches=8 // w, shuffle=True,
                               seed=3, epoch=1) for r in range(w)]
        assert [k for k, _ in ranks[1]][:8 // w] == list(range(8 // w, 2 * (8 // w)))
        assert sorted(pair for rank in ranks for pair in rank) == whole


def _noisy_collate(samples: list[Any]) -> Any:
    """default_collate, then a draw of torch's global generator added (a random collate)."""
    x, y, w = torch.utils.data.default_collate(samples)
    return x + torch.rand(()), y, w


def test_block_draws_are_keyed_by_the_global_micro_batch_with_and_without_workers() -> None:
    """Under invariant(), global micro-batch k fetched by rank r of W (1, 2 or 4; accumulate(8 // W))
    holds the same augmented values (torch, random and NumPy draws in __getitem__, a torch draw
    in the collate function) whatever W and the global generators' state, without DataLoader
    workers (the default) and with one, and the same in both; without workers, the fetch leaves
    the main process's generators as they were."""
    keyed = []
    for workers in (0, 1):
        loader = torch.utils.data.DataLoader(worker.Augmented(40), batch_size=2, shuffle=True,
                                             num_workers=workers, collate_fn=_noisy_collate)
        by_world: dict[int, dict[int, Any]] = {}
        for w in (1, 2, 4):
            got: dict[int, Any] = {}
            for r in range(w):
                torch.manual_seed(100 + 10 * w + r)  # each topology and rank at another place of its streams
                before = torch.get_rng_state()
                pairs = block_indices(40, batch_size=2, rank=r, world_size=w, num_micro_batches=8 // w,
                                      shuffle=True, seed=3, epoch=1)
                batches = list(block_loader(loader, seed=3, rank=r, world_size=w, num_micro_batches=8 // w,
                                            epoch=1, start=0))
                if workers == 0:
                    assert torch.equal(torch.get_rng_state(), before)
                got |= {k: batch for (k, _), batch in zip(pairs, batches)}
            by_world[w] = got
        assert sorted(by_world[1]) == list(range(16))
        for w in (2, 4):
            assert sorted(by_world[w]) == sorted(by_world[1])
            for k, (x, y, _) in by_world[1].items():
                assert torch.equal(by_world[w][k][0], x) and torch.equal(by_world[w][k][1], y)
        keyed.append(by_world[1])
    assert all(torch.equal(keyed[0][k][0], keyed[1][k][0]) for k in keyed[0])


def test_tree_window_and_layout_round_trip_through_the_codec() -> None:
    """A TreeWindow (its nodes' tensors, -0.0 included) and a Layout, encoded for a checkpoint
    and decoded, keep every field's type and value."""
    node = Node(5, 1, torch.tensor([1.5, -0.0]), torch.tensor([2.0, 3.0], dtype=torch.float64))
    window = TreeWindow((node,), 4, ("acc",), 3.0, (node,), 7, True)
    encoder = Encoder()
    plain = encoder.encode({"tree_window": window, "invariant": Layout(2, 8)}, "transforms_state")
    back = decode(plain, encoder.tensors)
    assert back["invariant"] == Layout(2, 8)
    restored = back["tree_window"]
    assert type(restored) is TreeWindow
    assert (restored.num_samples, restored.metric_names, restored.num_items, restored.skip_until,
            restored.item_counts) == (4, ("acc",), 3.0, 7, True)
    for nodes in (restored.nodes, restored.pending):
        (got,) = nodes
        assert (got.start, got.height) == (5, 1) and torch.equal(got.sums, node.sums)
        assert torch.equal(got.grads, node.grads) and torch.signbit(got.grads).tolist() == [False, True]


def test_the_xla_backend_refuses_invariant_before_anything_is_placed() -> None:
    """XLA refuses the invariant phase naming the cpu and cuda backends, and prepare() asks
    before it places, wraps or broadcasts anything (here on the CPU backend given XLA's
    refusals: a real XLA one needs torch_xla)."""
    message = r"the xla backend does not support invariant\(\) .* use the cpu or cuda backend"
    model = torch.nn.Linear(2, 2)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    params = list(model.parameters())
    cpu = af.backends.CPU(af.backends.LaunchEnv())  # its own: the refusals are replaced on it
    cpu.refusals = af.backends.XLA.refusals  # type: ignore[misc]
    with pytest.raises(NotImplementedError, match=message):
        cpu.prepare(af.compose(af.invariant(), af.replicate())(af.train_step(lambda m, b: m(b).sum())), state)
    assert list(model.parameters()) == params and "invariant" not in state.transforms_state
