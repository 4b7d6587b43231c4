"""The `accelfn` command in-process: torchrun arguments, the YAML config, `env`, `--help`, errors."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import attrs
import pytest
import torch

import accelfn
from accelfn.backends import LaunchEnv
from accelfn.cli import _loopback
from accelfn.cli import commands as cli
from accelfn.cli import config as launch_config
from accelfn.cli.config import LaunchConfig
from accelfn.errors import LaunchError


def test_one_node_without_a_port_meets_at_the_launchers_loopback_store() -> None:
    """One node with no port or endpoint meets at the c10d store the launcher hosts on 127.0.0.1
    (its workers' address 127.0.0.1 too); without that store's port, torchrun's --standalone."""
    args = LaunchConfig(nproc_per_node=4).torchrun_args(loopback_port=41000)
    assert args == ["--nnodes", "1", "--nproc-per-node", "4", "--max-restarts", "0", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", "127.0.0.1:41000", "--rdzv-id", "accelfn", "--local-addr", "127.0.0.1",
                    "--rdzv-conf", "join_timeout=600"]
    assert LaunchConfig(nproc_per_node=4).torchrun_args()[6:] == ["--standalone", "--rdzv-conf", "join_timeout=600"]


@pytest.mark.parametrize(("fields", "on_this_machine"), [
    ({}, True), ({"master_port": 29500}, True), ({"master_addr": "127.0.0.2", "master_port": 29500}, True),
    ({"master_addr": "10.0.0.1", "master_port": 29500}, False), ({"rdzv_endpoint": "localhost:29400"}, False),
    ({"nnodes": 2, "master_addr": "127.0.0.1", "master_port": 29500}, False),
])
def test_only_a_job_on_this_machine_alone_is_put_on_loopback(fields: dict, on_this_machine: bool) -> None:
    """One node (no endpoint, no address but a loopback one) hosts its rendezvous on loopback and
    puts gloo on the loopback interface, unless GLOO_SOCKET_IFNAME is set; other jobs are torch's."""
    config = LaunchConfig(**fields)
    assert _loopback.on_this_machine(config) is on_this_machine
    interface = _loopback.loopback_interface()
    expected = {"GLOO_SOCKET_IFNAME": interface} if on_this_machine and interface else {}
    assert _loopback.worker_variables(config, {}) == expected
    assert _loopback.worker_variables(config, {"GLOO_SOCKET_IFNAME": "eth1"}) == {}


def test_master_address_and_port_give_a_static_rendezvous() -> None:
    """--master-addr/--master-port/--node-rank are passed to torchrun as they are, with the
    timeout (rounded up to whole seconds) as the static rendezvous's."""
    config = LaunchConfig(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500, max_restarts=2,
                          timeout_s=7.5)
    assert config.torchrun_args() == ["--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "2",
                                      "--master-addr", "10.0.0.1", "--master-port", "29500", "--node-rank", "1",
                                      "--rdzv-conf", "timeout=8"]


@pytest.mark.parametrize(("backend", "key"), [("c10d", "join_timeout"), ("etcd-v2", "join_timeout"),
                                              ("etcd", "timeout"), ("static", "timeout")])
def test_rdzv_endpoint_gives_a_c10d_rendezvous(backend: str, key: str) -> None:
    """--rdzv-endpoint selects the rendezvous backend with the shared job id, and the timeout
    under the name that backend reads."""
    config = LaunchConfig(nnodes=2, rdzv_endpoint="host:29400", rdzv_id="job7", rdzv_backend=backend, timeout_s=30)
    assert config.torchrun_args()[-8:] == ["--rdzv-backend", backend, "--rdzv-endpoint", "host:29400",
                                           "--rdzv-id", "job7", "--rdzv-conf", f"{key}=30"]


@pytest.mark.parametrize(("fields", "message"), [
    ({"nnodes": 2}, "--nnodes 2 needs the address of node 0"),
    ({"nnodes": 2, "master_addr": "h"}, "--nnodes 2 needs the address of node 0"),
    ({"nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"}, "--node-rank 2 is outside --nnodes 2"),
    ({"master_port": 1234, "rdzv_endpoint": "h:1"}, "not both"),
    ({"master_addr": "h"}, "--master-addr h needs --master-port too"),
])
def test_inconsistent_launch_options_are_rejected(fields: dict, message: str) -> None:
    """Options that cannot form a job raise LaunchError naming the options."""
    with pytest.raises(LaunchError, match=message):
        LaunchConfig(**fields).torchrun_args()


def test_launch_error_exits_with_status_two_before_starting_anything(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`launch --nnodes 2` without an address, or a missing script, exits 2 with a message."""
    script = tmp_path / "train.py"
    script.write_text("")
    assert cli.main(["launch", "--nnodes", "2", str(script)]) == 2
    assert "--nnodes 2 needs the address of node 0" in capsys.readouterr().err
    assert cli.main(["launch", str(tmp_path / "missing.py")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_arguments_after_the_script_belong_to_the_script() -> None:
    """Options after SCRIPT, even the launcher's own names, are passed to the script unchanged."""
    args = cli.build_parser().parse_args(["launch", "--nproc-per-node", "2", "t.py", "--nproc-per-node", "3", "-m"])
    assert (args.nproc_per_node, args.script, args.module) == (2, "t.py", False)
    assert args.script_args == ["--nproc-per-node", "3", "-m"]


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return commands.choices[name]


def _script_commands() -> list[str]:
    """The subcommands that take a SCRIPT and its arguments."""
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return [name for name, sub in commands.choices.items()
            if any(a.dest == "script_args" for a in sub._actions)]  # noqa: SLF001


def test_script_options_that_start_like_a_launcher_flag_are_the_scripts() -> None:
    """After SCRIPT, every prefix of every flag of `launch` and `plan` (`--n`, `--timeout`,
    `--shard`, `--master`, ...), alone, with a value or with `=value`, reaches the script
    unchanged: no abbreviation is expanded, no "ambiguous option" error stops the command."""
    assert _script_commands() == ["launch", "plan"]
    parser = cli.build_parser()
    for command in _script_commands():
        flags = {o for a in _subparser(command)._actions for o in a.option_strings}  # noqa: SLF001
        prefixes = sorted({flag[:n] for flag in flags for n in range(2, len(flag) + 1)} - {"--"})
        assert {"--n", "--timeout", "--shard", "--master", "--nproc", "-m"} <= set(prefixes)
        for prefix in prefixes:
            for script_args in ([prefix], [prefix, "7"], [f"{prefix}=7"], ["--lr", "3", prefix]):
                args = parser.parse_args([command, "--nproc-per-node", "2", "t.py", *script_args])
                assert (args.command, args.script, args.nproc_per_node) == (command, "t.py", 2)
                assert args.script_args == script_args, (command, script_args)


def test_launch_help_documents_every_flag() -> None:
    """Every option of `accelfn launch` has help text in --help, and every config field has a flag."""
    launch = _subparser("launch")
    text = launch.format_help()
    for action in launch._actions:  # noqa: SLF001
        assert action.help, action.dest
        for option in action.option_strings:
            assert option in text, option
    flags = {action.dest for action in launch._actions}  # noqa: SLF001
    assert {f.name for f in attrs.fields(LaunchConfig)} - {"min_nnodes"} <= flags
    assert "MIN:MAX" in text  # min_nnodes is the flag --nnodes MIN:MAX's lower bound


def _every_field_changed() -> LaunchConfig:
    return LaunchConfig(nproc_per_node=3, nnodes=2, node_rank=1, master_addr=None, master_port=None,
                        rdzv_endpoint="h:29400", rdzv_backend="static", rdzv_id="j", max_restarts=4,
                        backend="cuda", precision="fp16", timeout_s=12.5)


def test_config_round_trips_through_yaml(tmp_path: Path) -> None:
    """A launch config written to YAML reads back equal, for every field."""
    config = _every_field_changed()
    path = launch_config.save(config, tmp_path / "c.yaml")
    assert launch_config.load(path) == config
    assert launch_config.from_yaml("") == LaunchConfig()


def test_config_command_writes_the_flags_given(tmp_path: Path) -> None:
    """`accelfn config FLAGS -o FILE` writes those flags over the defaults."""
    out = tmp_path / "c.yaml"
    assert cli.main(["config", "--nproc-per-node", "2", "--backend", "cpu", "--timeout-s", "30", "-o", str(out)]) == 0
    assert launch_config.load(out) == LaunchConfig(nproc_per_node=2, backend="cpu", timeout_s=30.0)


def test_interactive_config_reads_answers_and_asks_again_after_a_bad_one(tmp_path: Path) -> None:
    """--interactive asks each field not given as a flag; an invalid answer is explained and asked again."""
    names = [f.name for f in attrs.fields(LaunchConfig) if f.name != "backend"]
    answers = {"nproc_per_node": ["0", "two", "4"], "precision": ["bf16"], "timeout_s": ["90"], "rdzv_id": ["123"],
               "rdzv_endpoint": ["10:30"], "master_port": ["null"]}
    lines = []
    for name in names:
        lines.extend(answers.get(name, [""]))
    stdout = io.StringIO()
    args = cli.build_parser().parse_args(
        ["config", "--interactive", "--backend", "cpu", "-o", str(tmp_path / "c.yaml")])
    assert cli._write_config(args, stdin=io.StringIO("\n".join(lines) + "\n"), stdout=stdout) == 0  # noqa: SLF001
    assert launch_config.load(tmp_path / "c.yaml") == LaunchConfig(
        nproc_per_node=4, precision="bf16", timeout_s=90.0, rdzv_id="123", rdzv_endpoint="10:30", backend="cpu")
    assert "nproc_per_node=0: must be >= 1" in stdout.getvalue()
    assert "nproc_per_node='two': must be an int" in stdout.getvalue()
    assert "backend (cpu/cuda/xla)" not in stdout.getvalue()  # given as a flag: not asked


@pytest.mark.parametrize(("text", "message"), [
    ("nproc_per_nodes: 2\n", "unknown launch option.*nproc_per_nodes"),
    ("backend: tpu\n", "backend='tpu': accepted values are cpu, cuda, xla"),
    ("nproc_per_node: 0\n", "nproc_per_node=0: must be >= 1"),
    ("timeout_s: .inf\n", "timeout_s=inf: must be a finite number of seconds > 0"),
    ("- 1\n", "must hold a mapping"),
    ("a: [\n", "not valid YAML"),
    ("nproc_per_node: 2\nnproc_per_node: 3\n", "the key 'nproc_per_node' is given twice"),
])
def test_bad_config_files_name_the_problem(text: str, message: str) -> None:
    """An unknown key, a bad value, a key given twice or a non-mapping in a config file
    raises LaunchError naming it."""
    with pytest.raises(LaunchError, match=message):
        launch_config.from_yaml(text, source="bad.yaml")


@pytest.mark.parametrize(("text", "message"), [
    ("nproc_per_node: 2.5\n", "nproc_per_node=2.5: must be an int, got a float"),
    ("nproc_per_node: true\n", "nproc_per_node=true: must be an int, got a boolean"),
    ("nproc_per_node: two\n", "nproc_per_node='two': must be an int, got a string"),
    ("nproc_per_node: '2'\n", "nproc_per_node='2': must be an int, got a string"),
    ("master_port: 29500.0\n", "master_port=29500.0: must be an int or null, got a float"),
    ("timeout_s: yes\n", "timeout_s=true: must be a number, got a boolean"),
    ("rdzv_id: 7\n", "rdzv_id=7: must be a string, got an int (quote it to make it a string)"),
    ("nnodes: 1.0\nbackend: 3\n",
     "nnodes=1.0: must be an int, got a float; backend=3: must be a string or null, got an int "
     "(quote it to make it a string)"),
])
def test_config_values_of_the_wrong_type_are_not_coerced(text: str, message: str) -> None:
    """A value of the wrong type in a config file (a float, boolean or string for an int, a
    number for a string) raises LaunchError naming the file, the key, the value and the type
    expected, instead of being truncated or converted."""
    with pytest.raises(LaunchError) as error:
        launch_config.from_yaml(text, source="bad.yaml")
    assert str(error.value) == f"bad.yaml: {message}"


def test_config_takes_an_int_where_seconds_are_asked() -> None:
    """timeout_s: 120 (a YAML int) is 120.0 seconds; a quoted number stays a string."""
    assert launch_config.from_yaml("timeout_s: 120\nrdzv_id: '7'\n") == LaunchConfig(timeout_s=120.0, rdzv_id="7")


def test_launch_with_a_float_process_count_in_the_config_starts_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`accelfn launch --config bad.yaml` with nproc_per_node: 2.5 exits 2 naming the file and the key."""
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('a worker started')\n")
    config = tmp_path / "bad.yaml"
    config.write_text("nproc_per_node: 2.5\n")
    assert cli.main(["launch", "--config", str(config), str(script)]) == 2
    assert capsys.readouterr().err == (f"accelfn launch: error: {config}: nproc_per_node=2.5: must be an int, "
                                       "got a float\n")


@pytest.mark.parametrize(("stdin", "answered"), [("", 0), ("4\n\n", 2)])
def test_interactive_config_without_answers_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str], stdin: str,
                                                           answered: int) -> None:
    """`accelfn config --interactive` whose standard input ends before every question is
    answered exits 2, says how many were answered, and writes no file."""
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    out = tmp_path / "c.yaml"
    assert cli.main(["config", "--interactive", "-o", str(out)]) == 2
    asked = [f.name for f in attrs.fields(LaunchConfig)]
    assert (f"accelfn config: error: --interactive: standard input ended before the answer to {asked[answered]} "
            f"({answered} of {len(asked)} questions answered); nothing was written") in capsys.readouterr().err
    assert not out.exists()


def test_env_prints_versions_devices_backends_and_the_config(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`accelfn env` names the accelfn/torch/python versions, gloo and torch_xla availability and the config."""
    path = launch_config.save(LaunchConfig(nproc_per_node=5, precision="bf16"), tmp_path / "c.yaml")
    assert cli.main(["env", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"accelfn: {accelfn.__version__}" in out
    assert f"torch: {torch.__version__}" in out
    assert "python: 3." in out and "platform: " in out
    assert "packages: numpy " in out and "cattrs " in out
    assert "gloo (CPU processes): yes" in out
    assert f"cuda: {'yes' if torch.cuda.is_available() else 'no'}" in out
    assert "torch_xla: " in out
    assert f"launch config ({path}):" in out
    assert "nproc_per_node: 5" in out and "precision: bf16" in out
    assert "launch environment: rank 0 of world size 1" in out


@pytest.mark.parametrize(("environ", "message"), [
    ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is outside the world of WORLD_SIZE=2"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "1", "WORLD_SIZE": "2"}, "MASTER_ADDR/MASTER_PORT are not set"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "1"}, "LOCAL_RANK=1 is outside"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "3"}, "LOCAL_WORLD_SIZE=3 must be in 1..WORLD_SIZE=2"),
    ({"ACCELFN_BACKEND": "tpu"}, "ACCELFN_BACKEND='tpu': accepted values are cpu, cuda, xla"),
    ({"ACCELFN_PRECISION": "fp12"}, "ACCELFN_PRECISION='fp12': accepted values"),
    ({"ACCELFN_TIMEOUT_S": "0"}, "ACCELFN_TIMEOUT_S=0 must be a finite number of seconds > 0"),
    ({"ACCELFN_TIMEOUT_S": "inf"}, "ACCELFN_TIMEOUT_S=inf must be a finite number of seconds > 0"),
])
def test_bad_launch_variables_raise_launch_error(environ: dict[str, str], message: str) -> None:
    """Missing or inconsistent launch variables raise LaunchError naming the variable."""
    with pytest.raises(LaunchError, match=message):
        LaunchEnv.from_env(environ)


def test_launch_variables_are_read_into_the_launch_env() -> None:
    """A torchrun-style environment is read into the matching LaunchEnv fields."""
    env = LaunchEnv.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                              "MASTER_ADDR": "h", "MASTER_PORT": "29500", "ACCELFN_BACKEND": "cpu",
                              "ACCELFN_PRECISION": "bf16", "ACCELFN_TIMEOUT_S": "7.5"})
    assert attrs.evolve(env, engine_vars=()) == LaunchEnv(rank=3, local_rank=1, world_size=4, local_world_size=2, master_addr="h",
                            master_port=29500, backend="cpu", precision="bf16", timeout_s=7.5, engine="torchrun")


@pytest.mark.parametrize(("argv", "message"), [
    (["launch"], "accelfn launch: error: the training SCRIPT is missing"),
    (["launch", "--bogus", "x.py"], "accelfn launch: error: unrecognized arguments: --bogus"),
    (["env", "--bogus"], "accelfn env: error: unrecognized arguments: --bogus"),
])
def test_usage_errors_show_the_command_s_own_usage(argv: list[str], message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A missing script or an unknown option exits with status 2 and the command's usage."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith(f"usage: accelfn {argv[0]} ")


def test_config_warns_when_the_file_cannot_be_launched_as_it_is(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`accelfn config --nnodes 2` without node 0's address writes the file (the nodes may add
    the address as flags) and warns that it cannot be launched as it is."""
    out = tmp_path / "two.yaml"
    assert cli.main(["config", "--nnodes", "2", "-o", str(out)]) == 0
    assert launch_config.load(out).nnodes == 2
    assert "cannot be launched as it is: --nnodes 2 needs the address of node 0" in capsys.readouterr().err
