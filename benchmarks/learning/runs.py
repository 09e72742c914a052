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
    curve), with ``flags`` added to our driver's (per script) and ``cold_start`` for SAS;
    ``lr`` and ``iters`` replace the setting's when given (a learning-rate grid, a FLOPs
    budget)."""

    name: str
    model: str
    seed: int
    cold_start: str = "unigram"
    flags: tuple[str, ...] = ()
    lr: float | None = None
    iters: int | None = None


def finished(metrics: str, iters: int) -> bool:
    """Whether ``metrics`` holds the held-out record of a run's last iteration (it ended)."""
    from megatron_taco.training.observability.log import read_metrics

    if not os.path.isfile(metrics):
        return False
    return any(r.get("split") == "valid" and r.get("iteration") == iters
               for r in read_metrics(metrics))  # fmt: skip


def run_jobs(
    jobs: list[Job], s0: Setting, out_dir: str, parallel: int, reuse: bool = False
) -> dict:
    """Runs ``parallel`` jobs at a time; {(name, seed): metrics.jsonl} of those that ended
    well. ``reuse``: a job whose folder holds a run that ended is not run again, and one
    that was cut short resumes from its own checkpoints (a campaign of many runs resumes
    where it stopped)."""
    commands, metrics, kept = [], [], {}
    for job in jobs:
        s = dataclasses.replace(
            s0,
            seed=job.seed,
            cold_start=job.cold_start,
            lr=s0.lr if job.lr is None else job.lr,
            iters=s0.iters if job.iters is None else job.iters,
        )
        work = os.path.join(out_dir, f"{job.name}_s{job.seed}")
        if reuse and finished(os.path.join(work, "metrics.jsonl"), s.iters):
            kept[(job.name, job.seed)] = os.path.join(work, "metrics.jsonl")
            continue
        metrics.append(os.path.join(work, "metrics.jsonl"))
        script = OURS[job.model][0] if job.model in OURS else None
        argv = job_command(job.model, s, metrics[-1], work, {script: list(job.flags)}, reuse)
        # Under reuse the folder is kept: our driver resumes from its checkpoints there.
        commands.append(Command(f"{job.name} (seed {job.seed})", tuple(argv), work, not reuse))
    status = run_parallel(commands, parallel)
    ran = [job for job in jobs if (job.name, job.seed) not in kept]
    return {**kept, **{(job.name, job.seed): metrics[k] for k, job in enumerate(ran)
                       if status[k] == 0}}  # fmt: skip
