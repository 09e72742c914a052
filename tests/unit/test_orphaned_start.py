"""A rank whose launcher is gone before main() (issue 27 item 7): torchrun's agent or the
deepspeed launcher cancelled or OOM-killed while its ranks still import torch and
DeepSpeed. The entry shim ties the rank first thing: one line and exit 1, instead of a rank
re-parented to init that waits in its rendezvous until the timeout."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_taco.runtime.procfs import proc_stat
from tests.helpers import ENV, REPO, free_port

# The launcher starts rank 0 of a world of 2 (rank 1 never comes: untied, rank 0 would
# wait in the rendezvous) and dies after ``delay`` seconds: at once (the rank finds init as
# its parent) or while the rank imports (the parent-death signal armed by the shim fires).
_LAUNCHER = """
import os, subprocess, sys, time
port, out, pid_file, delay, *args = sys.argv[1:]
env = {**os.environ, "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "2",
       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
rank = subprocess.Popen([sys.executable, "pretrain_taco.py", *args], stdout=open(out, "w"),
                        stderr=subprocess.STDOUT, env=env)
with open(pid_file, "w") as f:
    f.write(str(rank.pid))
time.sleep(float(delay))
os._exit(0)
"""


def _gone(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is None or stat.state in "ZX"


@pytest.mark.parametrize("delay", ["0", "0.5"])
def test_a_rank_whose_launcher_died_before_main_exits_with_one_line(
    botchan_dataset, tmp_path, delay
):
    from megatron_taco.runtime.launcher import is_container_init
    from megatron_taco.runtime.procfs import init_name as _init_name

    if delay == "0" and is_container_init(_init_name()):
        # The rank may be re-parented before its shim runs, to PID 1, a container's init
        # shim, which may also be a rank's launcher: the case that decision gives up.
        pytest.skip(f"PID 1 is {_init_name()}: an orphan there is not judged at start")
    out, pid_file = tmp_path / "rank.out", tmp_path / "rank.pid"
    args = [
        "--model-size", "tiny", "--seq-length", "32", "--data-path", botchan_dataset["prefix"],
        "--tokenizer-model", botchan_dataset["tokenizer"], "--data-cache-path",
        str(tmp_path / "cache"), "--split", "80,10,10", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "2", "--eval-iters", "0",
        "--deepspeed-config", "ds_configs/zero0_fp32.json",
    ]  # fmt: skip
    launcher = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_LAUNCHER), str(free_port()), str(out),
         str(pid_file), delay, *args],
        cwd=REPO, env=ENV, timeout=60,
    )  # fmt: skip
    assert launcher.returncode == 0
    rank = int(pid_file.read_text())
    try:
        deadline = time.monotonic() + 120  # a bound on a loaded machine, not a timing
        while not _gone(rank) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(rank), f"the orphaned rank still runs:\n{out.read_text()[-2000:]}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank, signal.SIGKILL)
    lines = [line for line in out.read_text().splitlines() if ": error: " in line]
    assert len(lines) == 1 and re.fullmatch(
        r"pretrain_taco\.py: error: rank 0: its launcher exited before the rank started "
        r"\(its parent is now \S+, pid \d+\); exiting",
        lines[0],
    ), out.read_text()[-2000:]
    assert "Traceback" not in out.read_text()


# -- a container's init shim as the parent (tini, dumb-init, docker --init) ---------------


def test_a_container_init_shim_as_parent_is_not_judged_an_orphan():
    from megatron_taco.runtime.launcher import orphaned_at_start

    # (parent pid, its name, /proc/1/comm) -> orphaned
    cases = {
        (1, "systemd", "systemd"): True,  # re-parented to the host's init
        (1, "init", "init"): True,
        (1, "?", "?"): True,  # /proc unreadable: PID 1 is no launcher
        (4711, "systemd", "systemd"): True,  # a user manager as subreaper
        (4711, "torchrun", "systemd"): False,
        (4711, "deepspeed", "tini"): False,
        # PID 1 is a container's shim: it started the rank (the pod's command) or adopted
        # it; the parent-death signal decides.
        (1, "tini", "tini"): False,
        (1, "docker-init", "docker-init"): False,
        (1, "dumb-init", "dumb-init"): False,
        # The same shims under their release names (comm holds 15 characters).
        (1, "tini-static", "tini-static"): False,
        (1, "?", "tini-static-amd"): False,
        (1, "dumb-init_1.2.5", "dumb-init_1.2.5"): False,
        (1, "?", "catatonit"): False,  # cmdline unreadable, comm read
        (37, "tini", "pause"): False,  # a pod sharing its process namespace: tini not PID 1
        (0, "?", "python"): False,  # the rank is the container's PID 1 (no parent inside)
    }
    assert {case: orphaned_at_start(*case) for case in cases} == cases


# A parent named "tini" starts the rank directly (the container's command), as in a pod
# whose spec sets the launcher's variables.
_SHIM = """
import subprocess, sys
python, = sys.argv[1:]
code = "from megatron_taco.training.resilience.exit import tie_at_start; tie_at_start('x.py'); print('tied')"
rank = subprocess.run([python, "-c", code], capture_output=True, text=True)
print(rank.returncode, rank.stdout.strip(), rank.stderr.strip())
"""


def test_a_rank_started_by_tini_is_tied_to_it_not_refused(tmp_path):
    shim = tmp_path / "tini"
    shim.symlink_to(sys.executable)
    env = {**ENV, "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1"}
    out = subprocess.run([str(shim), "-c", _SHIM, sys.executable], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.stdout.split("\n")[0] == "0 tied ", out


# -- SIGTERM in start-up: a stop, not a second error line ----------------------------------

_STARTING_RANK = """
import sys, time
sys.path.insert(0, sys.argv[1])
from megatron_taco.training.resilience.exit import tie_at_start
tie_at_start("pretrain_taco.py")
print("tied", flush=True)
time.sleep(60)
"""


def test_sigterm_in_start_up_is_a_stop_line_not_an_error():
    """A launcher tears a rank down with SIGTERM in its start-up when a peer refused its
    input first (the fault campaign's trial 57: rank 1's --load refusal, then rank 0's
    "error: ... SIGTERM received"): the user must read one error, the peer's. The stop is
    said, without "error:", and the exit status is the signal's."""
    env = {**ENV, "LOCAL_RANK": "0", "RANK": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _STARTING_RANK, str(REPO)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "tied"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    assert err.strip() == (
        "pretrain_taco.py: rank 0: SIGTERM received before the rank started; exiting"
    ), err
