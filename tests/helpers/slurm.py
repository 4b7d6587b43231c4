"""A real one-node Slurm cluster on localhost for tests: munged, slurmctld and slurmd.

Debian's ``slurm-wlm`` package provides the daemons (``.ci/run`` installs it where
``apt-get`` is available). ``Cluster.start(folder)`` writes a minimal ``slurm.conf`` (one
node of 2 CPUs named after this host, one partition, no accounting, no cgroups, 60 s
between a job's SIGTERM and its SIGKILL, job ids from a random start so that the ports
derived from them differ between clusters), its own
munge key and socket, starts the three daemons in the foreground as child processes of the
test process and waits until the node is idle; ``stop`` ends them by their process ids.
Clients (``srun``, ``sbatch``, ``scancel``, ``squeue``) find the cluster through
``SLURM_CONF``, given by ``Cluster.env``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scancel", "sinfo", "squeue", "scontrol")
START_TIMEOUT_S = 90


def missing() -> list[str]:
    """The Slurm and munge programs this machine lacks (empty: a cluster can start)."""
    return [name for name in DAEMONS if shutil.which(name) is None
            and not Path("/usr/sbin", name).exists()]


def _program(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """A started one-node cluster; ``env`` is the environment its clients need."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.node = socket.gethostname().split(".")[0]
        self.procs: list[subprocess.Popen] = []
        self.conf = folder / "slurm.conf"
        self.munge_socket = folder / "munge.socket"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    @classmethod
    def start(cls, folder: Path) -> Cluster:
        """Writes the configuration, starts munged, slurmctld and slurmd, and waits until the node is idle.

        Raises:
            RuntimeError: a daemon exited, or the node was not idle within START_TIMEOUT_S
                (the message holds the daemons' logs).
        """
        cluster = cls(folder)
        try:
            cluster._start()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start(self) -> None:
        f = self.folder
        for sub in ("state", "spool", "munge"):
            (f / sub).mkdir(parents=True, exist_ok=True)
        key = f / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(128))
        key.chmod(0o600)
        (f / "munge").chmod(0o700)
        self._daemon([_program("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
                      f"--key-file={key}", f"--log-file={f / 'munged.log'}", f"--pid-file={f / 'munge' / 'pid'}",
                      f"--seed-file={f / 'munge' / 'seed'}"], "munged.out")
        self._wait(lambda: self.munge_socket.exists(), "munged's socket")
        user = os.environ.get("USER") or "root"
        self.conf.write_text(f"""\
ClusterName=accelfn
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={f / 'state'}
SlurmdSpoolDir={f / 'spool'}
SlurmctldPidFile={f / 'slurmctld.pid'}
SlurmdPidFile={f / 'slurmd.pid'}
SlurmctldLogFile={f / 'slurmctld.log'}
SlurmdLogFile={f / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=60
FirstJobId={secrets.randbelow(15000) + 1000}
MinJobAge=300
NodeName={self.node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        self._daemon([_program("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld.out")
        self._daemon([_program("slurmd"), "-D", "-f", str(self.conf), "-N", self.node], "slurmd.out")
        self._wait(self._idle, "the node to be idle")

    def _daemon(self, command: list[str], log: str) -> None:
        with (self.folder / log).open("w") as out:
            self.procs.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                               start_new_session=True))

    def _idle(self) -> bool:
        result = subprocess.run([_program("sinfo"), "-h", "-o", "%t"], env=self.env, capture_output=True, text=True)
        return result.stdout.strip() in ("idle", "mix")

    def _wait(self, ready: object, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():  # type: ignore[operator]
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"waiting for {what}: {'exited: ' + ', '.join(map(str, dead)) if dead else 'timed out'}"
                                   f"\n{self.logs()}")
            time.sleep(0.5)

    def logs(self) -> str:
        """The tail of each daemon's log."""
        parts = []
        for path in sorted(self.folder.glob("*.log")) + sorted(self.folder.glob("*.out")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    def run(self, *command: str | os.PathLike[str], cwd: Path | None = None, timeout_s: float = 300,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Runs a Slurm client command (``srun ...``, ``sbatch ...``) to completion."""
        return subprocess.run([str(c) for c in command], cwd=cwd, env=dict(self.env, **(env or {})),
                              capture_output=True, text=True, timeout=timeout_s)

    def state(self, job_id: str) -> str:
        """The job's state as ``squeue`` shows it (``RUNNING``, ``COMPLETING``, ...), "" once it left the queue."""
        result = self.run("squeue", "-h", "-j", job_id, "-o", "%T", timeout_s=60)
        return result.stdout.strip()

    def stop(self) -> None:
        """Ends the daemons this cluster started (by their process ids), newest first."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
