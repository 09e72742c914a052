"""Who may write in --save: a run never removes, replaces or rewinds checkpoints (or store data)
it did not write, and two runs never write one --save at once.

One run per --save: an exclusive lock held for the life of the run.

Two runs saving into one directory interleave their checkpoints (a requeued job that
overlaps its predecessor, a command typed twice). ``{save}/run.lock`` is taken by the run's
global rank 0 before any process group exists (the launcher's RANK), so that a second run is
one line before its rendezvous. One rank for the whole run, not one per node: --save is
shared by every node (each rank writes its own files there), and locks per node would
refuse each other.

* The lock is ``flock`` on the file, which the kernel releases when its holder dies
  however it dies (and which NFSv4, Lustre with ``-o flock`` and GPFS extend across hosts),
  plus a record in the file naming the holder: host, PID and its start time, the command.
* A live holder (the flock is taken) is refused by its host and PID.
* A record left by a process that died on this host (``kill -9``, a crash) is stale: the
  PID is gone or belongs to another process now. It is taken over, in one line.
* A record of another host whose flock is free: on file systems that carry flock across
  hosts (NFSv4, Lustre with ``-o flock``, GPFS) its run is gone (a failed node, a SIGKILL
  in the scheduler's grace time), so it is taken over in one warning line, and a requeued
  job or an elastic restart on another node goes on by itself. Where flock is local to each
  host (``--save-lock-flock-local``) it is refused, naming the host and PID.
* Without flock at all (Lustre ``noflock``, NFS ``nolock``) the file is created with
  ``O_EXCL``: of two runs started at once one creates it, the other finds it and is refused.
* Released (the file removed) when the run ends, also when the exit watchdog ends it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import threading
import time
from typing import Any

from megatron_taco import io
from megatron_taco.checkpoint.config import CheckpointConfig, same_directory
from megatron_taco.checkpoint.engine import free_space
from megatron_taco.checkpoint.layout import (
    ITER_DIR,
    LEFTOVER,
    TRACKER_FILENAME,
    existing_checkpoints,
)
from megatron_taco.errors import ConfigError
from megatron_taco.runtime.procfs import proc_stat

logger = logging.getLogger(__name__)


def check_save_dir(save_dir: str) -> None:
    """--save is created and test-written now, so that a wrong path fails before any
    rendezvous instead of at the first save."""
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise ConfigError(f"--save: {save_dir} exists and is not a directory")
    try:
        os.makedirs(save_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--save: cannot create {save_dir}: {e.strerror or e}") from None
    probe = os.path.join(save_dir, f".write_test.{os.uname().nodename}.{os.getpid()}")
    try:
        io.write_durably(probe, lambda f: f.write(b"megatron_taco write test\n"))
    except OSError as e:
        raise ConfigError(
            f"--save: cannot write in {save_dir}: {e.strerror or e} ({free_space(save_dir)})"
        ) from None
    finally:
        io.remove(probe)


def check_own_save(checkpoint: CheckpointConfig) -> None:
    """A run never removes, replaces or rewinds checkpoints it did not write: its first save
    would rewind the tracker, a save at an old iteration would replace that checkpoint and
    --save-retain would delete the old run's last one. Refused unless it resumes them or
    --override-existing-checkpoints moves them aside (set_aside, by rank 0 under the lock)."""
    save = checkpoint.save
    held = existing_checkpoints(save)
    if held is None:
        return
    loads_save = same_directory(checkpoint.load, save)
    if checkpoint.override_existing_checkpoints:
        if loads_save and checkpoint.finetune:
            # Moved aside before the load, the checkpoint to fine-tune would be gone.
            raise ConfigError(
                f"--override-existing-checkpoints: --finetune loads --load {checkpoint.load}, "
                f"which is --save: its {held} would be moved aside before they are loaded; "
                "give --finetune another --save, without the flag"
            )
        if checkpoint.resumes_save:
            raise ConfigError(
                f"--override-existing-checkpoints: --load {checkpoint.load} is --save, whose "
                f"{held} this run would resume: drop --load to start anew, or the flag to resume"
            )
        return
    if checkpoint.finetune:
        # It restarts at iteration 0: "--load --save to resume them" is no way on.
        if loads_save:
            raise ConfigError(
                f"--save: {save} already holds {held}, which --finetune (it restarts at "
                "iteration 0) would replace, rewind or delete: give --finetune another --save, "
                f"and keep --load {checkpoint.load} to fine-tune from them"
            )
        raise ConfigError(
            f"--save: {save} already holds {held} of another run, which --finetune (it "
            "restarts at iteration 0) would replace, rewind or delete: give --finetune another "
            "--save, or --override-existing-checkpoints to move them aside"
        )
    if not checkpoint.resumes_save:
        raise ConfigError(
            f"--save: {save} already holds {held} of another run, which this run's saves "
            f"would replace, rewind or delete: pass --load {save} to resume them, or "
            "--override-existing-checkpoints to move them aside and start anew"
        )


def check_new_save(save: str) -> None:
    """A tool that writes one whole checkpoint into --save (taco-convert-checkpoint): never
    next to other checkpoints, whose tracker it would roll back."""
    held = existing_checkpoints(save)
    if held is not None:
        raise ConfigError(f"--save: {save} already holds {held}; give a new directory")
    if os.path.exists(save) and not os.path.isdir(save):
        raise ConfigError(f"--save: {save} exists and is not a directory")


SUPERSEDED_PREFIX = "superseded-"


def _is_checkpoint_entry(name: str) -> bool:
    return name == TRACKER_FILENAME or bool(ITER_DIR.match(name) or LEFTOVER.match(name))


def _new_aside(save_dir: str) -> tuple[str, str]:
    """A new superseded-<time>-<pid>[.N] directory and its name's tag: the name may be
    taken (a requeued container gets the same pid; two overrides within a second), and a
    directory that was there is never reused."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    base = os.path.join(save_dir, f"{SUPERSEDED_PREFIX}{stamp}-{os.getpid()}")
    aside, n = base, 1
    while True:
        try:
            os.mkdir(aside)
            return aside, os.path.basename(aside)[len(SUPERSEDED_PREFIX) :]
        except FileExistsError:
            n += 1
            aside = f"{base}.{n}"


