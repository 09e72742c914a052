"""The --save lock with real processes: a live holder, a holder killed with SIGKILL, a record
of another host, release and retake in one process (a sweep), and the exit watchdog's
release. The whole path through pretrain_taco.py is in tests/e2e/test_checkpoint_crash.py."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from megatron_taco.checkpoint import ownership as save_lock_module
from megatron_taco.checkpoint.ownership import LOCK_FILENAME, save_lock, take_save_lock
from megatron_taco.errors import ConfigError
from megatron_taco.runtime.procfs import proc_stat
from tests.helpers import ENV, REPO

# Takes the lock on argv[1] (through the exit watchdog's actions), says so, waits.
_HOLDER = """
    import sys, time
    from megatron_taco.checkpoint.ownership import save_lock
    from megatron_taco.training.resilience.exit import ExitConfig, ExitMonitor
    monitor = ExitMonitor(ExitConfig(), program="holder.py")
    monitor.install()
    with save_lock(sys.argv[1], 0, monitor.exit_actions):
        print("holding", flush=True)
        time.sleep(60)
"""


def holder(save) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_HOLDER), str(save)], cwd=REPO, env=ENV,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout.readline() == "holding\n", proc.stderr.read()
    return proc


def record(save) -> dict:
    return json.loads((save / LOCK_FILENAME).read_text())


def test_released_at_the_end_and_taken_again_in_the_same_process(tmp_path):
    for _ in range(2):  # a sweep's runs, one after the other
        with save_lock(str(tmp_path), 0) as lock:
            assert lock is not None and record(tmp_path)["pid"] == os.getpid()
        assert not (tmp_path / LOCK_FILENAME).exists()
    with save_lock(str(tmp_path), 1) as lock:  # only global rank 0 holds it
        assert lock is None and not (tmp_path / LOCK_FILENAME).exists()


def test_a_live_run_is_refused_by_its_host_and_pid(tmp_path):
    proc = holder(tmp_path)
    try:
        with pytest.raises(ConfigError) as refused:
            take_save_lock(str(tmp_path))
        line = str(refused.value)
        assert "\n" not in line
        assert line.startswith(
            f"--save: {tmp_path} is in use by another run (pid {proc.pid} on host "
            f"{socket.gethostname()}, since "
        )
        assert line.endswith(f"{tmp_path / LOCK_FILENAME}): wait for it to end, or give "
                             "another --save")  # fmt: skip
        assert record(tmp_path)["pid"] == proc.pid  # untouched
    finally:
        proc.kill()
        proc.wait()


def test_the_lock_of_a_killed_run_is_taken_over_with_one_line(tmp_path, caplog):
    proc = holder(tmp_path)
    proc.kill()  # kill -9: the record stays, the kernel drops the flock
    proc.wait()
    assert record(tmp_path)["pid"] == proc.pid
    with caplog.at_level(logging.WARNING, logger="megatron_taco.checkpoint.ownership"):
        lock = take_save_lock(str(tmp_path))
    try:
        assert record(tmp_path)["pid"] == os.getpid()
        (message,) = [r.getMessage() for r in caplog.records]
        assert message.startswith(f"--save: {tmp_path / LOCK_FILENAME} was held by pid {proc.pid}")
        assert message.endswith("which is no longer running; taking it over")
    finally:
        lock.release()


def test_the_exit_watchdog_releases_it(tmp_path):
    proc = holder(tmp_path)
    proc.send_signal(signal.SIGTERM)  # outside a training loop: the rank ends at once
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert proc.stderr.read() == "holder.py: rank 0: SIGTERM received during start-up; exiting\n"
    assert not (tmp_path / LOCK_FILENAME).exists()


def _plant(save, **fields) -> None:
    (save / LOCK_FILENAME).write_text(json.dumps({"since": "2026-01-01 00:00:00", **fields}))


def test_records_without_a_flock_holder(tmp_path, caplog):
    # Another host, and its flock free: where flock spans hosts (NFSv4, Lustre -o flock,
    # GPFS) that run is gone (issue 27 item 4: a requeue on another node goes on by itself).
    _plant(tmp_path, host="node-17", pid=4242)
    with caplog.at_level(logging.WARNING, logger="megatron_taco.checkpoint.ownership"):
        take_save_lock(str(tmp_path)).release()
    assert caplog.messages == [
        f"--save: {tmp_path / LOCK_FILENAME} was held by pid 4242 on host node-17, since "
        "2026-01-01 00:00:00, whose lock is free: that run is gone (flock spans hosts here; if "
        "not, pass --save-lock-flock-local); taking it over"
    ]
    # Where flock is local to each host, whether that run lives cannot be told from here.
    _plant(tmp_path, host="node-17", pid=4242)
    with pytest.raises(ConfigError, match=r"in use by a run on another host \(pid 4242 on host "
                       r"node-17, since .*if that run is gone \(its node failed\), remove "):  # fmt: skip
        take_save_lock(str(tmp_path), flock_local=True)
    # This host, a live process that holds no flock (a file system without locks).
    parent = os.getppid()
    _plant(
        tmp_path, host=socket.gethostname(), pid=parent, start_ticks=proc_stat(parent).start_ticks
    )
    with pytest.raises(ConfigError, match=f"is in use by another run \\(pid {parent} on host"):
        take_save_lock(str(tmp_path))
    # The same PID reused by another process (another start time): stale, taken over.
    _plant(tmp_path, host=socket.gethostname(), pid=parent, start_ticks=-1)
    take_save_lock(str(tmp_path)).release()


def test_without_flock_the_file_is_claimed_by_its_creator_alone(tmp_path, monkeypatch):
    # Lustre noflock, NFS nolock: flock fails with ENOLCK. Of two runs started at once, the
    # one whose O_EXCL creation succeeded holds --save; the other finds the file (its record
    # not written yet) and is refused, where a read-then-write claim let both in.
    def no_locks(fd, path):
        return None

    monkeypatch.setattr(save_lock_module, "_flock", no_locks)
    (tmp_path / LOCK_FILENAME).write_bytes(b"")  # created by the other run a moment ago
    with pytest.raises(ConfigError, match=r"in use by another run \(another process \(its "
                       r"record is missing or unreadable\);.*this file system has no locks: if "
                       r"no run uses it, remove "):  # fmt: skip
        take_save_lock(str(tmp_path))
    (tmp_path / LOCK_FILENAME).unlink()
    lock = take_save_lock(str(tmp_path))  # created here: claimed
    assert json.loads((tmp_path / LOCK_FILENAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_run_between_its_flock_and_its_record_is_refused(tmp_path):
    # Two runs started at once: the first has the flock but has not written its record yet.
    code = "import fcntl, os, sys, time\n" \
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n" \
        "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(60)\n"  # fmt: skip
    first = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / LOCK_FILENAME)],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert first.stdout.readline() == "locked\n"
        with pytest.raises(ConfigError, match=r"in use by another run \(another process \(its "
                           r"record is missing or unreadable\);"):  # fmt: skip
            take_save_lock(str(tmp_path))
    finally:
        first.kill()
        first.wait()


def test_a_lock_removed_between_the_open_and_the_flock_is_opened_again(tmp_path, monkeypatch):
    # The holder ends (and removes the file) after this process opened the file and before
    # its flock: that flock holds a file no later run can see, and a third run would take
    # the path too. The timing is made certain by ending the holder right before the flock.
    proc = holder(tmp_path)
    flock, opened = save_lock_module._flock, []

    def after_the_holder_ends(fd, path):
        if not opened:
            proc.send_signal(signal.SIGTERM)  # its exit watchdog releases the lock
            assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        opened.append(os.fstat(fd).st_ino)
        return flock(fd, path)

    monkeypatch.setattr(save_lock_module, "_flock", after_the_holder_ends)
    lock = take_save_lock(str(tmp_path))
    try:
        monkeypatch.setattr(save_lock_module, "_flock", flock)
        with pytest.raises(ConfigError, match=f"in use by another run \\(pid {os.getpid()} "):
            take_save_lock(str(tmp_path))  # another open file: refused by the flock we hold
        assert record(tmp_path)["pid"] == os.getpid() and len(opened) == 2
    finally:
        lock.release()
