"""Fault points: named places in a run where the crash tests and the fault campaign
(benchmarks/bench_faults.py) kill or pause a process, chosen by environment variables that a
production run never sets. Imports nothing of ours.

Points: a save's (checkpoint/save.py: after_model_files, after_rng_files on every rank;
after_metadata, after_rename, after_tracker on rank 0) are qualified by the iteration, the
start-up points (training/driver.py: before_rendezvous, before_build) by the global rank,
the SAS store's commit (store_commit) by the epoch.
"""

from __future__ import annotations

import os
import signal
import sys
import time

# SIGKILL at a named point, e.g. "after_metadata@4" (the save of iteration 4 only).
KILL_ENV = "MEGATRON_TACO_TEST_KILL_AT"
# A sleep at named points instead, comma-separated "point[@N]:seconds" (e.g.
# "before_rendezvous@1:600,before_rendezvous@0:0"): a slower save, or a rank held at a point
# while a test kills its launcher. Each match is announced on stderr first.
PAUSE_ENV = "MEGATRON_TACO_TEST_PAUSE_AT"


def hook_point(point: str, qualifier: int) -> None:
    names = (point, f"{point}@{qualifier}")
    if os.environ.get(KILL_ENV) in names:
        os.kill(os.getpid(), signal.SIGKILL)
    for spec in filter(None, os.environ.get(PAUSE_ENV, "").split(",")):
        where, _, seconds = spec.strip().rpartition(":")
        if where in names:
            print(
                f"{PAUSE_ENV}: {where}: pid {os.getpid()} sleeps {seconds} s",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(float(seconds))