def set_aside(save_dir: str, stores: tuple[str, ...] = ()) -> str | None:
    """--override-existing-checkpoints: move the checkpoints in ``save_dir`` and the
    non-empty ``stores`` into ``save_dir/superseded-<time>/`` (a store elsewhere: renamed to
    ``<store>.superseded-<time>``), tracker first so that no moment shows a tracker naming
    a moved checkpoint. Rank 0 only, holding the save lock, before any save. Returns the
    directory, None when there was nothing to move."""
    names = sorted(n for n in os.listdir(save_dir) if _is_checkpoint_entry(n))
    stores = tuple(s for s in stores if os.path.isdir(s) and os.listdir(s))
    if not names and not stores:
        return None
    aside, tag = _new_aside(save_dir)
    # The checkpoints name their tokenizer copy relative to their directory's parent: the
    # copies go with them (copied: the new run may share one, and none is ever deleted).
    from megatron_taco.data.tokenizer import TOKENIZER_DIR

    copies = os.path.join(save_dir, TOKENIZER_DIR)
    if names and os.path.isdir(copies):
        shutil.copytree(copies, os.path.join(aside, TOKENIZER_DIR), symlinks=True)
    names.sort(key=lambda n: n != TRACKER_FILENAME)
    for name in names:
        os.rename(os.path.join(save_dir, name), os.path.join(aside, name))
    for store in stores:
        inside = same_directory(os.path.dirname(os.path.abspath(store)), save_dir)
        target = (
            os.path.join(aside, os.path.basename(store))
            if inside
            else f"{store.rstrip(os.sep)}.{SUPERSEDED_PREFIX}{tag}"
        )
        os.rename(store, target)
    io.fsync_dir(save_dir)
    return aside


def check_own_stores(
    checkpoint: CheckpointConfig, stores: tuple[tuple[str, str], ...], *, fresh: bool
) -> None:
    """A fresh run would overwrite another run's store data (and un-commit what that run's
    checkpoints need): refused, as a --save holding checkpoints is (check_own_save). Not
    when --load names --save: a requeued run that died before its first checkpoint rewrites
    its own data, which no checkpoint needs."""
    if not fresh or checkpoint.resumes_save or checkpoint.override_existing_checkpoints:
        return
    for flag, directory in stores:
        if os.path.isdir(directory) and os.listdir(directory):
            raise ConfigError(
                f"{flag}: {directory} holds another run's data, which this run (it resumes "
                "no checkpoint) would overwrite: pass the --load of the run that wrote it to "
                "resume that run, or --override-existing-checkpoints to move it aside and "
                "start anew"
            )


LOCK_FILENAME = "run.lock"


_MAX_RECORD = 1 << 16


def _record() -> dict[str, Any]:
    stat = proc_stat(os.getpid())
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "start_ticks": stat.start_ticks if stat else None,
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv)[:500],
    }


def _read(fd: int) -> dict[str, Any] | None:
    """The holder's record; None for an empty file (free) or one that is not ours."""
    raw = os.pread(fd, _MAX_RECORD, 0)
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return record if isinstance(record, dict) and {"host", "pid"} <= set(record) else None


