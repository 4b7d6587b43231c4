"""The launch engines' variables (torchrun, Slurm, Open MPI, MPICH, Kubeflow) read into one world."""

from __future__ import annotations

import pytest

from accelfn.backends import LaunchEnv
from accelfn.cli import main, precedence
from accelfn.distributed.engines import expand_hostlist, tasks_per_node
from accelfn.errors import LaunchError

# what srun sets for task 3 of `srun --nodes=4 --ntasks=7` whose nodes run 2, 2, 2 and 1 tasks
SLURM_TASK_3 = {"SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "7",
                "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
                "SLURM_STEP_NODELIST": "node[01-03,07]", "SLURM_JOB_NODELIST": "node[01-04,07]",
                "SLURM_NODELIST": "node[01-04,07]"}


def world(env: LaunchEnv) -> tuple:
    return (env.engine, env.rank, env.world_size, env.local_rank, env.local_world_size, env.master_addr,
            env.master_port)


@pytest.mark.parametrize(("text", "hosts"), [
    ("vm", ["vm"]),
    ("node[01-04,07],gpu-a[1-2]", ["node01", "node02", "node03", "node04", "node07", "gpu-a1", "gpu-a2"]),
    ("a1,b[9-11]", ["a1", "b9", "b10", "b11"]),
    ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
])
def test_hostlists_expand_in_order_with_their_padding(text: str, hosts: list[str]) -> None:
    """Slurm's hostlist syntax expands to its hosts in order, zero padding kept."""
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["node[01-04", "node01]", "node[4-2]", "node[a-b]", ""])
def test_bad_hostlists_raise_launch_error_naming_the_variable(text: str) -> None:
    """A hostlist that does not parse is a LaunchError naming the variable and the text."""
    with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST="):
        expand_hostlist(text)


def test_tasks_per_node_expands_repeat_counts() -> None:
    """``2(x3),1`` is 2, 2, 2, 1 tasks; a malformed list is a LaunchError."""
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]
    with pytest.raises(LaunchError, match=r"SLURM_STEP_TASKS_PER_NODE='2\(3\)' is not a list"):
        tasks_per_node("2(3)")


def test_a_slurm_task_is_placed_from_slurm_s_variables() -> None:
    """Task 3 of 7 on the second node (2 tasks there): rank 3, local rank 1 of 2, rendezvous at
    the step's first node on the port derived from the job id, and the variables it read listed."""
    env = LaunchEnv.from_env(SLURM_TASK_3)
    assert world(env) == ("slurm", 3, 7, 1, 2, "node01", 10000 + 123456 % 20000)
    assert dict(env.engine_vars)["SLURM_STEP_TASKS_PER_NODE"] == "2(x3),1"
    assert dict(env.engine_vars)["SLURM_JOB_ID"] == "123456"
    last = LaunchEnv.from_env(dict(SLURM_TASK_3, SLURM_PROCID="6", SLURM_LOCALID="0", SLURM_NODEID="3"))
    assert world(last)[1:5] == (6, 7, 0, 1)


def test_slurm_s_other_variables_and_master_variables_are_used_where_set() -> None:
    """SLURM_NTASKS_PER_NODE, the job's node list, and MASTER_ADDR/MASTER_PORT override the derived values."""
    env = dict(SLURM_TASK_3, SLURM_NTASKS_PER_NODE="2")
    del env["SLURM_STEP_TASKS_PER_NODE"], env["SLURM_STEP_NODELIST"]
    assert world(LaunchEnv.from_env(env))[4:] == (2, "node01", 13456)
    env.pop("SLURM_JOB_NODELIST")
    env["SLURM_NODELIST"] = "gpu-a[3-4]"
    assert world(LaunchEnv.from_env(env))[5] == "gpu-a3"
    assert world(LaunchEnv.from_env(dict(env, MASTER_ADDR="10.0.0.9", MASTER_PORT="29400")))[5:] == ("10.0.0.9", 29400)


