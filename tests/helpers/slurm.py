"""A real one-node SLURM cluster for the tests: Debian's slurm-wlm, started, not mocked.

`slurm_cluster` (session scope) writes a slurm.conf into a temporary folder (`AuthType=auth/none`, so
no munge; state, spool, logs and pid files in that folder; free ports), starts `slurmctld -D` and
`slurmd -D` on it as children of the test process, waits for `sinfo` to show the node idle and yields
a `Cluster`: its `env` (SLURM_CONF) is what a command needs to reach it. At the end every job is
cancelled, the job steps are waited for, and both daemons are stopped by their pids.

Where slurm is not installed (or the tests do not run as root, which slurmd needs) the tests skip with
the reason; under CI=true they fail instead, so CI cannot skip them silently (.ci/run installs
slurm-wlm).
"""

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

from tests.helpers.runs import free_port

DAEMONS = ("slurmctld", "slurmd")
COMMANDS = ("sbatch", "srun", "sinfo", "squeue", "scontrol", "scancel")
PARTITION = "debug"


def missing() -> Optional[str]:
    """Why a test cluster cannot be started here, or None."""
    absent = [c for c in (*DAEMONS, *COMMANDS) if shutil.which(c) is None]
    if absent:
        return f"slurm is not installed ({', '.join(absent)} not found): apt-get install slurm-wlm"
    if os.geteuid() != 0:
        return "the test cluster's slurmd runs as root: run the SLURM tests as root"
    return None


def skip_or_fail(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true, so the SLURM tests must run: {reason}", pytrace=False)
    pytest.skip(reason)


@dataclass
class Cluster:
    folder: Path
    node: str
    cpus: int
    partition: str = PARTITION
    env: dict = field(default_factory=dict)
    _daemons: list = field(default_factory=list)

    def run(self, *cmd: str, check: bool = True, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        """A slurm command (or any command) against this cluster."""
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                env={**self.env, **kw.pop("env", {})}, **kw)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
                                 f"\n{self.logs()}")
        return result

    def job_ids(self) -> list[str]:
        out = self.run("squeue", "-h", "-o", "%i").stdout
        return out.split()

    def logs(self, lines: int = 30) -> str:
        out = []
        for path in sorted((self.folder / "log").glob("*")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(out)


def memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 1024


def write_conf(folder: Path, node: str, cpus: int) -> Path:
    for sub in ("state", "spool", "log"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    conf = folder / "slurm.conf"
    conf.write_text(f"""\
# a one-node test cluster (tests/helpers/slurm.py); no munge, no accounting daemon
ClusterName=sparse-attention-test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/log/slurmctld.log
SlurmdLogFile={folder}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
KillWait=5
# job ids (and so the MASTER_PORT an srun step derives from its job id) differ between test clusters
# running at once on one machine (pytest -n: one per worker)
FirstJobId={random.randint(1000, 60_000_000)}
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={max(256, memory_mb() * 3 // 4)} State=UNKNOWN
PartitionName={PARTITION} Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
""")
    return conf


def start(folder: Path) -> Cluster:
    node, cpus = socket.gethostname().split(".")[0], os.cpu_count() or 1
    conf = write_conf(folder, node, cpus)
    cluster = Cluster(folder, node, cpus, env={**os.environ, "SLURM_CONF": str(conf)})
    for name in DAEMONS:
        out = open(folder / "log" / f"{name}.out", "w")
        cmd = [name, "-D"] + (["-N", node] if name == "slurmd" else [])
        cluster._daemons.append(subprocess.Popen(cmd, env=cluster.env, stdout=out, stderr=subprocess.STDOUT,
                                                 start_new_session=True))
        out.close()
    deadline = time.time() + 30
    while True:
        states = cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.split()
        if states and all(s == "idle" for s in states):
            return cluster
        dead = [p.args[0] for p in cluster._daemons if p.poll() is not None]
        if dead or time.time() > deadline:
            logs = cluster.logs()
            stop(cluster)
            raise RuntimeError(f"the test cluster did not come up ({', '.join(dead) or 'node ' + str(states)}):\n{logs}")
        time.sleep(0.2)


def stop(cluster: Cluster) -> None:
    """Cancel every job, wait for their steps to end, then stop slurmd and slurmctld by pid."""
    if all(p.poll() is None for p in cluster._daemons):
        cluster.run("scancel", "--full", "--user", "root", check=False)
        deadline = time.time() + 20
        while time.time() < deadline and (cluster.run("squeue", "-h", check=False).stdout.strip()
                                          or any(p.is_socket() for p in (cluster.folder / "spool").iterdir())):
            time.sleep(0.2)  # a job step's socket in the spool: its slurmstepd still runs
    for proc in reversed(cluster._daemons):  # slurmd first
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    if reason := missing():
        skip_or_fail(reason)
    cluster = start(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        stop(cluster)
