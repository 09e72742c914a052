"""Preemption, time limits and launcher death: how a rank leaves, always with one line.

* Exit signals (``--exit-signal-handler``, on by default) inside the training loop: SIGTERM,
  SIGINT or SIGUSR1 on any rank only sets a flag. At the end of every iteration the ranks
  agree on the flags, in one all-reduce (MAX) of host values over the world (a gloo group,
  which never waits for a GPU: the training loop's _agree_on_host); when one is set,
  every rank saves a checkpoint (with ``--save``) and exits 0. Every later exit signal is
  absorbed until the save is done (SLURM's time-limit warning, then a TERM forwarded as
  USR1, must not kill the save), except a second SIGINT ``REPEAT_WINDOW_S`` or more after
  the first: an interactive user's second Ctrl-C still kills at once.
* Outside the loop (start-up, rendezvous, data and model set-up, teardown) nothing reads the
  flags, and a rank may be blocked in C++ (a TCPStore connect, a collective) where no Python
  signal handler runs. There the monitor's watchdog thread ends the process at once: it
  learns of a signal through ``signal.set_wakeup_fd`` (written by the C-level handler even
  while the main thread is blocked), prints one line naming what happened and where, and
  calls ``os._exit``. It holds ``_lock`` while it decides, and the loop takes the same lock
  to start deferring, so a rank never dies inside a save.
* ``--exit-duration-in-mins``: the same exit once that long has passed since the process
  started (ranks agree through the same all-reduce).
* Ranks never outlive their launcher: the kernel sends SIGTERM when the parent dies
  (PR_SET_PDEATHSIG), and the watchdog notices when the parent, or the ``deepspeed``
  runner above DeepSpeed's per-node launcher, exits. DeepSpeed's runner forwards nothing on a
  single node, and its per-node launcher keeps running when the runner dies. The tie is made
  first thing in ``main()`` (``ExitMonitor.tie_to_launcher``), before the flags are parsed and
  the checkpoint verified, which can take minutes. Ranks of mpirun (MPI's variables, no
  LOCAL_RANK yet) are tied to their launcher too. Inside the training loop a dead launcher
  is an exit request like a signal; the save that answers it may wait for a stalled rank,
  so the watchdog ends the rank ``--orphan-grace-seconds`` after the launcher's death
  anyway, with one line naming the last complete checkpoint.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import math
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from megatron_taco.arguments import option, require
from megatron_taco.errors import ConfigError
from megatron_taco.runtime.launcher import (
    DEEPSPEED_NODE_LAUNCHER,
    launched_by_launcher,
    launcher_rank,
    orphaned_at_start,
)
from megatron_taco.runtime.procfs import (
    cmdline,
    get_pdeathsig,
    init_name,
    proc_stat,
    process_name,
    process_start_time,
    set_pdeathsig,
)

logger = logging.getLogger("megatron_taco.resilience")

REPEAT_WINDOW_S = 2.0
# What DeepSpeed's per-node launcher and torchrun's agent give their ranks between SIGTERM and
# SIGKILL: a dead launcher leaves a rank at least as long to finish its exit save.
ORPHAN_GRACE_S = 30.0
WATCHDOG_INTERVAL_S = 1.0
_DEATH_GRACE_S = 0.5
DEFAULT_EXIT_SIGNALS = "SIGTERM,SIGINT,SIGUSR1"
# Uncatchable, used by torch's DataLoader (SIGCHLD), or faults that must stay fatal.
_UNUSABLE = {"SIGKILL", "SIGSTOP", "SIGCHLD", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT"}
_LEFTOVER_HOOK = False
# The parent a rank had at the top of its entry point (tie_at_start): tie_to_launcher ties
# to it, so that a launcher dying during the imports before main() is seen there too.
_started_under: int | None = None


def _signal_by_name(token: str) -> signal.Signals | None:
    token = token.strip().upper()
    if token.isdigit():
        try:
            return signal.Signals(int(token))
        except ValueError:
            return None
    name = token if token.startswith("SIG") else "SIG" + token
    return getattr(signal.Signals, name, None)


@dataclass(frozen=True)
class ExitConfig:
    exit_signal_handler: bool = option(
        True,
        "On by default (Megatron's is off): a signal from --exit-signals on any rank makes every "
        "rank finish the current iteration, save a checkpoint (with --save) and exit 0. Later "
        "signals are absorbed until the save is done, except a second SIGINT (Ctrl-C) 2 s or "
        "more after the first, which kills at once.",
        flag="--exit-signal-handler",
    )
    exit_signals: str = option(
        DEFAULT_EXIT_SIGNALS,
        "Comma-separated signals that --exit-signal-handler catches (names or numbers).",
        flag="--exit-signals",
    )
    exit_duration_in_mins: float | None = option(
        None,
        "Save and exit 0 after the first iteration that ends this many minutes after the "
        "process started (leave room for one iteration and a save before the job's limit).",
        flag="--exit-duration-in-mins",
    )
    orphan_grace_seconds: float = option(
        ORPHAN_GRACE_S,
        "How long a rank whose launcher died while it trained goes on finishing the "
        "iteration and the exit save; then it leaves, exit 1, with one line naming the last "
        "complete checkpoint (the tracker is written last: an abandoned save is never taken "
        "for one). A save waiting for a stalled rank would otherwise keep the GPUs until "
        "--filesystem-timeout-minutes or --distributed-timeout-minutes. Raise it where the "
        "exit save takes longer. A rank whose launcher lives always finishes its exit save.",
        flag="--orphan-grace-seconds",
    )

    def __post_init__(self) -> None:
        cls = ExitConfig
        tokens = [t for t in str(self.exit_signals).split(",") if t.strip()]
        require(
            bool(tokens), cls, "exit_signals", f"give at least one, e.g. {DEFAULT_EXIT_SIGNALS}"
        )
        found = [_signal_by_name(t) for t in tokens]
        bad = [t.strip() for t, s in zip(tokens, found) if s is None or s.name in _UNUSABLE]
        require(
            not bad,
            cls,
            "exit_signals",
            f"{', '.join(bad)} is not a signal that can be caught for a clean exit; give e.g. "
            f"{DEFAULT_EXIT_SIGNALS}",
        )
        names = ",".join(dict.fromkeys(s.name for s in found if s is not None))
        object.__setattr__(self, "exit_signals", names)
        if self.exit_duration_in_mins is not None:
            require(
                _positive(self.exit_duration_in_mins),
                cls,
                "exit_duration_in_mins",
                f"must be > 0, got {self.exit_duration_in_mins!r}",
            )
        grace = self.orphan_grace_seconds
        require(
            _positive(grace) or grace == 0,
            cls,
            "orphan_grace_seconds",
            f"must be a number of seconds >= 0, got {grace!r}",
        )

    @property
    def signals(self) -> tuple[signal.Signals, ...]:
        return tuple(signal.Signals[name] for name in self.exit_signals.split(","))


def _positive(value) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value) and value > 0


def tie_at_start(program: str) -> None:
    """First thing in an entry point, before torch and DeepSpeed are imported (seconds, in
    which a cancelled or OOM-killed job start can take the launcher away): a rank whose
    launcher is already gone exits now with one line, exit 1; otherwise the parent-death
    signal is armed now, and a SIGTERM before main() is one line too."""
    global _started_under
    if _started_under is not None or not launched_by_launcher():
        return
    parent = os.getppid()
    if not orphaned_at_start(parent, process_name(parent), init_name()):

        def on_sigterm(signum, frame) -> None:
            if os.getppid() == parent:
                # A stop, not an error: launchers send it when a peer failed first (its
                # line is the one to read) or the job was cancelled.
                _start_line(program, "SIGTERM received before the rank started", 128 + signum)
            _start_line(program, "its launcher exited before the rank started", 1)

        signal.signal(signal.SIGTERM, on_sigterm)
        set_pdeathsig(signal.SIGTERM)
        if os.getppid() == parent:  # armed while the launcher lived: it fires when it dies
            _started_under = parent
            return
    _start_line(program, "its launcher exited before the rank started", 1)


def _start_line(program: str, why: str, code: int) -> None:
    """Exit ``code`` with one line: an error for an orphan (code 1), a stop for a signal."""
    adopter = os.getppid()
    orphan = code == 1
    parent = f" (its parent is now {process_name(adopter)}, pid {adopter})" if orphan else ""
    print(exit_line(program, why + parent, error=orphan), file=sys.stderr, flush=True)
    os._exit(code)


def exit_line(program: str, what: str, error: bool) -> str:
    """The one line a rank ends with: an error (a dead launcher), or a stop (a signal: the
    launcher sends it when a peer failed first, whose line is the error to read)."""
    return f"{program}: {'error: ' if error else ''}rank {launcher_rank()}: {what}; exiting"


def ignore_in_worker(signums: tuple[int, ...], rank: tuple[int, int], _worker_id: int = 0) -> None:
    """DataLoader worker_init_fn. The rank decides when to stop: a worker killed by the
    group's (or the launcher's) SIGTERM would make the rank raise before it could save. The
    worker dies with its rank instead, at once: it holds copies of the rank's sockets, and
    peers notice a dead rank only when those close. ``rank``: (pid, start ticks)."""
    for signum in signums:
        signal.signal(signum, signal.SIG_IGN)
    # The fork inherited the rank's wakeup pipe: this process's signals are not the rank's.
    signal.set_wakeup_fd(-1)
    set_pdeathsig(signal.SIGKILL)
    # A rank killed between the fork and the line above sends no death signal, and torch's
    # watchdog, created after this function, would take the new parent (a subreaper such as
    # taco-launch) for the rank: the worker would outlive the job and hold its launcher
    # forever (a fault-campaign trial under load). Checked after arming, so a rank dying from
    # here on is covered by the signal.
    rank_pid, rank_start = rank
    if os.getppid() == rank_pid:
        return  # still the rank's child (fork, spawn): armed while it lived
    # forkserver (the parent is the server), or the rank is gone and this was re-parented;
    # the start time tells the rank from a process that took its pid since.
    stat = proc_stat(rank_pid)
    if stat is None or stat.state in "ZXx" or stat.start_ticks != rank_start:
        os._exit(0)


def _kill_leftover_workers() -> None:
    """atexit, before multiprocessing's own hook: that one terminate()s daemonic children with
    SIGTERM, which our DataLoader workers ignore, and then joins them forever. Iterators
    still alive at exit (e.g. held by a traceback) would hang the rank."""
    import multiprocessing

    children = [p for p in multiprocessing.active_children() if p.daemon]
    if children:
        # torch's SIGCHLD handler would raise "worker killed" into the exiting interpreter.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for p in children:
        p.kill()
        p.join(timeout=5)


class ExitMonitor:
    """Signal handlers, the launcher watchdog and the wall-clock limit of one process."""

    def __init__(
        self,
        config: ExitConfig | None = None,
        *,
        repeat_window: float = REPEAT_WINDOW_S,
        watchdog_interval: float = WATCHDOG_INTERVAL_S,
        program: str | None = None,
    ) -> None:
        self.config = config or ExitConfig()
        self.repeat_window = repeat_window
        self.watchdog_interval = watchdog_interval
        self.program = program or os.path.basename(sys.argv[0] if sys.argv else "") or "rank"
        self.start_time = process_start_time()
        self.received: int = 0  # the first exit signal's number
        self.absorbed: int = 0  # exit signals after the first, absorbed
        self.launcher_gone: str | None = None  # why, once the launcher died
        self._gone_at: float | None = None  # when the watchdog saw it (monotonic)
        # What an abandoned save leaves: one clause naming the last complete checkpoint
        # (set by the driver, which knows --save).
        self.last_complete: Callable[[], str] | None = None
        # What the rank is doing, for the line of an exit outside the loop, and what it was
        # doing when the first request came.
        self.phase = "start-up"
        self._seen_in: str | None = None
        # Run (by the watchdog, with _lock held) before such an exit, e.g. releasing --save.
        self.exit_actions: list[Callable[[], None]] = []
        self._first_seen: float | None = None
        self._previous: dict[int, object] = {}
        self._pid = os.getpid()
        self._pdeathsig_before: int | None = None
        self._links: list[tuple[int, int]] = []  # (child, parent) pairs that must hold
        self._names: dict[int, str] = {}
        self._tied = self._installed = False
        self._signalled = 0  # an exit signal seen through the wakeup pipe
        self._wakeup: tuple[int, int] | None = None  # the pipe (read, write)
        self._wakeup_before: int | None = None
        self._lock = threading.Lock()
        self._deferred = 0  # > 0 while the training loop reads the flags
        self._answered = False  # the loop decided to stop: later requests are its
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None

    # -- set-up and teardown --------------------------------------------------------------

    def tie_to_launcher(self) -> None:
        """Die with the launcher from now on (idempotent); first thing in main(), before
        the configs (and the checkpoint behind --load) are checked. Until install() the
        kernel's SIGTERM at the launcher's death ends the rank with one line."""
        self._pid = os.getpid()
        if self._tied or not launched_by_launcher():
            return
        self._tied = True
        parent = _started_under if _started_under is not None else os.getppid()
        self._links = [(self._pid, parent)]
        stat = proc_stat(parent)
        if stat is not None and DEEPSPEED_NODE_LAUNCHER in cmdline(parent):
            # DeepSpeed's per-node launcher outlives the `deepspeed` runner above it (the
            # runner has no signal handler on a single node): watch the runner as well.
            self._links.append((parent, stat.ppid))
        self._names = {pid: process_name(pid) for _, pid in self._links}
        before = get_pdeathsig()
        if set_pdeathsig(signal.SIGTERM):
            self._pdeathsig_before = before
        if not self._installed:
            self._catch((signal.SIGTERM,))
        self._start_watchdog()

    def install(self, config: ExitConfig | None = None) -> None:
        """The exit-signal handlers of ``config`` (default: the constructor's), and the tie
        to the launcher if tie_to_launcher() did not make it yet."""
        if config is not None:
            self.config = config
        self._pid = os.getpid()
        self._installed = True
        self._catch(self.config.signals if self.config.exit_signal_handler else ())
        self.tie_to_launcher()
        self._start_watchdog()

    def _catch(self, signums: tuple[int, ...]) -> None:
        """Handle exactly ``signums`` (restoring the others this monitor took), through the
        wakeup pipe as well."""
        if threading.current_thread() is not threading.main_thread():
            # Python lets only the main thread set handlers (e.g. pretrain() run in a thread).
            logger.warning("not in the main thread: --exit-signal-handler is not installed")
            return
        for signum in [s for s in self._previous if s not in signums]:
            signal.signal(signum, self._previous.pop(signum))
        for signum in signums:
            # Installed again for each run of a sweep: keep the handler from before the first.
            self._previous.setdefault(signum, signal.signal(signum, self._handle))
        if self._previous and self._wakeup is None:
            read, write = os.pipe()
            os.set_blocking(read, False)
            os.set_blocking(write, False)
            self._wakeup = (read, write)
            self._wakeup_before = signal.set_wakeup_fd(write, warn_on_full_buffer=False)

    def _start_watchdog(self) -> None:
        if self._watchdog is None and (self._links or self._wakeup is not None):
            self._stop.clear()
            self._watchdog = threading.Thread(target=self._watch, name="exit-watchdog", daemon=True)
            self._watchdog.start()

    def uninstall(self) -> None:
        self._stop.set()
        if self._watchdog is not None:
            if self._wakeup is not None:
                with contextlib.suppress(OSError):
                    os.write(self._wakeup[1], b"\0")  # wakes it; 0 is no signal
            self._watchdog.join(timeout=5)
            self._watchdog = None
        if self._pdeathsig_before is not None:
            set_pdeathsig(self._pdeathsig_before)
            self._pdeathsig_before = None
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._wakeup_before if self._wakeup_before is not None else -1)
            for fd in self._wakeup:
                os.close(fd)
            self._wakeup = self._wakeup_before = None
        self._links, self._tied, self._installed = [], False, False

    def _handle(self, signum: int, frame) -> None:
        # Only flags: this runs between two bytecodes of whatever the main thread was doing.
        if os.getpid() != self._pid:
            return  # a forked DataLoader worker inherited the handler; its rank decides
        now = time.monotonic()
        if not self.received:
            self.received, self._first_seen = signum, now
            self._seen_in = self._seen_in or self.phase
            return
        if (
            signum == signal.SIGINT == self.received
            and now - self._first_seen >= self.repeat_window
        ):
            # A person's second Ctrl-C: stop now, whatever is being written.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        # A launcher's or the scheduler's later signal (a forwarded copy, SLURM's TERM after
        # its USR1 warning): the save it asks for is already coming; killing it would lose it.
        self.absorbed += 1

    @property
    def worker_init_fn(self):
        """Every loader's, also with --no-exit-signal-handler: a worker must die with its
        rank either way (it then ignores no signal)."""
        global _LEFTOVER_HOOK
        if self._previous and not _LEFTOVER_HOOK:
            # Registered after multiprocessing's hook, so it runs before it.
            atexit.register(_kill_leftover_workers)
            _LEFTOVER_HOOK = True
        signums = tuple(int(s) for s in self._previous)
        me = proc_stat(os.getpid())
        rank = (os.getpid(), me.start_ticks if me is not None else -1)
        return functools.partial(ignore_in_worker, signums, rank)

    # -- the watchdog ---------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.is_set():
            self._wait_for_signal()
            if self._stop.is_set():
                return
            self._check_links()
            if self._signalled == signal.SIGTERM and self._links and not self._deferred:
                # The launcher's death signal comes when the thread that started us exits,
                # which may be a moment before the rest of the launcher (the re-parenting
                # that shows it): wait for that, to name the launcher rather than a SIGTERM.
                deadline = time.monotonic() + _DEATH_GRACE_S
                while self._links and time.monotonic() < deadline:
                    time.sleep(0.02)
                    self._check_links()
            self.exit_unless_deferred()
            self._abandon_when_overdue()

    def _check_links(self) -> None:
        for child, parent in list(self._links):
            stat = proc_stat(child)
            if stat is None or stat.ppid != parent:
                # A process's children are re-parented the moment it exits.
                name = self._names[parent]
                self.launcher_gone = f"launcher process {parent} ({name}) exited"
                self._seen_in = self._seen_in or self.phase
                if child != self._pid:
                    # The deepspeed runner alone: an exit request, but the per-node launcher
                    # above this rank lives and sets its save no deadline; watch it still.
                    self._links.remove((child, parent))
                    continue
                self._gone_at = time.monotonic()  # the orphan grace starts
                self._links = []
                return

    def _wait_for_signal(self) -> None:
        if self._wakeup is None:
            self._stop.wait(self.watchdog_interval)
            return
        ready, _, _ = select.select([self._wakeup[0]], [], [], self.watchdog_interval)
        if not ready:
            return
        with contextlib.suppress(BlockingIOError):
            for signum in os.read(self._wakeup[0], 64):
                # Other signals with a Python handler (torch's SIGCHLD) come through too.
                if signum in self._previous and not self._signalled:
                    self._signalled = signum
                    self._seen_in = self._seen_in or self.phase

    @contextlib.contextmanager
    def deferred(self, phase: str = "training"):
        """While the training loop runs: exit requests are flags that the loop reads at the
        end of every iteration (save, then exit 0); a request the loop did not answer is
        acted on when it ends. An exception leaving the loop is the run's end, reported by
        the driver in its own line."""
        with self._lock:
            self._deferred += 1
            before, self.phase = self.phase, phase
        try:
            yield
        except BaseException:
            self._answered = True
            raise
        finally:
            with self._lock:
                self._deferred -= 1
                self.phase = before
        self.exit_unless_deferred()

    @contextlib.contextmanager
    def doing(self, what: str):
        """Names what the loop does meanwhile (e.g. "the exit save of iteration 3"), for the
        line of a rank that abandons it (_abandon_when_overdue)."""
        before, self.phase = self.phase, what
        try:
            yield
        finally:
            self.phase = before

    @contextlib.contextmanager
    def answering_errors(self):
        """Around a run: an error that a dead launcher caused (its rendezvous store's
        connection closed) ends the rank with the launcher's line, not a traceback
        (answer_pending). A ConfigError is the run's own line."""
        try:
            yield
        except ConfigError:
            raise
        except BaseException:
            self.answer_pending()
            raise

    def answer_pending(self) -> None:
        """For an error that ends the rank outside the loop: a launcher killed outright closes
        its sockets (the rendezvous store's) a moment before its children are re-parented,
        so the error may be the first sign of its death. Waits that moment, and ends the
        rank with the launcher's line if that is what happened (or a signal came)."""
        deadline = time.monotonic() + _DEATH_GRACE_S
        while self._links and not self._answered and time.monotonic() < deadline:
            self._check_links()
            time.sleep(0.02)
        self.exit_unless_deferred()

    def exit_unless_deferred(self) -> None:
        """Outside the training loop, a launcher that died or an exit signal ends the process
        now, with one line (watchdog thread, or the loop's end)."""
        with self._lock:  # held until os._exit: the loop cannot start a save meanwhile
            if self._deferred or self._answered:
                return
            signum = self.received or self._signalled
            if self.launcher_gone is not None:
                what, code = self.launcher_gone, 1
            elif signum:
                what, code = f"{signal.Signals(signum).name} received", 128 + signum
            else:
                return
            orphan = self.launcher_gone is not None
            self._leave(lambda: f"{what} during {self._seen_in or self.phase}", code, orphan)

    def _abandon_when_overdue(self) -> None:
        """Inside the loop a dead launcher is an exit request, answered by a save; but the
        iteration or the save may wait for a rank that never comes (stalled, or gone), in a
        collective or the file group's barrier, for their timeouts (10 and 60 min by
        default). --orphan-grace-seconds after the launcher's death the rank leaves anyway
        (outside the loop exit_unless_deferred has ended it at once). The tracker is written
        last, once the checkpoint is complete and renamed into place: what is cut short here
        never becomes the latest checkpoint."""
        gone_at, grace = self._gone_at, self.config.orphan_grace_seconds
        if gone_at is None or time.monotonic() - gone_at < grace:
            return
        with self._lock:

            def line() -> str:
                during, now = self._seen_in or self.phase, self.phase
                what = ", which was" if during == now else f"; {now} was"
                last = f"; {self.last_complete()}" if self.last_complete is not None else ""
                return (
                    f"{self.launcher_gone} during {during}{what} abandoned {grace:g} s later "
                    f"(--orphan-grace-seconds){last}"
                )

            self._leave(line, 1)

    def _leave(self, what: Callable[[], str], code: int, error: bool = True) -> None:
        """Ends the process now, with one line: "<program>: error: rank N: <what>; exiting"
        (a signal's: "<program>: rank N: ...", a stop, not a second error beside the line of
        the peer whose failure made the launcher send it)."""
        # Nothing from here may keep the rank alive: a stalled reader of stderr (its mode is
        # shared with the launcher and the shell: not made non-blocking), a hung file system
        # under the exit actions or ``what``. SIGALRM's default action ends the process.
        signal.alarm(5)
        for action in self.exit_actions:
            with contextlib.suppress(Exception):
                action()
        line = exit_line(self.program, what(), error) + "\n"
        with contextlib.suppress(OSError):
            os.write(2, line.encode())
        os._exit(code)

    # -- the decision -----------------------------------------------------------------------

    def local_flags(self) -> list[int]:
        """[signal number or 0, launcher gone, time limit reached]: this rank's part of the
        end-of-iteration all-reduce (MAX, the loop's _agree_on_host)."""
        limit = self.config.exit_duration_in_mins
        over = limit is not None and time.time() - self.start_time >= 60 * limit
        return [int(self.received), int(self.launcher_gone is not None), int(over)]

    def reason(self, flags: list[int]) -> str | None:
        """The reason to stop for flags reduced over every rank, or None. Not None is the
        loop's decision to save and stop: requests after it are answered by that."""
        signum, gone, over = (int(f) for f in flags)
        reasons = []
        if signum:
            reasons.append(f"{signal.Signals(signum).name} received (--exit-signal-handler)")
        if gone:
            reasons.append("a rank's launcher exited (ranks never outlive their launcher)")
        if over:
            reasons.append(f"--exit-duration-in-mins {self.config.exit_duration_in_mins:g} reached")
        if reasons:
            self._answered = True
        return "; ".join(reasons) or None