def test_torchrun_s_workers_inside_a_slurm_step_are_torchrun_s() -> None:
    """`srun accelfn launch`: the workers see Slurm's variables and torchrun's, and torchrun's win."""
    torchrun = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                "MASTER_ADDR": "node01", "MASTER_PORT": "29500"}
    env = LaunchEnv.from_env(dict(SLURM_TASK_3, SLURM_NTASKS="2", SLURM_PROCID="1", SLURM_LOCALID="0",
                                  SLURM_STEP_TASKS_PER_NODE="1(x2)", **torchrun))
    assert world(env) == ("torchrun", 5, 8, 1, 4, "node01", 29500)
    assert env.env_rendezvous


@pytest.mark.parametrize(("variables", "engine"), [
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, "openmpi"),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, "mpich"),
])
def test_mpi_ranks_on_one_node_meet_on_localhost(variables: dict[str, str], engine: str) -> None:
    """mpirun's rank 1 of 2 on one node: rank 1 of 2, rendezvous at 127.0.0.1:29500 unless MASTER_* say otherwise."""
    assert world(LaunchEnv.from_env(variables)) == (engine, 1, 2, 1, 2, "127.0.0.1", 29500)
    moved = LaunchEnv.from_env(dict(variables, MASTER_PORT="23456"))
    assert (moved.master_addr, moved.master_port, moved.env_rendezvous) == ("127.0.0.1", 23456, False)


def test_mpi_ranks_on_several_nodes_need_master_addr() -> None:
    """Open MPI ranks spread over nodes without MASTER_ADDR: a LaunchError; with it, their world."""
    spread = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
              "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(LaunchError, match="MASTER_ADDR is not set"):
        LaunchEnv.from_env(spread)
    assert world(LaunchEnv.from_env(dict(spread, MASTER_ADDR="n1"))) == ("openmpi", 3, 4, 1, 2, "n1", 29500)


def test_a_kubeflow_pytorchjob_pod_is_one_process_of_its_node() -> None:
    """PyTorchJob v1's variables for worker pod 2 of 4 (no LOCAL_RANK): rank 2, local rank 0 of 1."""
    pod = {"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "train-master-0", "MASTER_PORT": "23456",
           "PYTHONUNBUFFERED": "1"}
    assert world(LaunchEnv.from_env(pod)) == ("kubeflow", 2, 4, 0, 1, "train-master-0", 23456)


@pytest.mark.parametrize(("variables", "message"), [
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"},
     r"SLURM_NTASKS=2 says this job has 2 processes, but no engine's variables place this process in it "
     r"\(SLURM_STEP_ID is unset: this is a batch script"),
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "RANK": "0", "WORLD_SIZE": "1",
      "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, r"SLURM_NTASKS=2 says this job has 2 processes, but torchrun says 1"),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, r"OMPI_COMM_WORLD_SIZE=2 says this job has 2 processes, but no engine"),
    ({"PMI_SIZE": "3", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, r"PMI_SIZE=3 says .* torchrun says 1"),
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"},
     r"slurm: SLURM_PROCID=0, SLURM_NTASKS=2 are set but SLURM_LOCALID, SLURM_NODEID not"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"},
     r"openmpi: .* OMPI_COMM_WORLD_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_SIZE not"),
    ({"PMI_RANK": "x", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}, r"PMI_RANK='x' is not"),
    ({"PMI_RANK": "2", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"},
     r"PMI_RANK=2 is outside the world of PMI_SIZE=2"),
])
def test_an_engine_that_says_more_processes_than_accelfn_sees_is_an_error(variables: dict[str, str],
                                                                       message: str) -> None:
    """Several processes to the engine but one (or an incomplete placement) to accelfn: a LaunchError naming the variables."""
    with pytest.raises(LaunchError, match=message):
        LaunchEnv.from_env(variables)


# what the batch script of `sbatch --ntasks=4` (no step: no SLURM_STEP_ID) holds
SBATCH_NTASKS_4 = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_NPROCS": "4", "SLURM_PROCID": "0",
                   "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "4", "SLURM_JOB_NODELIST": "vm"}


