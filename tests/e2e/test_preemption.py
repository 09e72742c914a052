"""Preemption and failures with the real `deepspeed --num_gpus 2` launcher and real signals,
on a tiny TACO (the runs that are not signalled, a reference and the resumptions, on 2
forked ranks):

* SIGTERM to the whole process group (what SLURM does at preemption and time limit) saves a
  checkpoint at the next iteration boundary; the resumed run logs exactly the losses of an
  uninterrupted run;
* --exit-duration-in-mins and SIGUSR1 to the ranks stop with exit code 0 (the launcher
  reports every rank's code) and resume exactly;
* SIGTERM to the `deepspeed` runner alone (DeepSpeed forwards nothing on a single node and its
  per-node launcher survives the runner) still stops every rank, after a save;
* kill -9 of one rank makes the other exit within seconds with one line naming the dead rank,
  without a Python traceback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from megatron_taco.runtime.faults import PAUSE_ENV
from tests.helpers import (
    BIN,
    ENV,
    REPO,
    TACO_METRIC_KEYS,
    deepspeed_command,
    free_port,
    kill_session,
    launch,
    run,
    train_records,
)

pytestmark = pytest.mark.e2e

TRAIN_ITERS = 30
LONG_RUN = "2000"  # iterations: over a minute of training, far beyond every bound below


def taco_args(dataset, *extra: str) -> list[str]:
    return [
        "--model-size", "tiny", "--seq-length", "64",
        "--data-path", dataset["prefix"], "--tokenizer-model", dataset["tokenizer"],
        "--data-cache-path", str(dataset["dir"] / "cache"), "--split", "80,10,10",
        "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "1e-3", "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0",
        "--num-workers", "1", "--deepspeed-config", "ds_configs/zero0_fp32.json",
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def reference(botchan_dataset, tmp_path_factory) -> dict[int, dict]:
    metrics = tmp_path_factory.mktemp("reference") / "metrics.jsonl"
    args = taco_args(botchan_dataset, "--train-iters", str(TRAIN_ITERS))
    launch("pretrain_taco.py", *args, "--metrics-file", str(metrics), world=2)
    return train_records(metrics)


# -- a run in its own session, its processes, and the metrics it logged so far ------------


def start(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            deepspeed_command("pretrain_taco.py", *args), cwd=REPO, env=ENV, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def logged_iterations(metrics: Path) -> set[int]:
    iterations = set()
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:  # the last line may be half-written
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("split") == "train":
                iterations.add(record["iteration"])
    return iterations


def wait_for_iteration(proc: subprocess.Popen, metrics: Path, iteration: int, timeout=240):
    deadline = time.monotonic() + timeout
    while iteration not in logged_iterations(metrics):
        assert proc.poll() is None, f"the run ended (code {proc.returncode}) before {iteration}"
        assert time.monotonic() < deadline, f"iteration {iteration} not reached"
        time.sleep(0.05)


def processes(proc: subprocess.Popen) -> tuple[psutil.Process, dict[int, psutil.Process]]:
    """DeepSpeed's per-node launcher and its ranks by local rank."""
    (launcher,) = psutil.Process(proc.pid).children()
    ranks = {}
    for child in launcher.children():
        flag = next(a for a in child.cmdline() if a.startswith("--local_rank="))
        ranks[int(flag.split("=")[1])] = child
    assert sorted(ranks) == [0, 1]
    return launcher, ranks


def alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def seconds_until_gone(procs, timeout: float) -> float:
    start = time.monotonic()
    while any(alive(p) for p in procs) and time.monotonic() - start < timeout:
        time.sleep(0.05)
    return time.monotonic() - start


def latest(ckpt: Path) -> int:
    return int((ckpt / "latest_checkpointed_iteration.txt").read_text())


def assert_matches(reference: dict[int, dict], resumed: dict[int, dict], iterations) -> None:
    for it in iterations:
        for key in (*TACO_METRIC_KEYS, "lr", "grad_norm", "consumed_samples"):
            assert resumed[it][key] == reference[it][key], (it, key)


# -- tests -----------------------------------------------------------------------------------


