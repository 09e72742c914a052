"""The exit-signal handler, the launcher watchdog and the peer-failure line, with real signals
and real processes (the whole path through the deepspeed launcher is in
tests/e2e/test_preemption.py)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest
import torch.multiprocessing as mp

from megatron_taco.arguments import add_dataclass_args, dataclass_from_args
from megatron_taco.errors import ConfigError
from megatron_taco.parallel.config import ParallelConfig
from megatron_taco.runtime.procfs import proc_stat
from megatron_taco.training.resilience.exit import REPEAT_WINDOW_S, ExitConfig, ExitMonitor
from tests.helpers import ENV, REPO, free_port
from tests.processes import reap


class _Flags:
    """ExitConfig and ParallelConfig (the process groups' timeouts) of one command line."""

    def __init__(self, *configs) -> None:
        self.configs = configs

    def __getattr__(self, name):
        owner = next((c for c in self.configs if hasattr(c, name)), self.configs[0])
        return getattr(owner, name)


def parse(*argv: str) -> _Flags:
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, ExitConfig)
    add_dataclass_args(parser, ParallelConfig)
    args = parser.parse_args(list(argv))
    return _Flags(dataclass_from_args(ExitConfig, args), dataclass_from_args(ParallelConfig, args))


def test_flags_defaults_and_spellings():
    config = parse()
    assert config.exit_signal_handler and config.exit_duration_in_mins is None
    assert config.signals == (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    assert config.distributed_timeout == timedelta(minutes=10)
    config = parse("--no-exit-signal-handler", "--exit-signals", " term,10, SIGUSR1,SIGHUP")
    assert not config.exit_signal_handler
    assert config.exit_signals == "SIGTERM,SIGUSR1,SIGHUP"
    assert parse("--distributed-timeout-minutes", "0.05").distributed_timeout.total_seconds() == 3
    assert parse().orphan_grace_seconds == 30
    assert parse("--orphan-grace-seconds", "0").orphan_grace_seconds == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--exit-signals", "SIGKILL"], "--exit-signals: SIGKILL is not a signal that can be"),
        (["--exit-signals", "TERM,NOPE"], "--exit-signals: NOPE is not a signal"),
        (["--exit-signals", ","], "--exit-signals: give at least one, e.g. SIGTERM,SIGINT"),
        (["--exit-duration-in-mins", "inf"], "--exit-duration-in-mins: must be > 0, got inf"),
        (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins: must be > 0, got 0.0"),
        (["--distributed-timeout-minutes", "-1"], "--distributed-timeout-minutes: must be > 0"),
        (["--filesystem-timeout-minutes", "0"], "--filesystem-timeout-minutes: must be > 0"),
        (["--orphan-grace-seconds", "-1"], "--orphan-grace-seconds: must be a number of seconds"),
        (["--orphan-grace-seconds", "inf"], "--orphan-grace-seconds: .* got inf"),
        (["--filesystem-timeout-minutes", "nan"], "--filesystem-timeout-minutes: must be > 0"),
        (
            ["--filesystem-timeout-minutes", "1e13"],
            "--filesystem-timeout-minutes: .* got 10000000000000.0",
        ),
        (
            ["--distributed-timeout-minutes", "1e13"],
            "--distributed-timeout-minutes: .* got 10000000000000.0",
        ),
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


def _decision(monitor: ExitMonitor) -> str | None:
    # One rank's flags are what the loop's all-reduce over one rank returns.
    return monitor.reason(monitor.local_flags())


def test_a_signal_only_sets_the_flag_and_teardown_restores_the_handlers():
    def previous(signum, frame):
        pass

    before = signal.signal(signal.SIGUSR1, previous)
    monitor = ExitMonitor(ExitConfig(exit_signals="SIGUSR1,SIGUSR2"), repeat_window=60)
    try:
        monitor.install()
        with monitor.deferred():  # the training loop: outside, the signal would end pytest
            assert _decision(monitor) is None
            os.kill(os.getpid(), signal.SIGUSR1)
            wait_for(lambda: monitor.received)
            # A repeat within the window (a launcher forwarding the group's signal) is the
            # same request; another kind does not replace the first.
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(0.1)
            assert monitor.received == signal.SIGUSR1
            assert _decision(monitor) == "SIGUSR1 received (--exit-signal-handler)"
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
        "from megatron_taco.training.resilience.exit import ExitConfig, ExitMonitor\n"
        "print(ExitMonitor(ExitConfig()).start_time, t)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=ENV, capture_output=True, text=True, check=True
    )
    started, first_statement = map(float, out.stdout.split())
    assert before - 1.5 < started <= first_statement + 1.5
    monitor = ExitMonitor(ExitConfig(exit_duration_in_mins=1e-6))
    assert _decision(monitor) == "--exit-duration-in-mins 1e-06 reached"
    assert _decision(ExitMonitor(ExitConfig(exit_duration_in_mins=600))) is None


def python(code: str, *args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO, env={**ENV, **env},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


# Installs the handler (the default repeat window), enters the training loop, says so,
# reports the first flag, then keeps running (a save).
_HANDLER_CHILD = """
    import sys, time
    from megatron_taco.training.resilience.exit import ExitConfig, ExitMonitor
    monitor = ExitMonitor(ExitConfig())
    monitor.install()
    with monitor.deferred():
        print("ready", flush=True)
        while not monitor.received:
            time.sleep(0.01)
        print("flag", monitor.received, flush=True)
        time.sleep(60)
"""


def test_a_second_ctrl_c_after_the_window_takes_the_default_action():
    child = python(_HANDLER_CHILD)
    try:
        assert child.stdout.readline() == "ready\n"
        child.send_signal(signal.SIGINT)
        first = time.monotonic()
        assert child.stdout.readline() == f"flag {int(signal.SIGINT)}\n"
        child.send_signal(signal.SIGINT)  # within the window (a launcher's forwarded copy)
        time.sleep(0.3)
        assert child.poll() is None
        time.sleep(max(0.0, first + REPEAT_WINDOW_S + 0.2 - time.monotonic()))
        assert child.poll() is None
        child.send_signal(signal.SIGINT)  # a person's second Ctrl-C
        assert child.wait(timeout=10) == -signal.SIGINT
        assert "Traceback" not in child.stderr.read()  # killed, not a KeyboardInterrupt
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("first", [signal.SIGUSR1, signal.SIGTERM])
def test_later_signals_are_absorbed_until_the_save_is_done(first):
    # SLURM: the time-limit warning (USR1) starts a save; scancel's TERM, which launch.sh
    # forwards as USR1, or the time limit's TERM arrive while it is being written.
    child = python(_HANDLER_CHILD)
    try:
        assert child.stdout.readline() == "ready\n"
        child.send_signal(first)
        assert child.stdout.readline() == f"flag {int(first)}\n"
        time.sleep(REPEAT_WINDOW_S + 0.3)
        for later in (signal.SIGUSR1, signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            child.send_signal(later)
            time.sleep(0.1)
        time.sleep(0.3)
        assert child.poll() is None, child.stderr.read()
    finally:
        child.kill()
        child.wait()


# A save in the loop that nothing answers (the signal came after the iteration's flags were
# read): it completes, then the rank ends with one line.
_SAVING_CHILD = """
    import sys, time
    from megatron_taco.training.resilience.exit import ExitConfig, ExitMonitor
    monitor = ExitMonitor(ExitConfig(), program="rank.py")
    monitor.install()
    with monitor.deferred():
        print("saving", flush=True)
        time.sleep(1.5)
        open(sys.argv[1], "w").write("complete")
    print("not reached", flush=True)
"""


def test_a_signal_during_a_save_waits_for_it_then_ends_the_rank(tmp_path):
    saved = tmp_path / "checkpoint"
    child = python(_SAVING_CHILD, str(saved))
    try:
        assert child.stdout.readline() == "saving\n"
        child.send_signal(signal.SIGTERM)
        code = child.wait(timeout=30)
    finally:
        child.kill()
        child.wait()
    assert saved.read_text() == "complete"
    assert code == 128 + signal.SIGTERM and child.stdout.read() == ""
    assert child.stderr.read() == "rank.py: rank 0: SIGTERM received during training; exiting\n"


_WORKER_CHILD = """
    import os, sys, time, torch
    from megatron_taco.runtime.procfs import get_pdeathsig
    from megatron_taco.training.resilience.exit import ExitConfig, ExitMonitor

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


# The rank dies between forking a DataLoader worker and the worker's init (a fault-campaign
# trial under load): the worker, deaf to SIGTERM, outlived the job and held its launcher.
_ORPHANED_BEFORE_INIT = """
    import os, sys, time, torch
    from megatron_taco.training.resilience.exit import ExitConfig, ExitMonitor

    monitor = ExitMonitor(ExitConfig(exit_signal_handler=sys.argv[-1] == "handler"))
    monitor.install()
    ours = monitor.worker_init_fn  # built in the rank, as its DataLoader is
    assert ours is not None
    rank = os.getpid()

    def init(worker_id):  # runs in the worker, before torch's watchdog exists
        print(os.getpid(), flush=True)
        while os.getppid() == rank:
            time.sleep(0.01)
        ours(worker_id)
        print("survived", flush=True)

    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return 10
        def __getitem__(self, i):
            return i

    it = iter(torch.utils.data.DataLoader(Items(), num_workers=1, worker_init_fn=init))
    sys.stdin.readline()
    os._exit(0)
"""


@pytest.mark.parametrize("handler", ["handler", "no-handler"])  # --no-exit-signal-handler
def test_dataloader_worker_whose_rank_died_before_its_init_exits(handler):
    child = python(_ORPHANED_BEFORE_INIT, handler)
    worker = None
    try:
        worker = int(child.stdout.readline())
        child.stdin.write("\n")  # the rank dies before its worker's init ran
        child.stdin.flush()
        assert child.wait(timeout=20) == 0
        wait_for(lambda: proc_stat(worker) is None or proc_stat(worker).state == "Z")
        assert child.stdout.read() == ""  # not "survived"
    finally:
        reap(child, worker)


def test_dataloader_worker_tells_its_rank_from_a_process_that_took_its_pid():
    from megatron_taco.training.resilience.exit import ignore_in_worker

    init = proc_stat(1)  # a live process that is not the worker's parent (as under forkserver)

    def survives(rank) -> bool:
        pid = os.fork()
        if pid == 0:
            ignore_in_worker((), rank)
            os._exit(7)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7

    assert survives((1, init.start_ticks))  # the rank itself, alive
    assert not survives((1, init.start_ticks + 1))  # another process on the rank's pid
    assert survives((os.getpid(), -1))  # the worker's parent: no /proc needed


# A launcher that starts one rank; the rank reports what it noticed once its launcher died.
_LAUNCHER = """
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=open(sys.argv[2], "w"),
                     stderr=subprocess.STDOUT)
    time.sleep(60)
"""
_RANK = """
    import os, sys, time
    from megatron_taco.training.resilience.exit import ExitConfig, ExitMonitor
    mode = os.environ["MODE"]
    config = ExitConfig(exit_signal_handler=mode != "no handler")
    monitor = ExitMonitor(config, watchdog_interval=0.05, program="rank.py")
    monitor.install()
    monitor.phase = "data set-up"
    print(os.getpid(), flush=True)
    if mode != "loop":
        time.sleep(60)
        sys.exit("still running")
    with monitor.deferred():
        while not (monitor.received and monitor.launcher_gone):
            time.sleep(0.01)
        print(monitor.received, monitor.launcher_gone, flush=True)
        monitor.reason(monitor.local_flags())  # the loop answers: it saves, and returns
        time.sleep(0.3)
    print("saved and returned", flush=True)
"""


# deepspeed and torchrun set LOCAL_RANK; mpirun's ranks have only MPI's variables until
# MPI discovery: each ties a rank to its launcher.
LAUNCHER_ENVS = {"deepspeed/torchrun": {"LOCAL_RANK": "0"},
                 "mpich": {"PMI_RANK": "0", "PMI_SIZE": "1"},
                 "open mpi": {"OMPI_COMM_WORLD_RANK": "0"}}  # fmt: skip


@pytest.mark.parametrize("launched_by", sorted(LAUNCHER_ENVS))
@pytest.mark.parametrize("mode", ["loop", "outside", "no handler"])
def test_a_rank_stops_when_its_launcher_dies(tmp_path, mode, launched_by):
    out = tmp_path / "rank.out"
    env = {**LAUNCHER_ENVS[launched_by], "MODE": mode}
    launcher = python(_LAUNCHER, textwrap.dedent(_RANK), str(out), **env)
    try:
        wait_for(lambda: out.is_file() and out.read_text().endswith("\n"), timeout=30)
        rank = int(out.read_text().split()[0])
        launcher.kill()  # kill -9: it forwards nothing
        wait_for(lambda: proc_stat(rank) is None or proc_stat(rank).state == "Z")
    finally:
        launcher.kill()
        launcher.wait()
    lines = out.read_text().splitlines()
    gone = f"launcher process {launcher.pid} (python) exited"
    if mode == "loop":  # PR_SET_PDEATHSIG's SIGTERM and the watchdog: save and exit
        assert lines[1:] == [f"{int(signal.SIGTERM)} {gone}", "saved and returned"]
    elif mode == "outside":  # nothing reads the flags: one line, at once
        assert lines[1:] == [f"rank.py: error: rank 0: {gone} during data set-up; exiting"]
    else:  # no handler: the kernel's SIGTERM ends the rank at once
        assert len(lines) == 1


# A rank whose exit save takes SAVE_S seconds (a stalled peer in the real one).
_SAVING_RANK = """
    import os, time
    from megatron_taco.training.resilience.exit import ExitConfig, ExitMonitor
    config = ExitConfig(orphan_grace_seconds=1)
    monitor = ExitMonitor(config, watchdog_interval=0.05, program="rank.py")
    monitor.install()
    monitor.last_complete = lambda: "the last complete checkpoint is ckpt/iter_0000004"
    print(os.getpid(), flush=True)
    with monitor.deferred():
        while not monitor.received:
            time.sleep(0.01)
        monitor.reason(monitor.local_flags())  # the loop answers with a save
        with monitor.doing("the exit save of iteration 5"):
            time.sleep(float(os.environ["SAVE_S"]))
    print("saved and returned", flush=True)
"""


@pytest.mark.parametrize("launcher_dies", [True, False])
def test_a_rank_without_its_launcher_abandons_its_exit_save_after_the_grace(
    tmp_path, launcher_dies
):
    out = tmp_path / "rank.out"
    save_s = "600" if launcher_dies else "3"  # the living launcher's: longer than the grace
    launcher = python(_LAUNCHER, textwrap.dedent(_SAVING_RANK), str(out), LOCAL_RANK="0",
                      SAVE_S=save_s)  # fmt: skip
    try:
        wait_for(lambda: out.is_file() and out.read_text().endswith("\n"), timeout=30)
        rank = int(out.read_text().split()[0])
        if launcher_dies:
            launcher.kill()  # kill -9: the kernel's SIGTERM asks for the exit
        else:
            os.kill(rank, signal.SIGTERM)
        wait_for(lambda: proc_stat(rank) is None or proc_stat(rank).state == "Z", timeout=30)
        assert launcher.poll() is None or launcher_dies
    finally:
        launcher.kill()
        launcher.wait()
    lines = out.read_text().splitlines()[1:]
    if launcher_dies:  # before: in its save until the peer's timeout (10 or 60 min)
        assert lines == [
            f"rank.py: error: rank 0: launcher process {launcher.pid} (python) exited during "
            "training; the exit save of iteration 5 was abandoned 1 s later "
            "(--orphan-grace-seconds); the last complete checkpoint is ckpt/iter_0000004; "
            "exiting"
        ]
    else:
        assert lines == ["saved and returned"]


# The deepspeed runner -> its per-node launcher -> a rank in its exit save (SAVE_S seconds),
# asked for by the runner's death alone: the per-node launcher, its parent, lives.
_RUNNER_SAVING_RANK = """
    import os, time
    from megatron_taco.training.resilience.exit import ExitConfig, ExitMonitor
    config = ExitConfig(orphan_grace_seconds=1)
    monitor = ExitMonitor(config, watchdog_interval=0.05, program="rank.py")
    monitor.install()
    print("pid", os.getpid(), flush=True)
    with monitor.deferred():
        while not monitor.launcher_gone:
            time.sleep(0.01)
        monitor.reason(monitor.local_flags())  # the loop answers with a save
        print("saving", flush=True)
        with monitor.doing("the exit save of iteration 5"):
            time.sleep(float(os.environ["SAVE_S"]))
    print("saved and returned", flush=True)
"""


@contextlib.contextmanager
def _launched_rank(runner, out):
    """(rank PID, launcher PID) of the runner -> launcher -> rank tree ``runner`` started (the
    rank prints "pid N" into ``out``); whatever is left of it is killed at the end."""
    launcher = None
    try:
        wait_for(lambda: "pid " in (out.read_text() if out.is_file() else ""), timeout=60)
        rank = int(out.read_text().split("pid ")[1].split()[0])
        launcher = proc_stat(rank).ppid
        yield rank, launcher
    finally:
        reap(runner, launcher)


@pytest.mark.parametrize("then", ["launcher lives", "launcher dies"])
def test_the_runners_death_alone_leaves_the_exit_save_to_the_living_launcher(tmp_path, then):
    # The per-node launcher gives its ranks no deadline while it lives (it got no signal):
    # the grace mirrors the SIGKILL of a launcher that is itself going, so it starts only
    # when the rank's own launcher dies, and that death is still watched for.
    out = tmp_path / "rank.out"
    save_s = "4" if then == "launcher lives" else "600"
    runner = python(_RUNNER, textwrap.dedent(_NODE_LAUNCHER), textwrap.dedent(_RUNNER_SAVING_RANK),
                    str(out), SAVE_S=save_s)  # fmt: skip
    with _launched_rank(runner, out) as (rank, launcher):
        runner.kill()
        wait_for(lambda: "saving" in out.read_text(), timeout=10)
        if then == "launcher dies":
            os.kill(launcher, signal.SIGKILL)
        wait_for(lambda: proc_stat(rank) is None or proc_stat(rank).state == "Z", timeout=30)
    lines = out.read_text().splitlines()[2:]
    if then == "launcher lives":  # before: abandoned 1 s after the runner's death
        assert lines == ["saved and returned"]
    else:
        assert lines == [
            f"rank.py: error: rank 0: launcher process {launcher} (python) exited during "
            "training; the exit save of iteration 5 was abandoned 1 s later "
            "(--orphan-grace-seconds); exiting"
        ]


# A launcher that hosts the rendezvous store (as torchrun's agent does) and reports its
# rank's exit code; the rank connects and waits in C++, where no Python handler runs.
_STORE_LAUNCHER = """
    import os, signal, subprocess, sys, time
    from datetime import timedelta
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    rank = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(store.port)],
                            stdout=open(sys.argv[2], "w"), stderr=subprocess.STDOUT)

    def close_then_die(*_):
        # The order of a launcher killed outright, made certain: its store's connection
        # closes, then (a moment later) its children are re-parented.
        global store
        del store
        time.sleep(0.2)
        os._exit(0)

    signal.signal(signal.SIGUSR1, close_then_die)
    print("code", rank.wait(), flush=True)
