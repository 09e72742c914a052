"""A real one-node SLURM cluster for the tests (not a test module; test_slurm.py imports its
fixture).

Debian's slurm-wlm and munge (installed by `make system-deps`, part of `make test`) started
as plain child processes, no systemd: munged, slurmctld and slurmd, in the foreground so that
the fixture owns them. Everything they use (slurm.conf, munge key and socket, state and spool
directories, logs, pid files) lives in one temporary directory and the ports are free ones,
so the machine's own SLURM/munge setup is untouched and several clusters can run side by side.
Client commands reach this cluster through SLURM_CONF in ``SlurmCluster.env``.

Skips, with the reason, when not root (slurmd starts jobs as their users) or when the
binaries are missing; under CI (CI set) missing binaries fail instead, because CI must run
these tests and a skip there would hide a broken install step.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")
# Daemons live in sbin, which a non-login PATH may lack.
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
# Seconds a requeued job waits before it may start again (Slurm's cred_expire, 120 by default,
# which the test would otherwise sit through); long enough for a slow step launch here.
CRED_EXPIRE_S = 10


def _which(name: str) -> str | None:
    return shutil.which(name, path=SEARCH_PATH)


def missing_requirement() -> str | None:
    """Why a cluster cannot be started here, or None."""
    if os.name != "posix" or os.geteuid() != 0:
        return "needs root: slurmd starts each job as its owner"
    missing = [name for name in (*DAEMONS, "mungekey", *CLIENTS) if _which(name) is None]
    if missing:
        return (
            f"{', '.join(missing)} not found: install Debian's slurm-wlm and munge "
            "(`make system-deps` does it as root with apt-get)"
        )
    return None


def _die_with_parent() -> None:
    """In the daemon between fork and exec: SIGTERM when the test process dies, even by
    SIGKILL, so that no cluster outlives its tests (teardown does not run then)."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_cpus() -> tuple[str, int]:
    """This machine's node name and CPU count as slurmd itself sees them (`slurmd -C`)."""
    out = subprocess.run(
        [_which("slurmd"), "-C"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    fields = dict(tok.split("=", 1) for tok in out.split() if "=" in tok)
    return fields["NodeName"], int(fields.get("CPUs", "1"))


SLURM_CONF = """\
ClusterName=tacotest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire={cred_expire}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig={root}/plugstack.conf
MailProg=/bin/true
# No cgroups in a container: track processes through /proc, bind no tasks.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Schedule right after a requeued job becomes eligible, not on the next 60 s pass.
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
JobRequeue=1
ReturnToService=2
# Finished jobs stay visible to scontrol for the test's checks.
MinJobAge=600
# The node as configured, whatever the hardware reports: the tiny job needs 2 CPUs.
SlurmdParameters=config_overrides
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
# Preemption as on a shared cluster: a job in `urgent` that needs the node preempts the jobs
# of `debug`, which get SIGTERM and GraceTime seconds before SIGKILL, and are then requeued.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=debug Nodes={host} Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime=60
PartitionName=urgent Nodes={host} PriorityTier=2 PreemptMode=OFF
"""


@dataclass
class SlurmCluster:
    root: Path
    host: str
    env: dict[str, str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def run(self, *cmd: str, timeout: float = 60, check: bool = True):
        res = subprocess.run(
            [_which(cmd[0]) or cmd[0], *cmd[1:]],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and res.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd)} exited {res.returncode}\n{res.stdout}\n{res.stderr}\n"
                + self.logs()
            )
        return res

    def sbatch(self, script: str, *options: str, cwd: str | Path, env: dict[str, str]) -> str:
        """Submit ``script`` from ``cwd`` with ``env`` (sbatch passes it on to the job)."""
        res = subprocess.run(
            [_which("sbatch"), "--parsable", *options, script],
            cwd=cwd,
            env={**env, "SLURM_CONF": self.env["SLURM_CONF"]},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, f"sbatch failed: {res.stderr}\n{self.logs()}"
        return res.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        return dict(tok.split("=", 1) for tok in out.split() if "=" in tok)

    def logs(self, lines: int = 30) -> str:
        parts = []
        for log in sorted((self.root / "log").glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    def wait_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}\n{self.logs()}")
            res = self.run("sinfo", "-h", "-N", "-o", "%t", check=False, timeout=10)
            state = res.stdout.strip()
            # One line per node and partition.
            if res.returncode == 0 and set(state.split()) == {"idle"}:
                return
            time.sleep(0.5)
        raise RuntimeError(f"node not idle after {timeout} s (state {state!r})\n{self.logs()}")

    def stop(self) -> None:
        # Jobs first, while slurmd still runs: slurmstepd outlives slurmd and would leave the
        # job's processes behind.
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--partition=debug", check=False, timeout=20)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                res = self.run("squeue", "-h", "-o", "%i", check=False, timeout=10)
                if res.returncode != 0 or not res.stdout.strip():
                    break
                time.sleep(0.5)
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _start(root: Path) -> SlurmCluster:
    host, cpus = _node_cpus()
    for sub in ("state", "spool", "run", "log", "munge"):
        (root / sub).mkdir()
    # munged wants its key private and the directories above its socket open to everyone.
    os.chmod(root, 0o755)
    os.chmod(root / "munge", 0o700)
    key = root / "munge" / "munge.key"
    subprocess.run(
        [_which("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True
    )
    os.chmod(key, 0o400)
    munge_socket = root / "run" / "munge.sock"
    conf = root / "slurm.conf"
    conf.write_text(
        SLURM_CONF.format(
            host=host,
            cpus=max(cpus, 2),
            root=root,
            ctld_port=_free_port(),
            slurmd_port=_free_port(),
            munge_socket=munge_socket,
            cred_expire=CRED_EXPIRE_S,
        )
    )
    (root / "plugstack.conf").write_text("")
    env = {**os.environ, "SLURM_CONF": str(conf), "PATH": SEARCH_PATH}
    cluster = SlurmCluster(root=root, host=host, env=env)
    log = root / "log"
    commands = {
        "munged": [
            "munged", "--foreground", f"--key-file={key}", f"--socket={munge_socket}",
            f"--pid-file={root / 'run' / 'munged.pid'}", f"--log-file={log / 'munged.log'}",
            f"--seed-file={root / 'munge' / 'seed'}",
        ],
        # -D: foreground, so that the fixture owns the process; -c: no state from before.
        "slurmctld": ["slurmctld", "-D", "-c", "-f", str(conf)],
        "slurmd": ["slurmd", "-D", "-f", str(conf)],
    }  # fmt: skip
    try:
        for name, cmd in commands.items():
            with open(log / f"{name}.out", "w") as out:
                cluster.procs[name] = subprocess.Popen(
                    [_which(cmd[0]), *cmd[1:]],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_die_with_parent,
                )
            if name == "munged":
                _wait_for(munge_socket, cluster)
        cluster.wait_idle()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_for(path: Path, cluster: SlurmCluster, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline or cluster.procs["munged"].poll() is not None:
            raise RuntimeError(f"munged did not create {path}\n{cluster.logs()}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def slurm_cluster() -> Iterator[SlurmCluster]:
    reason = missing_requirement()
    if reason is not None:
        if os.environ.get("CI") and os.name == "posix" and os.geteuid() == 0:
            pytest.fail(f"SLURM tests must run in CI: {reason}")
        pytest.skip(f"no SLURM cluster: {reason}")
    # Under /tmp, not pytest's 0700 tmp_path: munged refuses a socket path that is not open
    # to every user, and a socket path must stay short (108 bytes).
    root = Path(tempfile.mkdtemp(prefix="taco-slurm-", dir="/tmp"))
    try:
        cluster = _start(root)
        try:
            yield cluster
        finally:
            cluster.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