def test_a_launch_from_a_batch_script_forms_its_own_world() -> None:
    """The workers of `accelfn launch --nproc-per-node 2` (or af.launch) started by the batch
    script of `sbatch --ntasks=4` are a torchrun world of 2: the job's 4 tasks are no claim on
    it outside a step; inside a step (`srun --ntasks=4 accelfn launch`, four launchers) they are."""
    worker = dict(SBATCH_NTASKS_4, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    assert world(LaunchEnv.from_env(worker)) == ("torchrun", 1, 2, 1, 2, "127.0.0.1", 29500)
    with pytest.raises(LaunchError, match=r"SLURM_NTASKS=4 says this job has 4 processes, but torchrun says 2"):
        LaunchEnv.from_env(dict(worker, SLURM_STEP_ID="0"))
    with pytest.raises(LaunchError, match=r"SLURM_NTASKS=4 says .* no engine's variables place this process"):
        LaunchEnv.from_env(SBATCH_NTASKS_4)  # `python train.py` alone in the batch script: still refused


def test_one_task_of_an_engine_is_one_process() -> None:
    """`srun --ntasks=1` and `mpirun -np 1`: a world of one, no rendezvous needed."""
    single = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
              "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_NODELIST": "vm"}
    assert world(LaunchEnv.from_env(single))[:5] == ("slurm", 0, 1, 0, 1)
    assert world(LaunchEnv.from_env({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"})) == ("none", 0, 1, 0, 1, None, None)


def test_accelfn_env_names_the_engine_and_the_values_it_took(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`accelfn env` in a Slurm task prints the engine, the variables read and the rendezvous address."""
    for name, value in SLURM_TASK_3.items():
        monkeypatch.setenv(name, value)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "launch environment: rank 3 of world size 7 (local rank 1 of 2)" in out
    assert ("launch engine: slurm (SLURM_PROCID=3, SLURM_NTASKS=7, SLURM_LOCALID=1, SLURM_STEP_TASKS_PER_NODE=2(x3),1, "
            "SLURM_NODEID=1, SLURM_STEP_NODELIST=node[01-03,07], SLURM_JOB_ID=123456); rendezvous node01:13456") in out


def test_kubeflow_trainer_v2_s_pet_variables_configure_accelfn_launch(tmp_path) -> None:
    """A TrainJob node's PET_* variables become accelfn launch's nodes, processes per node,
    node rank and static rendezvous; a flag still wins over them, and a bad one names it."""
    pet = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "trainjob-node-0-0",
           "PET_MASTER_PORT": "29400", "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path)}
    resolved = precedence.resolve(None, environ=pet, cwd=tmp_path)
    assert resolved.config.torchrun_args()[:4] == ["--nnodes", "2", "--nproc-per-node", "4"]
    assert resolved.config.torchrun_args()[6:12] == ["--master-addr", "trainjob-node-0-0", "--master-port", "29400",
                                                     "--node-rank", "1"]
    assert resolved.sources["nproc_per_node"] == "PET_NPROC_PER_NODE"
    flagged = precedence.resolve({"nproc_per_node": 2}, environ=dict(pet, ACCELFN_TIMEOUT_S="9"), cwd=tmp_path)
    assert (flagged.config.nproc_per_node, flagged.config.timeout_s) == (2, 9.0)
    with pytest.raises(LaunchError, match="PET_NPROC_PER_NODE='auto': must be an int"):
        precedence.resolve(None, environ=dict(pet, PET_NPROC_PER_NODE="auto"), cwd=tmp_path)


# what Kubeflow's training-operator v1 sets in pod 1 of a PyTorchJob of 2 pods (a Master and a Worker)
KUBEFLOW_POD_1 = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "train-master-0", "MASTER_PORT": "23456"}


def _resolve(environ: dict[str, str], tmp_path, flags: dict | None = None, **kwargs) -> precedence.Resolved:
    return precedence.resolve(flags, environ=dict(environ, HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path)),
                              cwd=tmp_path, **kwargs)


def test_accelfn_launch_in_a_kubeflow_pod_joins_the_job_as_node_rank_of_world_size(tmp_path) -> None:
    """`accelfn launch --nproc-per-node 4` in pod 1 of 2 is node 1 of 2 nodes at MASTER_ADDR:MASTER_PORT
    (a static rendezvous), over a config file's `nnodes: 1`; a flag that says another node
    count is refused, and `--rdzv-endpoint` keeps the engine's address out."""
    (tmp_path / "accelfn.yaml").write_text("nnodes: 1\nnode_rank: 0\n")  # as `accelfn config` writes them
    resolved = _resolve(KUBEFLOW_POD_1, tmp_path, {"nproc_per_node": 4})
    assert resolved.config.torchrun_args() == [
        "--nnodes", "2", "--nproc-per-node", "4", "--max-restarts", "0", "--master-addr", "train-master-0",
        "--master-port", "23456", "--node-rank", "1", "--rdzv-conf", "timeout=600"]
    assert {k: resolved.sources[k] for k in ("nnodes", "node_rank", "master_addr", "master_port")} == {
        "nnodes": "WORLD_SIZE", "node_rank": "RANK", "master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT"}
    with pytest.raises(LaunchError, match=r"--nnodes 1, but kubeflow \(RANK=1, WORLD_SIZE=2\) says this launcher "
                                          r"is process 1 of 2: a launch of its own would train alone"):
        _resolve(KUBEFLOW_POD_1, tmp_path, {"nnodes": 1, "nproc_per_node": 4})
    same = _resolve(KUBEFLOW_POD_1, tmp_path, {"nnodes": 2, "node_rank": 1, "master_addr": "train-master-0",
                                               "master_port": 23456})  # the torchrun idiom, spelled out
    assert same.config.torchrun_args() == _resolve(KUBEFLOW_POD_1, tmp_path).config.torchrun_args()
    endpoint = _resolve(KUBEFLOW_POD_1, tmp_path, {"rdzv_endpoint": "train-master-0:29400"})
    assert endpoint.config.torchrun_args()[:2] == ["--nnodes", "2"] and endpoint.config.master_addr is None


def test_a_launcher_started_by_srun_or_mpirun_joins_their_job_and_a_nested_one_does_not(tmp_path) -> None:
    """Task 3 of an srun step of 7 is node 3 of 7 at the step's first node and its job's port;
    a launch inside torchrun's workers, one task alone, Kubeflow Trainer v2's PET_* variables
    (torchrun's own options) and `accelfn test` (placed=False) join nothing."""
    slurm = _resolve(SLURM_TASK_3, tmp_path).config
    assert (slurm.nnodes, slurm.node_rank, slurm.master_addr, slurm.master_port) == (7, 3, "node01", 13456)
    mpi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert _resolve(mpi, tmp_path).config.torchrun_args()[6:12] == [
        "--master-addr", "127.0.0.1", "--master-port", "29500", "--node-rank", "1"]
    worker = dict(KUBEFLOW_POD_1, LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
    alone = dict(KUBEFLOW_POD_1, WORLD_SIZE="1", RANK="0")
    pet = dict(KUBEFLOW_POD_1, PET_NNODES="2", PET_NODE_RANK="1", PET_NPROC_PER_NODE="4", WORLD_SIZE="8",
               PET_MASTER_ADDR="train-master-0", PET_MASTER_PORT="23456")  # WORLD_SIZE: 2 pods x 4
    for environ, kwargs in ((worker, {}), (alone, {}), (KUBEFLOW_POD_1, {"placed": False})):
        config = _resolve(environ, tmp_path, **kwargs).config
        assert (config.nnodes, config.node_rank, config.master_addr) == (1, 0, None)
    assert _resolve(pet, tmp_path).config.torchrun_args()[:6] == ["--nnodes", "2", "--nproc-per-node", "4",
                                                                  "--max-restarts", "0"]


def test_af_launch_in_a_process_an_engine_placed_among_several_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """af.launch in a Kubeflow pod of 2 (or a task of an srun step of 7) raises LaunchError before
    starting anything: its world would be the pod's own."""
    import accelfn as af

    for name, value in KUBEFLOW_POD_1.items():
        monkeypatch.setenv(name, value)
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(LaunchError, match=r"af.launch starts workers on this machine alone, but kubeflow \(RANK=1, "
                                          r"WORLD_SIZE=2\) started this process as process 1 of 2"):
        af.launch(print, nproc_per_node=2)


def test_accelfn_env_reports_an_invalid_placement_and_goes_on(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`accelfn env` with a stray RANK (no WORLD_SIZE) says the launch environment is invalid and
    still prints the launch config, the defaults (a bug report needs the rest)."""
    for name in ("WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "launch environment: invalid: RANK is set but WORLD_SIZE is not" in out
    assert "\n  nnodes: 1\n" in out