"""
_STORE_RANK = """
    import os, sys
    from datetime import timedelta
    import torch.distributed as dist
    from megatron_taco.training.resilience.exit import ExitConfig, ExitMonitor
    monitor = ExitMonitor(ExitConfig(), program="rank.py")
    monitor.tie_to_launcher()
    monitor.install()
    monitor.phase = "the rendezvous"
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False,
                          timeout=timedelta(seconds=600))
    print(os.getpid(), flush=True)
    with monitor.answering_errors():  # as the driver's run: the store may raise first
        store.wait(["never set"])
    print("the wait returned", flush=True)
"""


@pytest.mark.parametrize("event", ["launcher killed", "store closed, launcher gone", "SIGTERM"])
def test_a_rank_blocked_in_the_rendezvous_ends_with_one_line(tmp_path, event):
    out = tmp_path / "rank.out"
    launcher = python(_STORE_LAUNCHER, textwrap.dedent(_STORE_RANK), str(out), LOCAL_RANK="0")
    try:
        wait_for(lambda: out.is_file() and out.read_text().endswith("\n"), timeout=60)
        rank = int(out.read_text().split()[0])
        time.sleep(0.5)  # inside store.wait()
        if event == "SIGTERM":
            os.kill(rank, signal.SIGTERM)
        elif event == "launcher killed":
            launcher.kill()
        else:  # the store's error reaches the rank before anything shows the launcher died
            launcher.send_signal(signal.SIGUSR1)
        # Long before the store's own timeout (600 s) would give the main thread back.
        wait_for(lambda: proc_stat(rank) is None or proc_stat(rank).state == "Z", timeout=30)
        if event == "SIGTERM":
            assert launcher.stdout.readline() == f"code {128 + signal.SIGTERM}\n"
    finally:
        launcher.kill()
        launcher.wait()
    # A signal is a stop (no "error:": a launcher sends it when a peer failed first); a dead
    # launcher is an error.
    what = (
        "rank 0: SIGTERM received"
        if event == "SIGTERM"
        else f"error: rank 0: launcher process {launcher.pid} (python) exited"
    )
    text = out.read_text()
    ours = [line for line in text.splitlines() if line.startswith("rank.py")]
    assert ours == [f"rank.py: {what} during the rendezvous; exiting"]
    assert "Traceback" not in text


# The deepspeed runner -> its per-node launcher -> a rank still parsing its flags and
# verifying the checkpoint (slow here on purpose), before any handler exists.
_RUNNER = """
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3],
                      "deepspeed.launcher.launch"])
    time.sleep(60)
