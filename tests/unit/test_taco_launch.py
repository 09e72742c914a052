"""taco-launch (megatron_taco/cli/launch.py) as a child subreaper: what is left below it once
the command ended."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_taco.runtime.procfs import proc_stat

# The command forks a process that ignores SIGTERM (as our DataLoader workers do), then exits
# with 3 at once: the fork is re-parented to taco-launch.
_LEAVES_ONE = """
    import os, signal, sys, time
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if sys.argv[-1] == "worker":
            with open("/proc/self/comm", "w") as f:
                f.write("pt_data_worker")  # what torch names a DataLoader worker
        print(os.getpid(), flush=True)
        time.sleep(2 if sys.argv[-1] == "saving rank" else 600)
        os._exit(0)
    time.sleep(0.3)
    os._exit(3)
"""


@pytest.mark.parametrize("left", ["worker", "saving rank"])
def test_a_worker_left_without_its_rank_is_killed_a_saving_rank_waited_for(left):
    cmd = [sys.executable, "-m", "megatron_taco.cli.launch", sys.executable, "-c",
           textwrap.dedent(_LEAVES_ONE), left]  # fmt: skip
    wrapper = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    leftover = None
    try:
        leftover = int(wrapper.stdout.readline())
        started = time.monotonic()
        assert wrapper.wait(timeout=60) == 3  # the command's status
        waited = time.monotonic() - started
    finally:
        wrapper.kill()
        wrapper.wait()
        if leftover is not None and proc_stat(leftover) is not None:
            os.kill(leftover, 9)
    assert proc_stat(leftover) is None or proc_stat(leftover).state == "Z"
    killed = f"launch.py: a DataLoader worker (pid {leftover}) outlived its rank; killed it\n"
    if left == "worker":
        assert wrapper.stderr.read() == killed
    else:  # a rank still saving when its launcher ended: waited for, not killed
        assert wrapper.stderr.read() == "" and waited > 1.5


# A rank still saving when its launcher ended, with a live DataLoader worker: the worker is
# its rank's, not taco-launch's, until the rank exits.
_RANK_WITH_WORKER = """
    import os, signal, time
    if os.fork() == 0:  # the rank
        if os.fork() == 0:  # its worker
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            with open("/proc/self/comm", "w") as f:
                f.write("pt_data_worker")
            print(os.getpid(), flush=True)
            time.sleep(600)
            os._exit(0)
        time.sleep(3)
        os._exit(0)
    os._exit(3)
"""


def test_a_live_ranks_worker_is_left_alone_until_its_rank_exits():
    cmd = [sys.executable, "-m", "megatron_taco.cli.launch", sys.executable, "-c",
           textwrap.dedent(_RANK_WITH_WORKER)]  # fmt: skip
    wrapper = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    worker = None
    try:
        worker = int(wrapper.stdout.readline())
        time.sleep(1)  # the command has exited; the rank still runs
        assert proc_stat(worker) is not None and proc_stat(worker).state != "Z"
        assert wrapper.poll() is None
        assert wrapper.wait(timeout=60) == 3
    finally:
        wrapper.kill()
        wrapper.wait()
        if worker is not None and proc_stat(worker) is not None:
            os.kill(worker, 9)
    assert wrapper.stderr.read() == (
        f"launch.py: a DataLoader worker (pid {worker}) outlived its rank; killed it\n"
    )


_TREE = """
    import os, subprocess, sys, time
    if os.fork() == 0:  # a DataLoader worker of this rank, and a program it runs
        with open("/proc/self/comm", "w") as f:
            f.write("pt_data_worker")
        tool = subprocess.Popen(["sleep", "60"])
        print(os.getpid(), tool.pid, flush=True)
        time.sleep(60)
        os._exit(0)
    time.sleep(60)
"""


def test_only_ranks_are_counted_as_ranks():
    from megatron_taco.cli.launch import ranks_below

    rank = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_TREE)], text=True,
                            stdout=subprocess.PIPE, env={**os.environ, "RANK": "0"})  # fmt: skip
    pids = []
    try:
        pids = list(map(int, rank.stdout.readline().split()))
        worker, tool = pids
        assert set(ranks_below(os.getpid())) & {rank.pid, worker, tool} == {rank.pid}
    finally:
        for pid in pids:
            os.kill(pid, 9)
        rank.kill()
        rank.wait()
