"""The runs of a learning comparison: each model (ours or a peer) and seed in a folder of its
own under --out, several at a time (benchmarks/harness/jobs.py)."""

from __future__ import annotations

import dataclasses
import os

from benchmarks.harness.jobs import Command, run_parallel
from benchmarks.learning.setting import OURS, Setting, job_command


@dataclasses.dataclass(frozen=True)
class Job:
    """One run: ``model`` (OURS or PEERS) under the name ``name`` (its folder and its
    curve), with ``flags`` added to our driver's (per script) and ``cold_start`` for SAS."""

    name: str
    model: str
    seed: int
    cold_start: str = "unigram"
    flags: tuple[str, ...] = ()


def run_jobs(jobs: list[Job], s0: Setting, out_dir: str, parallel: int) -> dict:
    """Runs ``parallel`` jobs at a time; {(name, seed): metrics.jsonl} of those that ended well."""
    commands, metrics = [], []
    for job in jobs:
        s = dataclasses.replace(s0, seed=job.seed, cold_start=job.cold_start)
        work = os.path.join(out_dir, f"{job.name}_s{job.seed}")
        metrics.append(os.path.join(work, "metrics.jsonl"))
        script = OURS[job.model][0] if job.model in OURS else None
        argv = job_command(job.model, s, metrics[-1], work, {script: list(job.flags)})
        commands.append(Command(f"{job.name} (seed {job.seed})", tuple(argv), work))
    status = run_parallel(commands, parallel)
    return {(job.name, job.seed): metrics[k] for k, job in enumerate(jobs) if status[k] == 0}