"""
_NODE_LAUNCHER = """
    import os, subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=open(sys.argv[2], "w"),
                     stderr=subprocess.STDOUT, env={**os.environ, "LOCAL_RANK": "0"})
    time.sleep(60)
"""
_SLOW_START_RANK = """
    import os, sys, time
    from megatron_taco.recipes.taco import SPEC
    from megatron_taco.training import driver

    def slow(spec, args, **kw):
        print("pid", os.getpid(), flush=True)
        time.sleep(60)  # a checkpoint of many GB being checksummed
        raise SystemExit("still running: not tied to the launcher")

    driver.configs_from_args = slow
    driver.main(SPEC, ["--data-path", "x", "--tokenizer-model", "x", "--train-iters", "1",
               "--micro-batch-size", "1"])
"""


@pytest.mark.parametrize("dies", ["launcher", "runner"])
def test_a_rank_is_tied_to_its_launcher_before_its_flags_are_checked(tmp_path, dies):
    out = tmp_path / "rank.out"
    runner = python(_RUNNER, textwrap.dedent(_NODE_LAUNCHER), textwrap.dedent(_SLOW_START_RANK),
                    str(out))  # fmt: skip
    with _launched_rank(runner, out) as (rank, launcher):
        os.kill(launcher if dies == "launcher" else runner.pid, signal.SIGKILL)
        # The kernel's death signal (launcher) or the watchdog (runner), within seconds.
        wait_for(lambda: proc_stat(rank) is None or proc_stat(rank).state == "Z", timeout=10)
    who = launcher if dies == "launcher" else runner.pid
    lines = [line for line in out.read_text().splitlines() if ": error: " in line]
    assert lines == [
        f"pretrain_taco.py: error: rank 0: launcher process {who} (python) exited during "
        "start-up; exiting"
    ]


# -- a peer that dies or hangs, over real gloo process groups --------------------------------


def _peer(rank: int, port: int, mode: str, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2"
    )
    import torch
    import torch.distributed as dist

    from megatron_taco.training.engine import init_distributed
    from megatron_taco.training.resilience.peers import (
        describe_peer_failure,
        gather_peers,
        is_peer_failure,
    )

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


# -- NCCL, apart from NCCL (no GPU here): the environment, the peer watch, the one line ------


def test_nccl_environment_makes_errors_raise_and_keeps_the_users_settings():
    from megatron_taco.training.resilience.peers import nccl_environment

    assert nccl_environment({}) == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",  # abort the communicators, keep the process
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    }
    assert nccl_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}) == {
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"
    }


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_peer_watch_reports_a_dead_local_rank_at_once():
    from megatron_taco.training.resilience.peers import Peer, PeerWatch

    procs = [_sleeper(), _sleeper()]
    me = Peer("here", os.getpid(), proc_stat(os.getpid()).start_ticks)
    peers = [me] + [Peer("here", p.pid, proc_stat(p.pid).start_ticks) for p in procs]
    peers.append(Peer("elsewhere", procs[0].pid, 0))  # another node: not watched
    calls = []
    watch = PeerWatch(peers, 0, calls.append, interval=0.05).start()
    try:
        time.sleep(0.3)
        assert calls == []
        procs[1].kill()
        procs[1].wait()
        wait_for(lambda: calls, timeout=5)
        assert calls == [[2]] and watch.dead == [2]
    finally:
        watch.stop()
        for p in procs:
            p.kill()
            p.wait()


def _raised_in_all_reduce(error: BaseException) -> BaseException:
    """``error`` as a collective raises it: from inside torch.distributed.all_reduce."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    real = distributed_c10d._get_default_group

    def fail():
        raise error

    distributed_c10d._get_default_group = fail
    try:
        dist.all_reduce(torch.ones(1))
    except BaseException as e:
        return e
    finally:
        distributed_c10d._get_default_group = real
    raise AssertionError("all_reduce did not raise")


