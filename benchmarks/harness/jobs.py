"""Benchmark jobs as subprocesses, with logs: one at a time with its output on the terminal
and in a log file (run_all), or several at a time, each in a fresh folder with its log
there (the learning comparisons' training runs)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time

from benchmarks.harness.paths import BUILD, REPO

# A launcher's variables would make a child join its rendezvous instead of running alone.
LAUNCHER_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_logged(argv: list[str], log_path: str) -> int:
    """Run ``argv`` in the repository, its output (stdout and stderr) both on this
    terminal and in ``log_path``; its exit status."""
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        for line in proc.stdout:
            sys.stdout.write(line)
            log_file.write(line)
        return proc.wait()


@dataclasses.dataclass(frozen=True)
class Command:
    """One job: ``argv`` run in the repository with ``workdir`` as its folder, emptied first
    unless ``fresh`` is False (a run that resumes from what it left there); its output goes
    to workdir/log.txt. ``label`` names it in the progress lines."""

    label: str
    argv: tuple[str, ...]
    workdir: str
    fresh: bool = True


def child_env(threads: int) -> dict[str, str]:
    """The environment of a job that gets ``threads`` cores, outside any launcher."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
        "TORCH_EXTENSIONS_DIR": os.path.join(BUILD, "torch_extensions"),
    }
    for var in LAUNCHER_VARIABLES:
        env.pop(var, None)
    return env


def job_threads(parallel: int, jobs: int) -> int:
    """Threads per job: OMP_NUM_THREADS when the caller set it (several benchmarks sharing a
    machine: two campaigns at 2 threads each on 2 cores spent 54% of their time in OpenMP's
    spin-waits: 2.8 s an iteration of SAS at 2 x 128, 0.14 s at 1 thread each), else the
    cores shared out between the jobs that run at once."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    return max(1, (os.cpu_count() or 1) // max(1, min(parallel, jobs)))


def run_parallel(commands: list[Command], parallel: int) -> dict[int, int]:
    """Runs ``parallel`` of ``commands`` at a time, in order; {index in commands: exit
    status} of every one."""
    env = child_env(job_threads(parallel, len(commands)))
    pending, running, status = list(enumerate(commands)), [], {}
    while pending or running:
        while pending and len(running) < parallel:
            k, cmd = pending.pop(0)
            if cmd.fresh:
                shutil.rmtree(cmd.workdir, ignore_errors=True)
            os.makedirs(cmd.workdir, exist_ok=True)
            mode = "w" if cmd.fresh else "a"
            log_file = open(os.path.join(cmd.workdir, "log.txt"), mode)  # noqa: SIM115
            proc = subprocess.Popen(
                list(cmd.argv), cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT
            )
            running.append((k, cmd, proc, log_file, time.time()))
            log(f"  started {cmd.label}")
        time.sleep(1)
        for entry in list(running):
            k, cmd, proc, log_file, start = entry
            if proc.poll() is None:
                continue
            log_file.close()
            running.remove(entry)
            status[k] = proc.returncode
            minutes = (time.time() - start) / 60
            if proc.returncode != 0:
                log(
                    f"  {cmd.label} FAILED (exit {proc.returncode}) after {minutes:.1f} min; "
                    f"see {cmd.workdir}/log.txt"
                )
            else:
                log(f"  {cmd.label} done in {minutes:.1f} min")
    return status