def test_sigterm_to_the_process_group_saves_and_resumes_exactly(
    botchan_dataset, reference, tmp_path
):
    ckpt, log = tmp_path / "ckpt", tmp_path / "interrupted.log"
    args = taco_args(botchan_dataset, "--train-iters", str(TRAIN_ITERS), "--save", str(ckpt))
    proc = start(args, log)
    try:
        wait_for_iteration(proc, ckpt / "metrics.jsonl", 5)
        _, ranks = processes(proc)
        os.killpg(proc.pid, signal.SIGTERM)  # runner, per-node launcher, ranks, workers
        assert seconds_until_gone(ranks.values(), timeout=60) < 30
    finally:
        kill_session(proc)
    out = log.read_text()
    stopped = latest(ckpt)
    assert 5 <= stopped < TRAIN_ITERS
    why = f" exiting at iteration {stopped}: SIGTERM received (--exit-signal-handler); saving"
    assert why in out and f"saved checkpoint {ckpt}/iter_{stopped:07d}" in out
    assert "Traceback" not in out
    assert max(logged_iterations(ckpt / "metrics.jsonl")) == stopped

    res = launch("pretrain_taco.py", *args, "--load", str(ckpt), world=2)
    assert f"resumed from {ckpt} at iteration {stopped}" in res.stdout
    resumed = train_records(ckpt / "metrics.jsonl")
    assert sorted(resumed) == list(range(1, TRAIN_ITERS + 1))
    assert_matches(reference, resumed, range(1, TRAIN_ITERS + 1))


