"""Where each launch option comes from: flags > environment > config file > user file > defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import accelfn as af
from accelfn.backends import LaunchEnv
from accelfn.cli import config as launch_config
from accelfn.cli import main, precedence
from accelfn.errors import LaunchError
from tests.helpers import launch as _launch


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def places(tmp_path: Path) -> dict[str, Path]:
    """A user config dir (as XDG_CONFIG_HOME), a working directory and a spare directory."""
    return {"xdg": tmp_path / "xdg", "cwd": tmp_path / "project", "other": tmp_path / "other"}


def resolve(places: dict[str, Path], flags: dict | None = None, config_file: Path | None = None,
            **variables: str) -> precedence.Resolved:
    places["cwd"].mkdir(parents=True, exist_ok=True)
    environ = {"XDG_CONFIG_HOME": str(places["xdg"]), "HOME": str(places["other"]), **variables}
    return precedence.resolve(flags, config_file=config_file, environ=environ, cwd=places["cwd"])


def test_each_option_comes_from_the_highest_source_that_sets_it(places: dict[str, Path]) -> None:
    """precision set by all five sources is the flag's; removing each source in turn hands it
    to the next: environment, working-directory file, user file, default."""
    user = write(places["xdg"] / "accelfn" / "config.yaml", "precision: fp16\n")
    local = write(places["cwd"] / "accelfn.yaml", "precision: bf16\n")
    variable = {"ACCELFN_PRECISION": "bf16-true"}
    seen = [resolve(places, {"precision": "fp32"}, **variable)]
    seen.append(resolve(places, **variable))
    seen.append(resolve(places))
    local.unlink()
    seen.append(resolve(places))
    user.unlink()
    seen.append(resolve(places))
    assert [(r.config.precision, r.sources.get("precision")) for r in seen] == [
        ("fp32", "--precision"), ("bf16-true", "ACCELFN_PRECISION"), ("bf16", str(local)), ("fp16", str(user)),
        (None, None)]


def test_a_file_sets_only_the_keys_it_holds(places: dict[str, Path]) -> None:
    """The user file's accumulate and the project file's nproc_per_node both apply."""
    user = write(places["xdg"] / "accelfn" / "config.yaml", "accumulate: 4\nnproc_per_node: 8\n")
    local = write(places["cwd"] / "accelfn.yaml", "nproc_per_node: 2\n")
    resolved = resolve(places)
    assert (resolved.config.accumulate, resolved.config.nproc_per_node) == (4, 2)
    assert resolved.files == (user, local)


def test_config_flag_then_variable_then_working_directory_choose_the_file(places: dict[str, Path]) -> None:
    """--config FILE wins over ACCELFN_CONFIG_FILE, which wins over ./accelfn.yaml."""
    write(places["cwd"] / "accelfn.yaml", "nproc_per_node: 2\n")
    named = write(places["other"] / "named.yaml", "nproc_per_node: 3\n")
    flagged = write(places["other"] / "flagged.yaml", "nproc_per_node: 5\n")
    assert resolve(places).config.nproc_per_node == 2
    assert resolve(places, ACCELFN_CONFIG_FILE=str(named)).config.nproc_per_node == 3
    assert resolve(places, config_file=flagged, ACCELFN_CONFIG_FILE=str(named)).config.nproc_per_node == 5


def test_a_missing_file_named_by_the_variable_is_an_error(places: dict[str, Path]) -> None:
    """ACCELFN_CONFIG_FILE naming no file raises LaunchError naming it."""
    missing = places["other"] / "nope.yaml"
    with pytest.raises(LaunchError, match=f"cannot read the launch config {missing}"):
        resolve(places, ACCELFN_CONFIG_FILE=str(missing))


@pytest.mark.parametrize(("variables", "expected"), [
    ({"XDG_CONFIG_HOME": "/etc/xdg-home"}, Path("/etc/xdg-home/accelfn/config.yaml")),
    ({"XDG_CONFIG_HOME": "", "HOME": "/home/u"}, Path("/home/u/.config/accelfn/config.yaml")),
    ({"XDG_CONFIG_HOME": "relative/dir", "HOME": "/home/u"}, Path("/home/u/.config/accelfn/config.yaml")),
    ({"HOME": "/home/u"}, Path("/home/u/.config/accelfn/config.yaml")),
])
def test_the_user_file_lives_in_the_xdg_config_directory(variables: dict[str, str], expected: Path) -> None:
    """$XDG_CONFIG_HOME/accelfn/config.yaml when it is an absolute path, else ~/.config/accelfn/."""
    assert precedence.user_config_file(variables) == expected


def test_accelfn_config_user_writes_the_user_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`accelfn config --user --accumulate 2` writes the file every later launch reads."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert main(["config", "--user", "--accumulate", "2", "--gpu-ids", "0,1"]) == 0
    written = launch_config.load(tmp_path / "accelfn" / "config.yaml")
    assert (written.accumulate, written.gpu_ids) == (2, "0,1")
    assert f"wrote the launch config {tmp_path / 'accelfn' / 'config.yaml'}" in capsys.readouterr().out


@pytest.mark.parametrize(("variables", "message"), [
    ({"ACCELFN_ACCUMULATE": "0"}, "ACCELFN_ACCUMULATE='0': accumulate=0: must be >= 1"),
    ({"ACCELFN_ACCUMULATE": "two"}, "ACCELFN_ACCUMULATE='two': must be an int$"),
    ({"ACCELFN_COMPILE": "maybe"}, "ACCELFN_COMPILE='maybe': must be 1, 0, true or false"),
    ({"ACCELFN_PRECISION": "fp12"}, "ACCELFN_PRECISION='fp12': precision='fp12': accepted values are fp32"),
    ({"CUDA_VISIBLE_DEVICES": "0, 1"}, "CUDA_VISIBLE_DEVICES='0, 1': gpu_ids='0, 1': must be \"all\" or GPU ids"),
    ({"CUDA_VISIBLE_DEVICES": "0,x"}, "CUDA_VISIBLE_DEVICES='0,x': gpu_ids='0,x': must be \"all\" or GPU ids"),
])
def test_a_bad_variable_is_an_error_naming_it(places: dict[str, Path], variables: dict[str, str],
                                              message: str) -> None:
    """A variable the launch would pass on, but that no worker could read, raises LaunchError."""
    with pytest.raises(LaunchError, match=message):
        resolve(places, **variables)


@pytest.mark.parametrize(("gpu_ids", "expected"), [("0,1", "0,1"), ("GPU-8a3f", "GPU-8a3f"), ("all", None)])
def test_gpu_ids_become_cuda_visible_devices_for_the_workers(gpu_ids: str, expected: str | None) -> None:
    """gpu_ids is passed as CUDA_VISIBLE_DEVICES; "all" removes the variable."""
    env = launch_config.LaunchConfig(gpu_ids=gpu_ids).worker_env()
    assert env["CUDA_VISIBLE_DEVICES"] == expected


@pytest.mark.parametrize("gpu_ids", ["0, 1", "0,,1", "cuda:0"])
def test_malformed_gpu_ids_are_refused(gpu_ids: str) -> None:
    """GPU ids with spaces, empty items or other characters raise ValueError naming the syntax."""
    with pytest.raises(ValueError, match=r"gpu_ids=.*: must be \"all\" or GPU ids separated by commas"):
        launch_config.LaunchConfig(gpu_ids=gpu_ids)


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def test_the_launch_accumulate_default_applies_to_a_program_without_accumulate() -> None:
    """A backend launched with accumulate=2 trains an accumulate-free program exactly as
    accumulate(2): half the updates, the same parameters."""
    data = [(torch.randn(4, 3, generator=torch.Generator().manual_seed(i)), torch.ones(4, 1)) for i in range(8)]

    def trained(program: af.Step, env: LaunchEnv) -> af.TrainState:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return af.run(program, state, data, backend=af.backends.CPU(env), progress=False)

    defaulted = trained(af.train_step(loss_fn), LaunchEnv(accumulate=2))
    explicit = trained(af.accumulate(2)(af.train_step(loss_fn)), LaunchEnv())
    assert defaulted.step == explicit.step == 4
    assert all(torch.equal(a, b) for a, b in zip(defaulted.model.parameters(), explicit.model.parameters()))


def test_a_scripts_own_accumulate_wins_over_the_launch_default_with_a_warning() -> None:
    """accumulate(3) in the script stays, and a warning names both."""
    model = torch.nn.Linear(3, 1)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.warns(UserWarning, match=r"accelfn launch --accumulate 2 is overridden by the script's "
                                         r"accumulate\(3\)"):
        _, step_fn = af.backends.CPU(LaunchEnv(accumulate=2)).prepare(af.accumulate(3)(af.train_step(loss_fn)), state)
    assert step_fn.step.find(af.Accumulate) == af.accumulate(3)


@pytest.mark.multiprocess
def test_config_files_and_flags_reach_the_workers(tmp_path: Path) -> None:
    """A launch reads accumulate from the user file, gpu_ids from ./accelfn.yaml and compile from
    its flag, and the workers see ACCELFN_ACCUMULATE, CUDA_VISIBLE_DEVICES and ACCELFN_COMPILE."""
    write(tmp_path / "xdg" / "accelfn" / "config.yaml", "accumulate: 3\ngpu_ids: '5'\n")
    write(tmp_path / "accelfn.yaml", "gpu_ids: '0,1'\nbackend: cpu\n")
    env = _launch.environment(XDG_CONFIG_HOME=str(tmp_path / "xdg"))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    trial = write(tmp_path / "trial.yaml", "timeout_s: 120\ncompile: false\naccumulate: 5\n")
    _launch.launch("--compile", script="hello.py", script_args=("--out", tmp_path, "--trial", trial), cwd=tmp_path,
                   env=env)
    record = json.loads((tmp_path / "rank0.json").read_text())
    assert (record["accumulate"], record["compile"], record["cuda_visible_devices"]) == (3, True, "0,1")
    # a launch started inside this worker with --config trial.yaml: the variables the outer
    # launch set for its workers (its default timeout, its --compile, the user file's
    # accumulate) are not settings of its own, so the file's values hold
    nested = record["nested"]
    assert (nested["timeout_s"], nested["compile"], nested["accumulate"]) == (120, False, 5)
    assert {k: nested["sources"][k] for k in ("timeout_s", "compile", "accumulate")} == dict.fromkeys(
        ("timeout_s", "compile", "accumulate"), str(trial))
    report = record["env_report"]
    assert ("set by the launch that started this process, for its workers (not settings of a launch from here): "
            "ACCELFN_TIMEOUT_S=600, ACCELFN_COMPILE=1, ACCELFN_BACKEND=cpu, ACCELFN_ACCUMULATE=3\n") in report
    assert "from ACCELFN_" not in report
    assert f"  timeout_s: 120.0  # from {trial}\n" in report


def test_a_variable_changed_after_the_launcher_set_it_is_a_setting_again(places: dict[str, Path]) -> None:
    """Inside a worker, ACCELFN_TIMEOUT_S still at the value the outer launch listed is not a
    setting (the chosen file's 120 holds); set to another value by the worker's own code, it
    is one again, above the file, while ACCELFN_COMPILE at its listed value still is not."""
    trial = write(places["other"] / "trial.yaml", "timeout_s: 120\ncompile: true\n")
    listed = {"ACCELFN_LAUNCHER_SET": "ACCELFN_TIMEOUT_S=600\nACCELFN_COMPILE=0\n", "ACCELFN_COMPILE": "0"}
    inherited = resolve(places, config_file=trial, ACCELFN_TIMEOUT_S="600", **listed)
    assert (inherited.config.timeout_s, inherited.config.compile) == (120, True)
    changed = resolve(places, config_file=trial, ACCELFN_TIMEOUT_S="30", **listed)
    assert (changed.config.timeout_s, changed.config.compile) == (30, True)
    assert changed.sources["timeout_s"] == "ACCELFN_TIMEOUT_S" and changed.sources["compile"] == str(trial)


def test_a_null_in_a_file_leaves_the_option_to_the_files_below(places: dict[str, Path]) -> None:
    """precision: null in ./accelfn.yaml, as `accelfn config` writes an option not given, keeps
    the user file's precision."""
    write(places["xdg"] / "accelfn" / "config.yaml", "precision: bf16\n")
    write(places["cwd"] / "accelfn.yaml", "precision: null\nnproc_per_node: 2\n")
    assert resolve(places).config.precision == "bf16"
