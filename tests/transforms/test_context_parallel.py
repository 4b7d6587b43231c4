"""``af.context_parallel`` in one process: the record and its checks, the head-and-tail split of
a sequence, the batch cut, the mesh's context dimension, the ring's refusals and the plan.
(Training on several processes: tests/distributed/test_context_parallel.py.)"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import accelfn as af
from accelfn.distributed import context_parallel as cp
from accelfn.distributed.mesh import Mesh
from tests.helpers import context_parallel as C


def _step(*transforms: af.Transform) -> af.Step:
    return af.compose(*transforms)(af.train_step(C.mean_loss))


def test_the_record_validates_its_arguments() -> None:
    """size and seq_dim are ints >= 1 and load_balance a bool, each refused by name otherwise."""
    assert af.context_parallel(size=2) == af.ContextParallel(2, True, 1)
    assert af.context_parallel(size=2).parts == 4 and af.context_parallel(size=3, load_balance=False).parts == 3
    for kwargs, error in (({"size": 0}, ValueError), ({"size": 2.0}, TypeError), ({"size": True}, TypeError),
                          ({"size": 2, "seq_dim": 0}, ValueError), ({"size": 2, "load_balance": 1}, TypeError)):
        with pytest.raises(error, match="context_parallel"):
            af.context_parallel(**kwargs)


@pytest.mark.parametrize("other", [af.pipeline("blocks.1", size=2), af.invariant(), af.compile(), af.deepspeed({})],
                         ids=lambda t: type(t).__name__)
def test_refused_compositions_name_both(other: af.Transform) -> None:
    """pipeline, invariant, compile and deepspeed are refused with context_parallel, either order."""
    base = af.train_step(af.output_loss(lambda output, targets: output.sum()))  # the form pipeline() asks for
    for first, second in ((af.context_parallel(size=2), other), (other, af.context_parallel(size=2))):
        with pytest.raises(af.TransformError, match="context_parallel"):
            af.compose(first, second)(base)


def test_head_and_tail_positions_cover_the_sequence_once() -> None:
    """Under load balancing rank r of c keeps parts r and 2c-1-r of 2c (torchtitan's head and tail);
    without, part r of c; either way the ranks' positions are each position once."""
    balanced, plain = af.context_parallel(size=2), af.context_parallel(size=2, load_balance=False)
    assert cp.positions(8, balanced, 0).tolist() == [0, 1, 6, 7]
    assert cp.positions(8, balanced, 1).tolist() == [2, 3, 4, 5]
    assert cp.positions(8, plain, 1).tolist() == [4, 5, 6, 7]
    three = af.context_parallel(size=3)
    kept = torch.cat([cp.positions(12, three, r) for r in range(3)])
    assert sorted(kept.tolist()) == list(range(12))
    assert cp.positions(12, three, 0).tolist() == [0, 1, 10, 11]


def test_a_length_that_does_not_divide_is_refused_naming_the_fix() -> None:
    """A length that is not a multiple of the parts is a ValueError naming the length and the multiple."""
    with pytest.raises(ValueError, match=r"length 10 .* not a multiple of 4; pad"):
        cp.positions(10, af.context_parallel(size=2), 0)
    assert cp.positions(10, af.context_parallel(size=2, load_balance=False), 0).tolist() == [0, 1, 2, 3, 4]


def test_the_batch_is_cut_along_the_sequence_and_per_sample_values_kept() -> None:
    """Every tensor with a sequence dimension is cut to the rank's positions; (batch,) tensors and
    non-tensors are kept; the container types stay."""
    tokens = torch.arange(16).reshape(2, 8)
    batch = {"tokens": tokens, "mask": tokens > 3, "label": torch.tensor([1, 2]), "name": "x"}
    part = cp.split_batch(batch, af.context_parallel(size=2), 1)
    assert part["tokens"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert part["mask"].tolist() == [[False, False, True, True], [True, True, True, True]]
    assert part["label"] is batch["label"] and part["name"] == "x"


def test_a_batch_of_mixed_lengths_or_without_sequences_is_refused() -> None:
    """Tensors of different sequence lengths, or none with a sequence dimension, are refused by name."""
    spec = af.context_parallel(size=2)
    with pytest.raises(ValueError, match=r"lengths \[4, 8\]"):
        cp.split_batch((torch.zeros(2, 8), torch.zeros(2, 4)), spec, 0)
    with pytest.raises(ValueError, match="no tensor with more than 1 dimensions"):
        cp.split_batch((torch.zeros(2),), spec, 0)


def test_the_mesh_places_the_context_ranks_between_data_and_tensor() -> None:
    """CP=2 x TP=2 on 8 ranks: 2 data shards, the context ranks read one shard, rank 0 of each
    context and tensor group leads, and FSDP2 shards over shard x context (4 ranks)."""
    step = _step(af.context_parallel(size=2), af.tensor_parallel({"head": "colwise"}, size=2), af.shard_params())
    mesh = Mesh.of(step, 8)
    assert (mesh.shard, mesh.context, mesh.tensor, mesh.fsdp_size) == (2, 2, 2, 4)
    assert [mesh.data_coordinates(r)[0] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert mesh.ranks_along("context", 1) == (1, 3)
    assert [r for r in range(8) if mesh.leads(r)] == [0, 4]
    with pytest.raises(ValueError, match=r"context_parallel\(size=2\) x tensor_parallel\(size=2\).* 4 ranks"):
        Mesh.of(step, 6)


@pytest.mark.parametrize("call", [{"attn_mask": torch.ones(8, 8, dtype=torch.bool)}, {"dropout_p": 0.1},
                                  {"key": torch.zeros(1, 2, 4, 4)}], ids=["mask", "dropout", "cross"])
def test_the_ring_refuses_what_it_cannot_compute(call: dict) -> None:
    """An explicit mask, dropout, or keys of another length than the queries raise NotImplementedError
    before any collective."""
    q = torch.zeros(1, 2, 8, 4)
    args = {"query": q, "key": q, "value": q} | call
    if "key" in call:
        args["value"] = call["key"]
    with pytest.raises(NotImplementedError, match="context_parallel"):
        cp.ring_attention(None, True)(**args)


def test_one_context_rank_trains_the_program_as_it_is(cpu: af.backends.Backend) -> None:
    """On one process the context dimension has one rank: the program trains as it is, equal to no CP."""
    state, step_fn = cpu.prepare(_step(af.context_parallel(size=1)), C.make_state())
    reference = C.make_state()
    batch = tuple(t[:C.BATCH] for t in C.sequences())
    state, metrics = step_fn(state, batch)
    loss = C.mean_loss(reference.model, batch).detach()
    assert float(metrics["loss"]) == pytest.approx(float(loss), rel=1e-6)


def _loader(length: int) -> DataLoader:
    return DataLoader(TensorDataset(*C.sequences(length)), batch_size=C.BATCH)


def test_the_plan_reads_one_shard_per_context_group_and_traces_a_part_of_each_sequence() -> None:
    """On 4 ranks under CP=2 + shard_params the plan counts 2 data shards (a context pair reads one:
    4 samples per rank, against 2 without CP), a smaller activation peak than CP=1, parameters
    sharded over all 4 ranks (shard x context), and DDP over all 4 under replicate; a length that
    does not divide is the error context-length-indivisible."""
    state = C.make_state()
    two = af.plan(_step(af.shard_data(), af.context_parallel(size=2), af.shard_params()), state, _loader(16),
                  world_size=4)
    one = af.plan(_step(af.shard_data(), af.shard_params()), state, _loader(16), world_size=4)
    assert two.epochs[0].samples == (4, 4, 4, 4) and one.epochs[0].samples == (2, 2, 2, 2)
    assert two.epochs[0].micro_batches == (1, 1, 1, 1)
    assert two.memory is not None and one.memory is not None
    assert 0 < two.memory[0].micro_batch < one.memory[0].micro_batch
    assert not two.errors
    assert "context_parallel(): the ring's exchanges" in " ".join(p.what for p in two.warnings)
    # FSDP2 shards over shard x context: a quarter of every parameter's rows on each of the 4 ranks
    rows = {name: -(-p.shape[0] // 4) * (p.numel() // p.shape[0]) for name, p in state.model.named_parameters()}
    assert [m.params for m in two.memory] == [4 * sum(rows.values())] * 4 == [m.params for m in one.memory]
    ddp = af.plan(_step(af.shard_data(), af.context_parallel(size=2), af.replicate()), state, _loader(16),
                  world_size=4, trace=False)
    assert {c.wire_bytes for c in ddp.comms if c.what.startswith("DDP bucket")} == {
        c.wire_bytes for c in af.plan(_step(af.shard_data(), af.replicate()), state, _loader(16), world_size=4,
                                      trace=False).comms if c.what.startswith("DDP bucket")}
    bad = af.plan(_step(af.shard_data(), af.context_parallel(size=2), af.shard_params()), state, _loader(10),
                  world_size=4)
    assert [p.code for p in bad.errors] == ["context-length-indivisible"]
    assert "length 10" in bad.errors[0].what


def test_a_forward_without_scaled_dot_product_attention_is_said_once() -> None:
    """A first forward that never calls F.scaled_dot_product_attention warns (its attention would
    see a part of each sequence only); one that calls it does not; the warning comes once."""
    spec = af.context_parallel(size=2)
    batch = (torch.zeros(1, 8),)
    plain = cp.SplitSequences(lambda model, b: b[0].sum(), spec, 0, None)
    with pytest.warns(UserWarning, match="called no torch.nn.functional.scaled_dot_product_attention"):
        assert float(plain(None, batch)) == 0.0
    plain(None, batch)  # once: no second warning (warnings are errors here)

    def attending(model: None, b: tuple[torch.Tensor]) -> torch.Tensor:
        try:
            torch.nn.functional.scaled_dot_product_attention(b[0], b[0], b[0], attn_mask=b[0])
        except NotImplementedError:  # the ring refuses a mask before any collective
            pass
        return b[0].sum()

    cp.SplitSequences(attending, spec, 0, None)(None, batch)
