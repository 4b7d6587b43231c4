"""``shard_params:`` in the launch config, ``--shard-params`` and ``ACCELFN_SHARD_PARAMS``: a
launch chooses sharded over data parallel for scripts that do not choose themselves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import accelfn as af
from accelfn.backends import LaunchEnv
from accelfn.cli import commands, precedence
from accelfn.cli import config as launch_config
from accelfn.distributed.env import parse_shard_params
from accelfn.errors import LaunchError


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def resolve(tmp_path: Path, flags: dict | None = None, file_text: str | None = None, **variables: str):
    cwd = tmp_path / "project"
    cwd.mkdir(parents=True, exist_ok=True)
    if file_text is not None:
        (cwd / "accelfn.yaml").write_text(file_text)
    environ = {"XDG_CONFIG_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path), **variables}
    return precedence.resolve(flags, environ=environ, cwd=cwd)


def test_shard_params_comes_from_the_flag_over_the_variable_over_the_file(tmp_path: Path) -> None:
    """The flag wins over ACCELFN_SHARD_PARAMS, which wins over the file's key; each source is named."""
    file_text = "shard_params: shard_size=node\n"
    both = resolve(tmp_path, {"shard_params": "offload=false"}, file_text, ACCELFN_SHARD_PARAMS="defaults")
    assert (both.config.shard_params, both.sources["shard_params"]) == ("offload=false", "--shard-params")
    env = resolve(tmp_path, None, file_text, ACCELFN_SHARD_PARAMS="defaults")
    assert (env.config.shard_params, env.sources["shard_params"]) == ("defaults", "ACCELFN_SHARD_PARAMS")
    file = resolve(tmp_path, None, file_text)
    assert (file.config.shard_params, file.sources["shard_params"]) == ("shard_size=node",
                                                                        str(tmp_path / "project" / "accelfn.yaml"))
    assert resolve(tmp_path / "none").config.shard_params is None


def test_the_flag_without_options_asks_for_the_defaults() -> None:
    """`--shard-params` is shard_params(); `--shard-params-options` gives its options."""
    parser = commands.build_parser()
    assert parser.parse_args(["launch", "--shard-params", "t.py"]).shard_params == "defaults"
    parsed = parser.parse_args(["launch", "--shard-params-options", "shard_size=2,reduce_every_micro_batch=true",
                                "t.py"])
    assert parse_shard_params(parsed.shard_params) == af.shard_params(shard_size=2, reduce_every_micro_batch=True)
    assert parser.parse_args(["launch", "t.py"]).shard_params is None


@pytest.mark.parametrize(("text", "expected"), [
    ("defaults", af.shard_params()),
    ("shard_size=node, reshard_after_forward=false", af.shard_params(shard_size="node", reshard_after_forward=False)),
    ("offload=1,shard_size=all", af.shard_params(offload=True)),
])
def test_shard_params_options_parse_into_the_transform(text: str, expected: af.ShardParams) -> None:
    """Each spec is the shard_params(...) call it names."""
    assert parse_shard_params(text) == expected


@pytest.mark.parametrize(("where", "message"), [
    ({"ACCELFN_SHARD_PARAMS": "units=Block"}, r"ACCELFN_SHARD_PARAMS='units=Block': shard_params='units=Block': "
                                              r"'units=Block' is not an option"),
    ({"ACCELFN_SHARD_PARAMS": "shard_size=0"}, r"shard_size=0\): must be >= 1"),
    ({"ACCELFN_SHARD_PARAMS": "offload=maybe"}, r"offload='maybe' must be true or false"),
    ("shard_params: true\n", r"shard_params=true: must be a string or null, got a boolean"),
])
def test_a_bad_shard_params_spec_is_an_error_naming_its_source(tmp_path: Path, where: object, message: str) -> None:
    """A spec no worker could read, in a variable or a file, raises LaunchError naming it."""
    with pytest.raises(LaunchError, match=message):
        if isinstance(where, dict):
            resolve(tmp_path, **where)
        else:
            resolve(tmp_path, None, str(where))


def test_the_launch_passes_it_to_the_workers_that_read_it_back() -> None:
    """worker_env sets ACCELFN_SHARD_PARAMS, and LaunchEnv.from_env reads it as the transform."""
    worker = launch_config.LaunchConfig(shard_params="shard_size=node").worker_env()
    assert worker["ACCELFN_SHARD_PARAMS"] == "shard_size=node"
    env = LaunchEnv.from_env({"ACCELFN_SHARD_PARAMS": worker["ACCELFN_SHARD_PARAMS"]})
    assert env.shard_params == af.shard_params(shard_size="node")
    with pytest.raises(LaunchError, match="ACCELFN_SHARD_PARAMS: shard_params='x': 'x' is not an option"):
        LaunchEnv.from_env({"ACCELFN_SHARD_PARAMS": "x"})


def test_the_launch_default_replaces_replicate_and_trains_as_the_explicit_program() -> None:
    """A backend launched with shard_params turns shard_data + replicate into shard_data +
    shard_params and trains as that program written by hand: same steps, same parameters."""
    data = [(torch.randn(4, 3, generator=torch.Generator().manual_seed(i)), torch.ones(4, 1)) for i in range(6)]

    def trained(program: af.Step, env: LaunchEnv) -> tuple[af.TrainState, af.Step]:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        backend = af.backends.CPU(env)
        _, step_fn = backend.prepare(program, state)
        with pytest.warns(af.PlanWarning, match=r"^\[shard-params-one-process\]"):  # one process: said, and trained
            return af.run(program, state, data, backend=backend, progress=False), step_fn.step

    launched = LaunchEnv(shard_params=af.shard_params(reshard_after_forward=False))
    defaulted, as_run = trained(af.compose(af.shard_data(), af.replicate())(af.train_step(loss_fn)), launched)
    explicit, _ = trained(af.compose(af.shard_data(), af.shard_params(reshard_after_forward=False))(
        af.train_step(loss_fn)), LaunchEnv())
    assert as_run.find(af.Replicate) is None
    assert as_run.find(af.ShardParams) == af.shard_params(reshard_after_forward=False)
    assert defaulted.step == explicit.step == 6
    assert all(torch.equal(a, b) for a, b in zip(defaulted.model.parameters(), explicit.model.parameters()))


def test_a_scripts_own_shard_params_wins_over_the_launch_default_with_a_warning() -> None:
    """shard_params(shard_size=2) in the script stays, and a warning names both."""
    model = torch.nn.Linear(3, 1)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.warns(UserWarning, match=r"accelfn launch --shard-params \(ShardParams\(.*offload=True.*\)\) is "
                                         r"overridden by the script's ShardParams\("):
        _, step_fn = af.backends.CPU(LaunchEnv(shard_params=af.shard_params(offload=True))).prepare(
            af.shard_params(shard_size=2)(af.train_step(loss_fn)), state)
    assert step_fn.step.find(af.ShardParams) == af.shard_params(shard_size=2)
