"""The exit-signal handler, the launcher watchdog and the peer-failure line, with real signals
and real processes (the whole path through the deepspeed launcher is in
tests/e2e/test_preemption.py)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest
import torch.multiprocessing as mp

from megatron_taco.arguments import ConfigError, add_dataclass_args, dataclass_from_args
from megatron_taco.training.signals import REPEAT_WINDOW_S, ExitConfig, ExitMonitor, proc_stat
from tests.helpers import ENV, REPO, free_port


def parse(*argv: str) -> ExitConfig:
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, ExitConfig)
    return dataclass_from_args(ExitConfig, parser.parse_args(list(argv)))


def test_flags_defaults_and_spellings():
    config = parse()
    assert config.exit_signal_handler and config.exit_duration_in_mins is None
    assert config.signals == (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    assert config.distributed_timeout == timedelta(minutes=10)
    config = parse("--no-exit-signal-handler", "--exit-signals", " term,10, SIGUSR1,SIGHUP")
    assert not config.exit_signal_handler
    assert config.exit_signals == "SIGTERM,SIGUSR1,SIGHUP"
    assert parse("--distributed-timeout-minutes", "0.05").distributed_timeout.total_seconds() == 3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--exit-signals", "SIGKILL"], "--exit-signals: SIGKILL is not a signal that can be"),
        (["--exit-signals", "TERM,NOPE"], "--exit-signals: NOPE is not a signal"),
        (["--exit-signals", ","], "--exit-signals: give at least one, e.g. SIGTERM,SIGINT"),
        (["--exit-duration-in-mins", "inf"], "--exit-duration-in-mins: must be > 0, got inf"),
        (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins: must be > 0, got 0.0"),
        (["--distributed-timeout-minutes", "-1"], "--distributed-timeout-minutes: must be > 0"),
    ],
)
def test_bad_values_name_the_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse(*argv)


def wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_signal_only_sets_the_flag_and_teardown_restores_the_handlers():
    def previous(signum, frame):
        pass

    before = signal.signal(signal.SIGUSR1, previous)
    monitor = ExitMonitor(ExitConfig(exit_signals="SIGUSR1,SIGUSR2"), repeat_window=60)
    try:
        monitor.install()
        assert monitor.should_exit("cpu") is None
        os.kill(os.getpid(), signal.SIGUSR1)
        wait_for(lambda: monitor.received)
        # A repeat within the window (a launcher forwarding the group's signal) is the same
        # request; another kind does not replace the first.
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.1)
        assert monitor.received == signal.SIGUSR1
        assert monitor.should_exit("cpu") == "SIGUSR1 received (--exit-signal-handler)"
    finally:
        monitor.uninstall()
        assert signal.getsignal(signal.SIGUSR1) is previous
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL
        signal.signal(signal.SIGUSR1, before)


def test_time_limit_is_measured_from_the_process_start():
    # A fresh process: its start lies between "before" and its own first statement (the
    # kernel's boot time has 1 s resolution, hence the slack).
    before = time.time()
    code = (
        "import time; t = time.time()\n"
        "from megatron_taco.training.signals import ExitConfig, ExitMonitor\n"
        "print(ExitMonitor(ExitConfig()).start_time, t)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=ENV, capture_output=True, text=True, check=True
    )
    started, first_statement = map(float, out.stdout.split())
    assert before - 1.5 < started <= first_statement + 1.5
    monitor = ExitMonitor(ExitConfig(exit_duration_in_mins=1e-6))
    assert monitor.should_exit("cpu") == "--exit-duration-in-mins 1e-06 reached"
    assert ExitMonitor(ExitConfig(exit_duration_in_mins=600)).should_exit("cpu") is None


def python(code: str, *args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO, env={**ENV, **env},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


# Installs the handler (the default repeat window), says so, reports the first flag, then
# keeps running.
_HANDLER_CHILD = """
    import sys, time
    from megatron_taco.training.signals import ExitConfig, ExitMonitor
    monitor = ExitMonitor(ExitConfig())
    monitor.install()
    print("ready", flush=True)
    while not monitor.received:
        time.sleep(0.01)
    print("flag", monitor.received, flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_after_the_window_takes_the_default_action(signum):
    child = python(_HANDLER_CHILD)
    try:
        assert child.stdout.readline() == "ready\n"
        child.send_signal(signum)
        first = time.monotonic()
        assert child.stdout.readline() == f"flag {int(signum)}\n"
        child.send_signal(signum)  # within the window (a launcher's forwarded copy): one request
        time.sleep(0.3)
        assert child.poll() is None
        time.sleep(max(0.0, first + REPEAT_WINDOW_S + 0.2 - time.monotonic()))
        assert child.poll() is None
        child.send_signal(signum)  # a user's second Ctrl-C
        assert child.wait(timeout=10) == -signum
        assert "Traceback" not in child.stderr.read()  # killed, not a KeyboardInterrupt
    finally:
        child.kill()
        child.wait()


_WORKER_CHILD = """
    import os, sys, time, torch
    from megatron_taco.training.signals import ExitConfig, ExitMonitor, get_pdeathsig

    class Pids(torch.utils.data.Dataset):
        def __len__(self):
            return 100
        def __getitem__(self, i):
            return os.getpid(), get_pdeathsig()

    monitor = ExitMonitor(ExitConfig())
    monitor.install()
    loader = torch.utils.data.DataLoader(
        Pids(), batch_size=None, num_workers=1, worker_init_fn=monitor.worker_init_fn
    )
    it = iter(loader)
    worker, pdeathsig = next(it)
    print(worker, pdeathsig, flush=True)
    if sys.argv[-1] == "exit":
        sys.stdin.readline()
        sys.exit(0)  # with the iterator still alive: the atexit hook must end the worker
    time.sleep(60)
"""


def test_dataloader_workers_ignore_exit_signals_and_die_with_their_rank():
    child = python(_WORKER_CHILD, "exit")
    try:
        worker, pdeathsig = map(int, child.stdout.readline().split())
        assert pdeathsig == signal.SIGKILL
        os.kill(worker, signal.SIGTERM)  # the group's or the launcher's signal
        time.sleep(0.3)
        assert proc_stat(worker) is not None and child.poll() is None
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=20) == 0
    finally:
        child.kill()
        child.wait()

    child = python(_WORKER_CHILD)
    try:
        worker, _ = map(int, child.stdout.readline().split())
        child.kill()  # the rank dies: its worker must not keep its sockets open
        wait_for(lambda: proc_stat(worker) is None or proc_stat(worker).state == "Z")
    finally:
        child.kill()
        child.wait()


