"""What each launcher tells its ranks, in one table: deepspeed and torchrun (RANK,
LOCAL_RANK, WORLD_SIZE...), mpirun/mpiexec (Open MPI; MPICH's and Intel MPI's Hydra;
MVAPICH2), SLURM, and the container inits that may start a rank. Read before any process
group exists (it sizes the configs and ties a rank to its launcher). Imports nothing of ours
but runtime.procfs."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys

from megatron_taco.runtime.procfs import proc_stat

# What mpirun/mpiexec set in each rank (Open MPI; MPICH's and Intel MPI's Hydra; MVAPICH2):
# such ranks learn RANK, WORLD_SIZE and LOCAL_RANK only at MPI discovery, after the configs
# are parsed.
MPI_RANK_ENV = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMI_SIZE", "MV2_COMM_WORLD_RANK")
MPI_WORLD_SIZE_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
# The global rank each launcher gives its processes (torchrun, deepspeed, launch.sh; Open
# MPI, Hydra, MVAPICH2 before MPI discovery sets RANK).
RANK_ENV = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")
# The number of ranks this launch runs on this node, where the launcher says so.
LOCAL_SIZE_ENV = (
    "LOCAL_WORLD_SIZE",  # torchrun
    "LOCAL_SIZE",  # deepspeed
    "OMPI_COMM_WORLD_LOCAL_SIZE",  # Open MPI
    "MPI_LOCALNRANKS",  # MPICH / Intel MPI (Hydra)
    "MV2_COMM_WORLD_LOCAL_SIZE",  # MVAPICH2
    "SLURM_NTASKS_PER_NODE",
)
# What torch's env:// rendezvous needs (deepspeed and torchrun set them all).
RENDEZVOUS_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
DEEPSPEED_NODE_LAUNCHER = "deepspeed.launcher.launch"
# Processes that adopt orphans and start no ranks: a rank whose parent is one of them (or
# PID 1) was left by its launcher.
_ADOPTERS = {"systemd", "init", "s6-svscan"}
# A container's init shims (docker --init runs tini as docker-init): they adopt orphans,
# and also start the container's command, which may be the rank itself (a pod whose spec
# sets RANK, LOCAL_RANK, WORLD_SIZE: the container runtime is its launcher).
_CONTAINER_INITS = ("tini", "dumb-init", "catatonit", "docker-init")


def launched_by_launcher() -> bool:
    # deepspeed and torchrun set LOCAL_RANK, mpirun its own variables; plain `python`
    # (maybe under nohup, whose shell may go away) sets none, and is not tied to its parent.
    return "LOCAL_RANK" in os.environ or any(k in os.environ for k in MPI_RANK_ENV)


def _first_number(keys: tuple[str, ...]) -> int | None:
    return next((int(os.environ[k]) for k in keys if os.environ.get(k, "").isdigit()), None)


def launcher_rank() -> int:
    """This process's global rank as its launcher announced it (0 for plain python): known
    before any process group exists."""
    return _first_number(RANK_ENV) or 0


def mpi_world_size_env() -> tuple[str, str] | None:
    """(variable, value) of an MPI launcher's world size, None when none is set."""
    return next(((k, os.environ[k]) for k in MPI_WORLD_SIZE_ENV if k in os.environ), None)


def launcher_world_size() -> int:
    """World size announced by the launcher (deepspeed, torchrun, srun wrapper, mpirun), 1 for
    plain python. Read from the environment only: it sizes the configs before rendezvous."""
    key, value = "WORLD_SIZE", os.environ.get("WORLD_SIZE")
    if value is None:
        key, value = mpi_world_size_env() or ("WORLD_SIZE", "1")
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"environment variable {key}={value!r} is not an integer") from None


def local_size() -> int | None:
    return _first_number(LOCAL_SIZE_ENV)


def launch_id() -> str | None:
    """What the ranks of this launch on this node share and no other launch does: the
    launcher process they are children of (PID and start time, so a reused PID differs),
    the rendezvous address, torchrun's restart count, SLURM's step and the command line.
    None when this process is alone on its node (plain python, or one rank per node)."""
    if not launched_by_launcher() or local_size() == 1:
        return None
    parent = os.getppid()
    parent_stat = proc_stat(parent)
    env = os.environ
    parts = [
        socket.gethostname(),
        parent,
        parent_stat.start_ticks if parent_stat else None,
        env.get("MASTER_ADDR"),
        env.get("MASTER_PORT"),
        env.get("TORCHELASTIC_RESTART_COUNT"),
        env.get("SLURM_JOB_ID"),
        env.get("SLURM_STEP_ID"),
        _command_line(),
    ]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:32]


def _command_line() -> list[str]:
    """sys.argv without the launcher's per-rank flag (deepspeed passes --local_rank=N)."""
    out, skip = [], False
    for arg in sys.argv:
        if skip:
            skip = False
        elif arg in ("--local_rank", "--local-rank"):
            skip = True
        elif not arg.startswith(("--local_rank=", "--local-rank=")):
            out.append(arg)
    return out


def is_container_init(name: str) -> bool:
    """By prefix: the shims ship under other names too (tini-static, tini-static-amd64 read
    as "tini-static-amd" in a 15-character comm, dumb-init_1.2.5_x86_64)."""
    return name.startswith(_CONTAINER_INITS)


def orphaned_at_start(parent: int, parent_name: str, init_name: str) -> bool:
    """Whether a rank whose parent is ``parent`` (named ``parent_name``) at the top of its
    entry point was left by its launcher; ``init_name``: PID 1's /proc/1/comm.

    A container's init shim as the parent is ambiguous: it adopts orphans (as PID 1, or as
    a subreaper), and it starts the container's command, which may be the rank itself. Such
    a rank is not judged orphaned; the parent-death signal, armed on the shim, decides (it
    fires when the container ends). What that gives up: a launcher that dies in the
    milliseconds between the rank's start and the shim's first line, while not the shim's
    own child, leaves the rank waiting for its rendezvous timeout (as its child, the shim
    exits with it, and the kernel ends every process of the container)."""
    if is_container_init(parent_name) or (parent == 1 and is_container_init(init_name)):
        return False
    return parent == 1 or parent_name in _ADOPTERS
