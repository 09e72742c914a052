"""examples/slurm/tiny_test.sbatch submitted for real to a one-node SLURM cluster
(tests/e2e/slurm_cluster.py), interrupted both ways SLURM interrupts a job, and requeued each
time:

1. the time-limit warning: `scancel --batch --signal=USR1` does what
   `#SBATCH --signal=B:USR1@120` makes SLURM do 120 s before the limit, USR1 to the batch
   shell only; the script's trap (examples/slurm/launch.sh) passes it on to the ranks;
2. preemption: the same script submitted to the higher-priority partition needs the node, so
   SLURM preempts the job (PreemptMode=REQUEUE) and sends its ranks SIGTERM.

Each time the ranks save a checkpoint at the end of the current iteration and exit 0
(--exit-signal-handler), `launch.sh` requeues the job, and the next start resumes from that
checkpoint. Every save is made 5 s slower (MEGATRON_TACO_TEST_PAUSE_AT), and while the first
one is being written a second warning reaches the batch shell (launch.sh does not pass it on)
and a USR1 the ranks themselves (they absorb it): neither may kill the save (the script's --load is its --save and it sets no --save-interval, so these are
the only checkpoints). The job finishes every iteration with the losses of the preempting
job, which ran the same script uninterrupted.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from megatron_taco.runtime.faults import PAUSE_ENV
from tests.e2e.slurm_cluster import SlurmCluster, slurm_cluster  # noqa: F401
from tests.helpers import BIN, ENV, REPO, TACO_METRIC_KEYS, free_port, train_records

pytestmark = pytest.mark.e2e

SCRIPT = "examples/slurm/tiny_test.sbatch"
# Enough that the job is still training when each interruption lands (~1 s after it is sent).
TRAIN_ITERS = 300
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def _submit(cluster: SlurmCluster, dataset: dict, ckpt: Path, out: Path, *options: str) -> str:
    ckpt.mkdir()
    env = {
        **ENV,
        "TINY_DATA": dataset["prefix"],
        "TINY_TOKENIZER": dataset["tokenizer"],
        "TINY_CKPT": str(ckpt),
        "TINY_TRAIN_ITERS": str(TRAIN_ITERS),
        "PYTHON": str(BIN / "python"),
        # Loopback, and a free port: other clusters on this machine number their jobs from
        # 1 too, so the script's job-id port could collide.
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        PAUSE_ENV: "after_model_files:5",
    }
    return cluster.sbatch(SCRIPT, f"--output={out}", *options, cwd=REPO, env=env)


def _wait(what: str, ready, cluster: SlurmCluster, job_id: str, out: Path, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        if cluster.job(job_id).get("JobState") in FINISHED - {"COMPLETED"}:
            break
        time.sleep(0.5)
    log = out.read_text(errors="replace")[-6000:] if out.exists() else "(no job output)"
    raise AssertionError(
        f"{what}: not after {timeout} s; job {job_id}: {cluster.job(job_id)}\n"
        f"--- job output\n{log}\n{cluster.logs()}"
    )


def _last_iteration(ckpt: Path) -> int:
    metrics = ckpt / "metrics.jsonl"
    return max(train_records(metrics), default=0) if metrics.exists() else 0


def _saving(ckpt: Path) -> bool:
    return any(".tmp-" in p.name for p in ckpt.iterdir())


def _resumed_at(out: Path) -> list[int]:
    text = out.read_text(errors="replace") if out.exists() else ""
    return [int(it) for it in re.findall(r"resumed from \S+ at iteration (\d+)", text)]


def test_sbatch_job_requeued_after_time_limit_warning_and_preemption_resumes(
    slurm_cluster: SlurmCluster,  # noqa: F811
    botchan_dataset,
    tmp_path,
):
    cluster = slurm_cluster
    ckpt, out = tmp_path / "requeued", tmp_path / "requeued.out"
    job = _submit(cluster, botchan_dataset, ckpt, out)

    # 1. Time-limit warning to the batch shell; then, while the ranks save, another signal
    # to the batch shell and one to the ranks directly. (scancel --signal=TERM would cancel
    # the job itself.)
    _wait("3 iterations", lambda: _last_iteration(ckpt) >= 3, cluster, job, out, 240)
    cluster.run("scancel", "--batch", "--signal=USR1", job)
    _wait("the save under way", lambda: _saving(ckpt), cluster, job, out, 120)
    time.sleep(2.5)  # past the ranks' old 2 s repeat window
    cluster.run("scancel", "--batch", "--signal=USR1", job)
    cluster.run("scancel", "--signal=USR1", job)
    _wait("a resumed start", lambda: len(_resumed_at(out)) == 1, cluster, job, out, 180)
    first = _resumed_at(out)[0]
    _wait("3 more iterations", lambda: _last_iteration(ckpt) >= first + 3, cluster, job, out, 180)

    # 2. Preemption by a job of the higher-priority partition that needs the whole node: the
    # same script, which then runs uninterrupted, as the reference for the losses.
    ref_ckpt, ref_out = tmp_path / "uninterrupted", tmp_path / "uninterrupted.out"
    ref_job = _submit(
        cluster, botchan_dataset, ref_ckpt, ref_out, "--partition=urgent", "--exclusive"
    )

    def completed(job_id):
        return lambda: cluster.job(job_id).get("JobState") == "COMPLETED"

    _wait("the preempting job completed", completed(ref_job), cluster, ref_job, ref_out, 240)
    _wait("the requeued job completed", completed(job), cluster, job, out, 240)

    log = out.read_text()
    assert cluster.job(job)["Restarts"] == "2", log[-6000:]
    assert cluster.job(ref_job)["Restarts"] == "0"
    assert log.count("launch.sh: SIGUSR1") == 2, log[-6000:]
    assert log.count("the ranks are already saving; not passed on") == 1, log[-6000:]
    assert log.count(f"launch.sh: job {job} was preempted") == 1, log[-6000:]
    # The ranks' own exit status each time: they saved and exited cleanly, not killed.
    assert log.count("launch.sh: ranks exited with status 0; requeueing") == 2, log[-6000:]
    assert f"resumed from {ckpt} at iteration {first}" in log
    resumed = _resumed_at(out)
    assert len(resumed) == 2 and 3 <= resumed[0] < resumed[1] < TRAIN_ITERS, resumed
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(TRAIN_ITERS)

    records = train_records(ckpt / "metrics.jsonl")
    assert sorted(records) == list(range(1, TRAIN_ITERS + 1))
    reference = train_records(ref_ckpt / "metrics.jsonl")
    assert sorted(reference) == list(range(1, TRAIN_ITERS + 1))
    for it in range(1, TRAIN_ITERS + 1):
        for key in (*TACO_METRIC_KEYS, "lr", "grad_norm", "consumed_samples"):
            assert records[it][key] == reference[it][key], (it, key, resumed)