# A launcher that starts one rank; the rank reports what it noticed once its launcher died.
_LAUNCHER = """
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=open(sys.argv[2], "w"))
    time.sleep(60)
"""
_RANK = """
    import os, sys, time
    from megatron_taco.training.signals import ExitConfig, ExitMonitor
    handler = os.environ["HANDLER"] == "1"
    monitor = ExitMonitor(ExitConfig(exit_signal_handler=handler), watchdog_interval=0.05)
    monitor.install()
    print(os.getpid(), flush=True)
    while not (monitor.received and monitor.launcher_gone):
        time.sleep(0.01)
    print(monitor.received, monitor.launcher_gone, flush=True)
"""


@pytest.mark.parametrize("handler", [True, False])
def test_a_rank_stops_when_its_launcher_dies(tmp_path, handler):
    out = tmp_path / "rank.out"
    # LOCAL_RANK: what deepspeed and torchrun set, and what ties a rank to its launcher.
    launcher = python(_LAUNCHER, textwrap.dedent(_RANK), str(out), LOCAL_RANK="0",
                      HANDLER=str(int(handler)))  # fmt: skip
    try:
        wait_for(lambda: out.is_file() and out.read_text().endswith("\n"), timeout=30)
        rank = int(out.read_text().split()[0])
        launcher.kill()  # kill -9: it forwards nothing
        wait_for(lambda: proc_stat(rank) is None or proc_stat(rank).state == "Z")
    finally:
        launcher.kill()
        launcher.wait()
    lines = out.read_text().splitlines()
    if handler:  # PR_SET_PDEATHSIG's SIGTERM and the watchdog: save and exit at the boundary
        assert lines[1] == f"{int(signal.SIGTERM)} launcher process {launcher.pid} exited"
    else:  # no handler: the kernel's SIGTERM ends the rank at once
        assert len(lines) == 1


# -- a peer that dies or hangs, over real gloo process groups --------------------------------


def _peer(rank: int, port: int, mode: str, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2"
    )
    import torch
    import torch.distributed as dist

    from megatron_taco.training.engine import init_distributed
    from megatron_taco.training.signals import describe_peer_failure, gather_peers, is_peer_failure

    parallel = init_distributed(1, timeout=timedelta(minutes=0.05))
    peers = gather_peers()
    if rank == 1:
        queue.put("ready")
        queue.close()
        queue.join_thread()  # flushed before the process vanishes
        if mode == "dies":
            os._exit(3)
        time.sleep(60)  # hangs
    try:
        # On the data-parallel subgroup: its timeout must be ours too, not torch's 30 min.
        dist.all_reduce(torch.ones(1), group=parallel.get_data_parallel_group())
        queue.put("no error")
    except Exception as error:
        ok = is_peer_failure(error)
        queue.put(describe_peer_failure(error, 0, peers, 0.05) if ok else repr(error))


@pytest.mark.parametrize("mode", ["dies", "hangs"])
def test_a_dead_or_hung_peer_is_one_line(mode):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_peer, args=(r, port, mode, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        assert queue.get(timeout=60) == "ready"
        start = time.monotonic()
        line = queue.get(timeout=60)
        took = time.monotonic() - start
    finally:
        for p in procs:
            p.kill()
            p.join()
    if mode == "dies":
        assert line.startswith(f"rank 0: rank 1 (pid {procs[1].pid}) has died; all_reduce (")
        assert took < 5
    else:
        assert line.startswith("rank 0: all_reduce (") and "test_signals.py:" in line
        assert "timed out after --distributed-timeout-minutes 0.05: a rank hung" in line
        assert 2.5 < took < 15