def test_time_limit_and_sigusr1_exit_0_and_resume_exactly(botchan_dataset, reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    args = taco_args(botchan_dataset, "--train-iters", str(TRAIN_ITERS), "--save", str(ckpt))
    # 0.6 s after the process started: over at the end of the first iteration.
    res = launch("pretrain_taco.py", *args, "--exit-duration-in-mins", "0.01", world=2)
    assert " exiting at iteration 1: --exit-duration-in-mins 0.01 reached; saving" in res.stdout
    assert latest(ckpt) == 1

    log = tmp_path / "usr1.log"
    proc = start([*args, "--load", str(ckpt)], log)
    try:
        wait_for_iteration(proc, ckpt / "metrics.jsonl", 5)
        _, ranks = processes(proc)
        for rank in ranks.values():
            rank.send_signal(signal.SIGUSR1)
        # The launcher exits 0 only when every rank did.
        assert proc.wait(timeout=60) == 0
    finally:
        kill_session(proc)
    stopped = latest(ckpt)
    assert 5 <= stopped < TRAIN_ITERS
    assert f" exiting at iteration {stopped}: SIGUSR1 received" in log.read_text()

    launch("pretrain_taco.py", *args, "--load", str(ckpt), world=2)
    assert_matches(reference, train_records(ckpt / "metrics.jsonl"), range(1, TRAIN_ITERS + 1))


def test_sigterm_to_the_deepspeed_runner_alone_stops_every_rank(botchan_dataset, tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "run.log"
    proc = start(taco_args(botchan_dataset, "--train-iters", LONG_RUN, "--save", str(ckpt)), log)
    try:
        wait_for_iteration(proc, ckpt / "metrics.jsonl", 5)
        launcher, ranks = processes(proc)
        proc.send_signal(signal.SIGTERM)  # the runner only: it dies, forwarding nothing
        took = seconds_until_gone([launcher, *ranks.values()], timeout=60)
    finally:
        kill_session(proc)
    out = log.read_text()
    assert took < 30, out[-3000:]
    stopped = latest(ckpt)
    assert stopped >= 5
    assert f" exiting at iteration {stopped}: a rank's launcher exited" in out
    assert "Traceback" not in out


def test_kill_9_of_one_rank_stops_the_other_with_one_line(botchan_dataset, tmp_path):
    log = tmp_path / "run.log"
    metrics = tmp_path / "metrics.jsonl"
    args = taco_args(botchan_dataset, "--train-iters", LONG_RUN, "--metrics-file", str(metrics))
    proc = start([*args, "--distributed-timeout-minutes", "0.5"], log)
    try:
        wait_for_iteration(proc, metrics, 5)
        _, ranks = processes(proc)
        ranks[1].kill()
        took = seconds_until_gone([ranks[0]], timeout=60)
        code = proc.wait(timeout=60)
    finally:
        kill_session(proc)
    out = log.read_text()
    assert took < 15, out[-3000:]
    assert code != 0
    ours = [line for line in out.splitlines() if line.startswith("pretrain_taco.py: ")]
    assert len(ours) == 1, out[-3000:]
    pattern = rf"pretrain_taco.py: error: rank 0: rank 1 \(pid {ranks[1].pid}\) has died; \w+ \("
    assert re.match(pattern, ours[0]), ours[0]
    assert "Traceback" not in out


# -- signals during a save, and a launcher that waits for it (issue 15 items 8, 9) ----------

SLOW_SAVE = {PAUSE_ENV: "after_model_files:6"}  # every save takes 6 s longer


def start_with(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=REPO, env={**ENV, **env}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def saving(ckpt: Path) -> bool:
    return any(".tmp-" in p.name for p in ckpt.iterdir()) if ckpt.is_dir() else False


def test_a_second_signal_during_the_save_does_not_kill_it(botchan_dataset, tmp_path):
    # SLURM: the time-limit warning (USR1) starts the save; scancel's TERM arrives, which
    # examples/slurm/launch.sh passes on as USR1, and Slurm's own TERM to the ranks.
    ckpt, log = tmp_path / "ckpt", tmp_path / "run.log"
    cmd = deepspeed_command("pretrain_taco.py",
                            *taco_args(botchan_dataset, "--train-iters", LONG_RUN, "--save", str(ckpt)))  # fmt: skip
    proc = start_with(cmd, log, SLOW_SAVE)
    try:
        wait_for_iteration(proc, ckpt / "metrics.jsonl", 3)
        _, ranks = processes(proc)
        for rank in ranks.values():
            rank.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 60
        while not saving(ckpt):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        time.sleep(2.5)  # past the old 2 s repeat window, still inside the save
        assert saving(ckpt)
        for later in (signal.SIGUSR1, signal.SIGTERM):
            for rank in ranks.values():
                rank.send_signal(later)
        code = proc.wait(timeout=120)
    finally:
        kill_session(proc)
    out = log.read_text()
    assert code == 0, out[-3000:]
    stopped = latest(ckpt)
    assert f"saved checkpoint {ckpt}/iter_{stopped:07d}" in out
    assert not saving(ckpt) and "Traceback" not in out


def test_taco_launch_returns_only_after_the_ranks_saved(botchan_dataset, tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "run.log"
    args = taco_args(botchan_dataset, "--train-iters", LONG_RUN, "--save", str(ckpt))
    cmd = [str(BIN / "taco-launch"), *deepspeed_command("pretrain_taco.py", *args)]
    proc = start_with(cmd, log, SLOW_SAVE)
    try:
        wait_for_iteration(proc, ckpt / "metrics.jsonl", 3)
        below = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)  # what a batch system or a container runtime does
        code = proc.wait(timeout=120)
        # The moment the wrapper returned: the checkpoint was complete, nothing was left.
        done = not saving(ckpt) and (ckpt / "latest_checkpointed_iteration.txt").exists()
        left = [p for p in below if alive(p)]
    finally:
        kill_session(proc)
    out = log.read_text()
    assert code == 0, out[-3000:]
    assert done and left == [], (left, out[-3000:])
    stopped = latest(ckpt)
    assert f" exiting at iteration {stopped}: SIGTERM received" in out
    assert "taco-launch: SIGTERM passed to 2 rank(s) on this node" in out
    assert "Traceback" not in out


# -- the torchrun agent killed at any point (issue 22 item 1) ------------------------------


def torchrun_command(*args: str) -> list[str]:
    return [str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", str(free_port()),
            "pretrain_taco.py", *args]  # fmt: skip


def pausing_at(log: Path, count: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while log.read_text().count(f"{PAUSE_ENV}: ") < count:
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)


def kill_agent(proc: subprocess.Popen, log: Path) -> tuple[str, float]:
    """SIGKILL to torchrun's agent (what a node's OOM killer or a crashed agent does); its
    output and how long its ranks outlived it."""
    ranks = psutil.Process(proc.pid).children()
    assert len(ranks) == 2, ranks
    proc.kill()
    took = seconds_until_gone(ranks, timeout=120)
    out = log.read_text()
    assert not any(alive(r) for r in ranks), out[-3000:]
    return out, took


def test_killing_the_torchrun_agent_at_any_point_leaves_no_rank(botchan_dataset, tmp_path):
    from megatron_taco.checkpoint.manifest import verify_checkpoint

    ckpt = tmp_path / "ckpt"
    args = taco_args(botchan_dataset, "--train-iters", LONG_RUN, "--save", str(ckpt))
    took = {}
    # Mid-training: the kernel's death signal is an exit request; the ranks save and stop.
    log = tmp_path / "training.log"
    proc = start_with(torchrun_command(*args), log, {})
    try:
        wait_for_iteration(proc, ckpt / "metrics.jsonl", 3)
        out, took["training"] = kill_agent(proc, log)
    finally:
        kill_session(proc)
    stopped = latest(ckpt)
    assert f" exiting at iteration {stopped}: SIGTERM received" in out, out[-3000:]
    assert f"saved checkpoint {ckpt}/iter_{stopped:07d}" in out and "Traceback" not in out
    # Outside the loop nothing reads the flags: each rank ends at once, one line each. Rank 1
    # is held before its rendezvous while rank 0 waits in it (its store connection in C++),
    # then rank 0 is held in its data set-up while rank 1 waits for it in a collective.
    holds = {
        "rendezvous": ("before_rendezvous@1:600,before_rendezvous@0:0", 2,
                       ["the rendezvous", "start-up"]),
        "set-up": ("before_build@0:600", 1, ["data and model set-up"] * 2),
    }  # fmt: skip
    for name, (pause, announced, phases) in holds.items():
        log = tmp_path / f"{name}.log"
        proc = start_with(torchrun_command(*args, "--load", str(ckpt)), log, {PAUSE_ENV: pause})
        try:
            pausing_at(log, announced)
            time.sleep(3)  # the rank that is not held reaches its blocking call
            out, took[name] = kill_agent(proc, log)
        finally:
            kill_session(proc)
        ours = sorted(line for line in out.splitlines() if line.startswith("pretrain_taco.py: "))
        gone = f"launcher process {proc.pid} (torchrun) exited"
        assert ours == [
            f"pretrain_taco.py: error: rank {rank}: {gone} during {phase}; exiting"
            for rank, phase in enumerate(phases)
        ], out[-3000:]
        assert "Traceback" not in out
        assert latest(ckpt) == stopped and not (ckpt / "run.lock").exists()
        verify_checkpoint(str(ckpt), stopped)
    print(f"ranks gone after the agent's SIGKILL (s): {took}")
    # The last checkpoint loads, and --save is free again.
    resumed = run(torchrun_command(*taco_args(botchan_dataset, "--train-iters", str(stopped + 1),
                                              "--save", str(ckpt), "--load", str(ckpt))))  # fmt: skip
    assert f"resumed from {ckpt} at iteration {stopped}" in resumed.stdout


# -- a dead launcher during a stalled exit save (the orphan grace) --------------------------

ORPHAN_GRACE = ["--orphan-grace-seconds", "2"]


def test_a_rank_whose_launcher_died_abandons_a_stalled_exit_save(botchan_dataset, tmp_path):
    from megatron_taco.checkpoint.manifest import verify_checkpoint

    ckpt, log = tmp_path / "ckpt", tmp_path / "run.log"
    args = taco_args(botchan_dataset, "--save", str(ckpt))
    # A periodic save at 2 completes; the save of --exit-interval's exit at 3 stalls on rank 0
    # after its manifest (complete, not renamed yet), while rank 1 waits for it in the file
    # group's barrier (--filesystem-timeout-minutes, 60): the launcher is then SIGKILLed.
    stalled = [*args, "--train-iters", LONG_RUN, "--save-interval", "2", "--exit-interval", "3"]
    proc = start_with(torchrun_command(*stalled, *ORPHAN_GRACE), log,
                      {PAUSE_ENV: "after_metadata@3:600"})  # fmt: skip
    try:
        pausing_at(log, 1)
        time.sleep(1)  # rank 1 reaches the barrier
        ranks = psutil.Process(proc.pid).children()
        assert len(ranks) == 2, ranks
        proc.kill()
        took = seconds_until_gone(ranks, timeout=60)
        left = [r.pid for r in ranks if alive(r)]
    finally:
        kill_session(proc)
    out = log.read_text()
    print(f"ranks gone {took:.1f} s after the launcher's SIGKILL (left: {left})")
    print("\n".join(line for line in out.splitlines() if "abandoned" in line))
    assert not left, out[-3000:]  # before: alive for the barrier's 60 min
    ours = sorted(line for line in out.splitlines() if line.startswith("pretrain_taco.py: "))
    last = f"the last complete checkpoint is {ckpt}/iter_0000002"
    assert len(ours) == 2, out[-3000:]
    for rank, line in enumerate(ours):
        assert line.startswith(f"pretrain_taco.py: error: rank {rank}: launcher process "
                               f"{proc.pid} (torchrun) exited during "), line  # fmt: skip
        assert "the exit save of iteration 3, which was abandoned 2 s later" in line, line
        assert last in line and line.endswith("; exiting"), line
    assert "Traceback" not in out
    # The tracker never named the abandoned save; the last complete one verifies, --save is
    # free again, and the run resumes from it.
    assert latest(ckpt) == 2 and not (ckpt / "run.lock").exists()
    verify_checkpoint(str(ckpt), 2)
    resumed = run(torchrun_command(*args, "--train-iters", "3", "--load", str(ckpt)))
    assert f"resumed from {ckpt} at iteration 2" in resumed.stdout
    assert latest(ckpt) == 3 and not saving(ckpt)