# NCCL's own words (ProcessGroupNCCL / NCCLUtils), as DistBackendError carries them.
NCCL_TIMEOUT = (
    "[PG ID 0 PG GUID 0(default_pg) Rank 0] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for "
    "600013 milliseconds before timing out."
)
NCCL_ABORTED = "NCCL communicator was aborted on rank 0. Original reason for failure was: "
NCCL_REMOTE = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:2027, remote "
    "process exited or there was a network error, NCCL version 2.21.5\n"
    "ncclRemoteError: A call failed possibly due to a network error or a remote process "
    "exiting prematurely.\nLast error:\nsocketProgress: Connection closed by remote peer"
)


def test_nccl_errors_are_one_line():
    import torch.distributed as dist

    from megatron_taco.training.resilience.peers import (
        Peer,
        describe_peer_failure,
        is_peer_failure,
    )

    dead = _sleeper()
    dead.kill()
    dead.wait()
    me = Peer("here", os.getpid(), proc_stat(os.getpid()).start_ticks)
    alone = [me, Peer("far", 1, 0)]
    with_dead = [me, Peer("here", dead.pid, 0)]
    cases = [
        (NCCL_TIMEOUT, alone, "rank 0: all_reduce ("),
        (NCCL_ABORTED + NCCL_TIMEOUT, with_dead, f"rank 0: rank 1 (pid {dead.pid}) has died; "),
        (NCCL_REMOTE, alone, "rank 0: a rank on another node failed or closed the connection"),
    ]
    for text, peers, start in cases:
        error = _raised_in_all_reduce(dist.DistBackendError(text))
        assert is_peer_failure(error)
        line = describe_peer_failure(error, 0, peers, 10, wait=0.1)
        assert line.startswith(start) and "\n" not in line, line
        assert "all_reduce (" in line and "test_signals.py:" in line, line
        assert line.endswith("; exiting"), line
    timeout = describe_peer_failure(_raised_in_all_reduce(dist.DistBackendError(NCCL_TIMEOUT)),
                                    0, alone, 10, wait=0.1)  # fmt: skip
    assert "timed out after --distributed-timeout-minutes 10: a rank hung" in timeout
    assert "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7" in timeout
    remote = describe_peer_failure(_raised_in_all_reduce(dist.DistBackendError(NCCL_REMOTE)),
                                   0, alone, 10, wait=0.1)  # fmt: skip
    assert "(NCCL: remote process exited or there was a network error" in remote