def _alive(record: dict[str, Any]) -> bool:
    """Whether the process a record of this host names is still running (same PID, same
    start time: a reused PID is another process)."""
    stat = proc_stat(record["pid"]) if isinstance(record["pid"], int) else None
    if stat is None or stat.state in "ZXx":
        return False
    return record.get("start_ticks") in (None, stat.start_ticks)


def _holder(record: dict[str, Any] | None) -> str:
    if record is None:
        return "another process (its record is missing or unreadable)"
    since = f", since {record['since']}" if record.get("since") else ""
    return f"pid {record['pid']} on host {record['host']}{since}"


def _flock(fd: int, path: str) -> bool | None:
    """True: taken; False: held by another open file; None: this file system has no locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            logger.warning(
                "--save: %s cannot be locked here (%s); relying on its record alone",
                path,
                e.strerror,
            )
            return None
        raise


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


class SaveLock:
    """The held lock of one --save; release() is idempotent and thread-safe (the exit
    watchdog may release it while the main thread does)."""

    def __init__(self, path: str, fd: int) -> None:
        self.path, self._fd = path, fd
        self._mutex = threading.Lock()

    def release(self) -> None:
        with self._mutex:
            if self._fd is None:
                return
            try:
                if _same_file(self._fd, self.path):
                    os.unlink(self.path)  # while still locked: no one takes a dying file
            except OSError as e:
                logger.warning("--save: could not remove %s: %s", self.path, e.strerror)
            finally:
                os.close(self._fd)  # unlocks
                self._fd = None


def _open(path: str) -> tuple[int, bool] | None:
    """(fd, whether this call created the file); None when it vanished meanwhile."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigError(f"--save: cannot open {path}: {e.strerror or e}") from None
    try:
        return os.open(path, flags), False
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ConfigError(f"--save: cannot open {path}: {e.strerror or e}") from None


def take_save_lock(save_dir: str, *, flock_local: bool = False) -> SaveLock:
    """The lock on ``save_dir`` (which exists: check_save_dir made it), or a ConfigError naming
    the run that holds it. ``flock_local``: this file system's flock does not span hosts."""
    path = os.path.join(save_dir, LOCK_FILENAME)
    while True:
        opened = _open(path)
        if opened is None:
            continue  # its holder removed it between our two opens: again
        fd, created = opened
        try:
            locked = _flock(fd, path)
            if locked and not _same_file(fd, path):
                os.close(fd)  # its holder removed it between our open and flock: again
                continue
            _claim(fd, path, _read(fd), locked, created=created, flock_local=flock_local)
            return SaveLock(path, fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise


def _claim(
    fd: int,
    path: str,
    record: dict[str, Any] | None,
    locked: bool | None,
    *,
    created: bool,
    flock_local: bool,
) -> None:
    save_dir = os.path.dirname(path)
    # Without flock, a file this run did not create and that names no one is another run's
    # claim being written (it created the file first, O_EXCL).
    if locked is False or (locked is None and record is None and not created):
        unlocked = f"; this file system has no locks: if no run uses it, remove {path}"
        raise ConfigError(
            f"--save: {save_dir} is in use by another run ({_holder(record)}; {path}): "
            f"wait for it to end, or give another --save{unlocked if locked is None else ''}"
        )
    if record is not None:
        if record["host"] != socket.gethostname() and locked and not flock_local:
            logger.warning(
                "--save: %s was held by %s, whose lock is free: that run is gone "
                "(flock spans hosts here; if not, pass --save-lock-flock-local); "
                "taking it over",
                path,
                _holder(record),
            )
        elif record["host"] != socket.gethostname():
            raise ConfigError(
                f"--save: {save_dir} is in use by a run on another host ({_holder(record)}; "
                f"{path}): wait for it to end, or give another --save; if that run is gone "
                f"(its node failed), remove {path}"
            )
        elif _alive(record) and record["pid"] != os.getpid():
            raise ConfigError(
                f"--save: {save_dir} is in use by another run ({_holder(record)}; {path}): "
                "wait for it to end, or give another --save"
            )
        elif record["pid"] != os.getpid():
            logger.warning(
                "--save: %s was held by %s, which is no longer running; taking it over",
                path,
                _holder(record),
            )
    data = json.dumps(_record()).encode("utf-8")
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


@contextlib.contextmanager
def save_lock(
    save_dir: str | None, rank: int, exit_actions: list | None = None, *, flock_local: bool = False
):
    """Held by global rank 0 for the ``with`` block (nothing for other ranks or without
    --save); ``exit_actions``: where an exit watchdog finds what to release before it ends
    the process."""
    if save_dir is None or rank != 0:
        yield None
        return
    lock = take_save_lock(save_dir, flock_local=flock_local)
    if exit_actions is not None:
        exit_actions.append(lock.release)
    try:
        yield lock
    finally:
        lock.release()
        if exit_actions is not None:
            exit_actions.remove(lock.release)
