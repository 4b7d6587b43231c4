"""shard_params: the record, which submodules become FSDP units, what it refuses to compose
with, and the errors a backend gives before touching the state (one process)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import accelfn as af
from tests.helpers import programs as P
from tests.helpers import sharded as S


class Layer(torch.nn.Module):
    """A block that holds a repeated list of its own (which the default does not split)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(4)
        self.heads = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(3))
        self.mixed = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.ReLU()])  # not repeated
        self.head = torch.nn.Linear(4, 10)


def _names(units: list[tuple[str, torch.nn.Module]]) -> list[str]:
    return [name for name, _ in units]


def test_shard_params_is_a_frozen_hashable_record_with_zero3_defaults() -> None:
    """shard_params() builds ShardParams(units=None, reshard_after_forward=True, offload=False,
    reduce_every_micro_batch=False, shard_size=None), equal and hashable by value, at the model phase."""
    t = af.shard_params()
    assert repr(t) == ("ShardParams(units=None, reshard_after_forward=True, offload=False, "
                       "reduce_every_micro_batch=False, shard_size=None)")
    assert t == af.shard_params() and hash(t) == hash(af.shard_params())
    step = af.compose(af.clip(1.0), t, af.shard_data())(af.train_step(P.mse))
    assert [type(x).__name__ for x in step.transforms] == ["ShardData", "ShardParams", "Clip"]


def test_by_default_each_block_of_a_repeated_module_list_is_a_unit_innermost_first() -> None:
    """The default units are the blocks of every ModuleList of 2+ modules of one class, not
    lists inside those blocks nor mixed lists; they come last-first, as fully_shard needs."""
    assert _names(af.shard_params().select(Model())) == ["layers.2", "layers.1", "layers.0"]
    assert af.shard_params().select(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))) == []


def test_units_as_classes_or_a_predicate_choose_those_submodules() -> None:
    """units={Linear} picks every Linear below the root; a predicate gets (name, module);
    nested picks come before their ancestors."""
    model = Model()
    assert _names(af.shard_params(units=torch.nn.Linear).select(model)) == [
        "head", "mixed.0", "layers.2.heads.1", "layers.2.heads.0", "layers.1.heads.1", "layers.1.heads.0",
        "layers.0.heads.1", "layers.0.heads.0"]
    assert af.shard_params(units={torch.nn.Linear}) == af.shard_params(units=[torch.nn.Linear])
    picked = af.shard_params(units=lambda name, module: name in ("layers.0", "layers.0.heads.1", "embed"))
    assert _names(picked.select(model)) == ["layers.0.heads.1", "layers.0", "embed"]


@pytest.mark.parametrize("units", ["blocks", {int}, set(), 3])
def test_units_of_the_wrong_kind_are_refused(units: object) -> None:
    """A string, a non-Module class, an empty set or a number as units raises TypeError."""
    with pytest.raises(TypeError, match=r"shard_params\(units=...\)"):
        af.shard_params(units=units)  # type: ignore[arg-type]


def test_flags_must_be_booleans() -> None:
    """shard_params(offload=1) raises TypeError naming the field."""
    with pytest.raises(TypeError, match=r"shard_params\(offload=...\) must be True or False, got 1"):
        af.shard_params(offload=1)  # type: ignore[arg-type]


def test_shard_size_groups_the_world_or_is_refused() -> None:
    """shard_size: None shards over the world, "node" over LOCAL_WORLD_SIZE ranks, an int over
    that many; a world it cannot split, 0, a float or another string is refused."""
    assert af.shard_params().shard_degree(8, 4) == 8
    assert af.shard_params(shard_size="node").shard_degree(8, 4) == 4
    assert af.shard_params(shard_size=2).shard_degree(8, 4) == 2
    assert af.shard_params(shard_size=3).shard_degree(1, 1) == 1  # one process trains unsharded
    with pytest.raises(ValueError, match=r"shard_params\(shard_size=3\): the world of 4 processes cannot be split "
                       r"into groups of 3 ranks; make the world size a multiple of it"):
        af.shard_params(shard_size=3).shard_degree(4, 4)
    with pytest.raises(ValueError, match=r"shard_params\(shard_size='node'\): the world of 6 processes cannot be split "
                       r"into groups of 4 ranks; make the world size a multiple of LOCAL_WORLD_SIZE"):
        af.shard_params(shard_size="node").shard_degree(6, 4)
    with pytest.raises(ValueError, match=r"shard_params\(shard_size=0\): must be >= 1"):
        af.shard_params(shard_size=0)
    with pytest.raises(TypeError, match=r"shard_params\(shard_size=...\) must be an int, \"node\" or None, got 2.0"):
        af.shard_params(shard_size=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"shard_params\(shard_size=...\) must be an int, \"node\" or None, got 'rack'"):
        af.shard_params(shard_size="rack")  # type: ignore[arg-type]


def test_shard_params_with_replicate_is_refused_saying_why() -> None:
    """Composing shard_params() and replicate() raises TransformError: both are data parallel."""
    with pytest.raises(af.TransformError, match=r"shard_params\(\) is already data parallel over the same "
                       r"processes: .* Remove replicate\(\)"):
        af.compose(af.shard_params(), af.replicate())(af.train_step(P.mse))


def test_shard_data_without_even_batches_is_refused_with_shard_params() -> None:
    """shard_data(even_batches=False) would let ranks' all-gathers go unpaired under shard_params."""
    with pytest.raises(af.TransformError, match=r"so shard_params\(\)'s parameter all-gathers would hang"):
        af.compose(af.shard_data(even_batches=False), af.shard_params())(af.train_step(P.mse))


def test_offload_on_the_cpu_backend_is_refused_before_anything_changes(cpu: af.backends.Backend) -> None:
    """prepare() of shard_params(offload=True) on the CPU backend raises NotImplementedError and
    leaves the model and optimizer as they were."""
    state = S.make_state("adamw")
    params = list(state.model.parameters())
    with pytest.raises(NotImplementedError, match=r"shard_params\(offload=True\) moves sharded parameters .* "
                       r"on the cpu backend they are in CPU memory already"):
        cpu.prepare(af.shard_params(offload=True)(af.train_step(P.mse)), state)
    assert type(state.model) is S.Blocks and list(state.model.parameters()) == params
    assert state.optimizer.param_groups[0]["params"] == params


def test_the_xla_backend_refuses_shard_params_naming_the_alternatives() -> None:
    """XLA refuses the shard_params phase naming replicate() and torch_xla's FSDPv2, before
    anything changes (its refusals, given to a CPU backend: building a real XLA one needs
    torch_xla), and the plan names the same refusal."""
    cpu = af.backends.CPU(af.backends.LaunchEnv())
    cpu.refusals = af.backends.XLA.refusals  # type: ignore[misc]  # this instance's own
    state = S.make_state()
    params = list(state.model.parameters())
    message = (r"the xla backend does not support shard_params\(\) .* use replicate\(\) "
               r".*torch_xla.experimental.spmd_fully_sharded_data_parallel")
    with pytest.raises(NotImplementedError, match=message):
        cpu.prepare(af.shard_params()(af.train_step(P.mse)), state)
    assert list(state.model.parameters()) == params
    assert [name for name, _ in cpu.unsupported(af.shard_params()(af.train_step(P.mse)), state, world_size=2)] == [
        "shard_params"]


def test_one_process_trains_unsharded_exactly_as_without_shard_params(cpu: af.backends.Backend) -> None:
    """On one process there is nothing to shard: the model stays plain and the parameters equal
    those of the same program without shard_params, bitwise."""
    runs = []
    for transforms in ((af.shard_params(), af.accumulate(2), af.clip(1.0)), (af.accumulate(2), af.clip(1.0))):
        step = af.compose(af.shard_data(seed=P.SHARD_SEED), *transforms)(af.train_step(P.mse))
        sharded = step.find(af.ShardParams) is not None  # the plan says so, and trains on
        with pytest.warns(af.PlanWarning, match=r"^\[shard-params-one-process\]") if sharded else contextlib.nullcontext():
            runs.append(af.run(step, S.make_state("adamw"), S.loader(6), backend=cpu, epochs=1, progress=False))
    assert type(runs[0].model) is S.Blocks
    for a, b in zip(runs[0].model.parameters(), runs[1].model.parameters()):
        assert torch.equal(a, b)
